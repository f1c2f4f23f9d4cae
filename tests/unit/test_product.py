"""The package is the product: ``kvpush`` imports, and its CLI runs, with nothing but kvpush
installed, and nothing in it imports kvpush's lab (``kvpush_lab``: benches, demos, peers).

Each check runs in a fresh interpreter behind an import blocker, a meta-path finder that refuses
the optional packages as if they were not installed, so that what this test process (or the
venv) happens to have does not hide an import."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvpush
from kvpush.cli import COMMANDS_GROUP

#: What a router host may lack: the lab and what the lab, the tests and vLLM bring.
OPTIONAL = ("kvpush_lab", "numpy", "vllm", "torch", "msgpack", "psutil", "prometheus_client")

#: Module names that are the lab's, never the product's.
LAB_MODULES = {"bench", "demo", "demo_vllm", "servers", "model", "peer"}

BLOCKER = """
import sys

BLOCKED = set(sys.argv[1].split(","))


class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None


sys.meta_path.insert(0, Refuse())
del sys.argv[1]
"""


def run_blocked(code: str, *args: str, blocked: tuple[str, ...] = OPTIONAL) -> tuple[int, str]:
    """Runs ``code`` in a fresh interpreter with ``blocked`` refused; its exit code and output.
    The code then checks that none of them got imported some other way (a .pth file)."""
    check = (
        "\nloaded = BLOCKED & {m.partition('.')[0] for m in sys.modules}"
        "\nassert not loaded, f'imported although blocked: {sorted(loaded)}'\n"
    )
    wrapped = f"{BLOCKER}\ntry:\n" + "".join(f"    {line}\n" for line in code.splitlines())
    wrapped += f"finally:\n{''.join(f'    {line}' + chr(10) for line in check.splitlines())}"
    done = subprocess.run(
        [sys.executable, "-c", wrapped, ",".join(blocked), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr


CLI = "from kvpush.cli import main\nsys.exit(main(sys.argv[1:]))"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["version"], f"kvpush {kvpush.__version__} (protocol kvpush/"),
        (["proxy", "--help"], "usage: kvpush proxy"),
        (["--help"], "{proxy,version}"),
    ],
)
def test_the_cli_runs_with_only_kvpush_installed(argv: list[str], expected: str) -> None:
    code, output = run_blocked(CLI, *argv)
    assert code == 0, output
    assert expected in output


def test_the_cli_lists_the_labs_commands_when_the_lab_is_installed() -> None:
    """The lab's commands come through its entry points; listing them needs nothing else of
    what a router host may lack."""
    added = {entry.name for entry in importlib.metadata.entry_points(group=COMMANDS_GROUP)}
    if not added:
        pytest.skip(f"no {COMMANDS_GROUP} entry points: kvpush's lab is not installed here")
    code, output = run_blocked(CLI, "--help", blocked=tuple(set(OPTIONAL) - {"kvpush_lab"}))
    assert code == 0, output
    assert "{bench,demo,model,proxy,version}" in output


@pytest.mark.parametrize(
    "argv", [["demo"], ["demo", "--core"], ["bench", "serving", "--quick"], ["model", "make", "x"]]
)
def test_lab_commands_without_the_lab_say_what_to_install(argv: list[str]) -> None:
    code, output = run_blocked(CLI, *argv)
    assert code == 2, output
    assert f"kvpush {argv[0]}: this command is part of kvpush's lab" in output
    assert "pip install kvpush-lab" in output
    assert f"scripts/dev {argv[0]}" in output


def test_no_product_module_imports_the_lab() -> None:
    """Every module of the package imports with the lab refused; one that needs the host's vLLM
    or torch (the connector) may fail for that, never for the lab."""
    code = """
import importlib, json, pkgutil
import kvpush
failed = {}
for module in pkgutil.walk_packages(kvpush.__path__, "kvpush."):
    try:
        importlib.import_module(module.name)
    except ModuleNotFoundError as error:
        failed[module.name] = error.name
print("FAILED-IMPORTS", json.dumps(failed))
"""
    status, output = run_blocked(code, blocked=("kvpush_lab",))
    assert status == 0, output
    # The connector's import of vLLM logs too: the answer is the marked line.
    (line,) = [line for line in output.splitlines() if line.startswith("FAILED-IMPORTS ")]
    failed = json.loads(line.removeprefix("FAILED-IMPORTS "))
    assert {root.partition(".")[0] for root in failed.values()} <= {"vllm", "torch"}, failed
    assert "kvpush.cli" not in failed
    assert "kvpush.router.http" not in failed


def imported_names(tree: ast.AST) -> list[str]:
    """Every module an ``import`` or ``from ... import`` under ``tree`` names."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.append(node.module)
    return names


def names_the_lab(tree: ast.AST) -> bool:
    return any(name.partition(".")[0] == "kvpush_lab" for name in imported_names(tree))


def test_the_product_package_holds_no_lab_module() -> None:
    package = Path(kvpush.__file__).parent
    names = {p.stem for p in package.rglob("*.py")} | {p.name for p in package.iterdir()}
    assert not names & LAB_MODULES, sorted(names & LAB_MODULES)
    importers = [
        path.relative_to(package).as_posix()
        for path in sorted(package.rglob("*.py"))
        if names_the_lab(ast.parse(path.read_text()))
    ]
    # The lab's commands come through entry points (kvpush.cli.COMMANDS_GROUP): no import.
    assert importers == []


def test_the_vllm_plugin_entry_point_loads_the_connectors_register() -> None:
    (plugin,) = [
        p
        for p in importlib.metadata.entry_points(group="vllm.general_plugins")
        if p.name == "kvpush"
    ]
    register = plugin.load()  # imports kvpush.vllm only: vLLM is imported when it is called
    assert register.__module__ == "kvpush.vllm"
    assert register.__qualname__ == "register"
    assert sys.modules["kvpush.vllm"].__file__ is not None
    assert Path(sys.modules["kvpush.vllm"].__file__).parent.parent == Path(kvpush.__file__).parent


def test_kvpush_is_imported_from_where_the_run_says() -> None:
    """``KVPUSH_EXPECT_FROM=DIR`` (set by the wheel check in scripts/dev): kvpush and its native
    module come from DIR (the clean venv's site-packages), not from a source tree."""
    expected = os.environ.get("KVPUSH_EXPECT_FROM")
    if not expected:
        pytest.skip("KVPUSH_EXPECT_FROM not set: this run tests whichever kvpush is importable")
    site = Path(expected).resolve()
    assert Path(kvpush.__file__).resolve().is_relative_to(site), kvpush.__file__
    native = sys.modules["kvpush._native"].__file__
    assert native is not None
    assert Path(native).resolve().is_relative_to(site), native
