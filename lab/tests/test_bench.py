"""``kvpush bench transfer`` runs end to end on a tiny cache: both workers start, every path
moves the bytes D checks, and the report has its rows and ratios. Timings are not asserted."""

from __future__ import annotations

import subprocess
import sys

from tests.support.nixl import nixl_or_skip


def test_bench_transfer_runs_and_prints_both_rows_and_ratios() -> None:
    nixl_or_skip()
    command = [sys.executable, "-m", "kvpush.cli", "bench", "transfer", "--gib", "0.03"]
    done = subprocess.run(
        [*command, "--repeats", "1"], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for layout in ("contiguous", "fragmented"):
        assert f"**{layout}**" in done.stdout
        assert f"] {layout} kvpush: " in done.stdout, "no progress line"
    assert done.stdout.count("| kvpush | ") == 2, done.stdout
    assert done.stdout.count("| plain NIXL, prepped (Python) | ") == 2, done.stdout
    assert "ratio kvpush / plain NIXL, prepped (Python), fragmented: throughput " in done.stdout
