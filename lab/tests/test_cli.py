"""The lab's commands as ``kvpush`` finds them: the ``kvpush.commands`` entry points the lab
declares, each handing its arguments to the lab's own parser."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from kvpush import cli
from kvpush_lab.cli import COMMANDS, Command


def test_the_entry_points_are_the_labs_commands() -> None:
    entries = [
        entry
        for entry in importlib.metadata.entry_points(group=cli.COMMANDS_GROUP)
        if entry.value.startswith("kvpush_lab.")
    ]
    if not entries:
        pytest.skip("kvpush's lab is installed without its entry points (reinstall it)")
    assert {entry.name: entry.load() for entry in entries} == {c.name: c for c in COMMANDS}


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: command.name)
def test_a_command_hands_its_arguments_to_the_labs_parser(
    command: Command, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        command.main(["--help"])
    assert exited.value.code == 0
    assert f"usage: kvpush {command.name} " in capsys.readouterr().out


def test_kvpush_runs_a_lab_command(capsys: pytest.CaptureFixture[str]) -> None:
    if "model" not in cli._added_commands():
        pytest.skip("kvpush's lab is installed without its entry points (reinstall it)")
    with pytest.raises(SystemExit) as exited:
        cli.main(["model", "--help"])
    assert exited.value.code == 0
    assert "usage: kvpush model " in capsys.readouterr().out


def test_kvpushs_own_commands_import_nothing_of_the_lab() -> None:
    code = (
        "import sys\nfrom kvpush.cli import main\nmain(['version'])\n"
        "assert 'kvpush_lab' not in sys.modules, 'kvpush version imported the lab'"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
