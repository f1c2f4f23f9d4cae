"""``kvpush bench client --quick`` on real servers: vLLM's own benchmark client through
``kvpush proxy`` to a kvpush pair and to upstream's pull pair with NIXL's progress thread off,
and straight at the one-core aggregated floor. Every request completes, every prompt token of a
pair reaches D over p2p, the upstream "best" pair does not spin a core while idle, and the
benchmark writes its section. Nothing here asserts on latency."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.benchmarks.serve", reason="needs vLLM (.venv-vllm)")

pytestmark = pytest.mark.e2e

SYSTEMS = ("aggregated-1core", "kvpush", "NixlConnector-best")


def test_vllms_client_runs_against_every_system_and_the_section_is_written(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Other\n\nkept\n")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "UCX_NET_DEVICES": "lo"}
    kvpush = str(Path(sys.executable).with_name("kvpush"))
    command = [kvpush, "bench", "client", "--quick", "--systems", ",".join(SYSTEMS)]
    done = subprocess.run(
        [*command, "--markdown", str(doc)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    (path,) = (tmp_path / "cache" / "kvpush" / "runs").glob("client-*/results/client-*.json")
    result = json.loads(path.read_text())
    runs = {run["system"]: run for run in result["runs"]}
    assert set(runs) == set(SYSTEMS)
    for system, run in runs.items():
        assert run["error"] is None, f"{system}: {run['error']}"
        assert run["completed"] == run["point"]["prompts"], system
        assert len(run["ttft"]) == run["completed"], system
    for pair in ("kvpush", "NixlConnector-best"):
        assert runs[pair]["p2p_share"] == pytest.approx(1.0), f"{pair} recomputed prompts"
        # The proxy's request log gives every request's P leg and handover.
        assert len(runs[pair]["handover"]) == runs[pair]["completed"], pair
    # NIXL's progress thread spins a whole core while it runs; with it off, upstream's idle pair
    # burns a fraction of one.
    assert result["idle_cores"]["NixlConnector-best"][0] < 0.5, result["idle_cores"]
    stages = runs["kvpush"]["stages"]
    assert len(stages["posted → completed"]) >= runs["kvpush"]["completed"]

    text = doc.read_text()
    assert "## Other\n\nkept" in text
    assert "## vLLM's benchmark client (vllm bench serve)" in text
    assert "TTFT p50 at 512 in at 0.5x <= 1.1x aggregated-1core's:" in text
