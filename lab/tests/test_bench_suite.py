"""``kvpush bench`` alone runs the suite: the chosen steps in order, each writing its sections
of the document, a summary at the end, and a non-zero exit when a step cannot run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.nixl import nixl_or_skip


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvpush.cli", "bench", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)


def test_suite_runs_the_chosen_steps_and_writes_their_sections(tmp_path: Path) -> None:
    nixl_or_skip()
    doc = tmp_path / "benchmarks.md"
    done = bench("--only", "idle", "--quick", "--doc", str(doc))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "==== kvpush bench idle ====" in done.stdout
    assert "==== kvpush bench control ====" not in done.stdout
    assert "## Idle cost: the transfer machinery alone" in doc.read_text()
    summary = done.stdout.rsplit("==== kvpush bench: sections written to", 1)[1]
    assert "idle" in summary
    assert "ok" in summary


def test_suite_refuses_unknown_steps() -> None:
    done = bench("--only", "idle,speed", "--quick")
    assert done.returncode == 2
    assert "unknown step(s) speed" in done.stdout
