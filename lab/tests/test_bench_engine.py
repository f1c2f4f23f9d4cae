"""``kvpush bench engine``: vLLM's real scheduler serves every request with each connector, the
hook timer counts each outermost hook once, kvpush's worker hooks are timed in both kinds of
step, and the section is written. Nothing here asserts on time."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vLLM (.venv-vllm)")

from kvpush_lab.bench import engine


class Hooks:
    def __init__(self) -> None:
        self.seen: list[str] = []

    def outer(self) -> str:
        self.seen.append("outer")
        return self.inner()

    def inner(self) -> str:
        self.seen.append("inner")
        return "answer"

    def fails(self) -> None:
        raise KeyError("hook")


def test_the_timer_counts_a_hook_called_by_another_once_and_a_failing_one_too() -> None:
    hooks, timer = Hooks(), engine.HookTimer()
    timer.wrap(hooks, ("outer", "inner", "fails", "absent"))
    assert hooks.outer() == "answer"
    assert hooks.seen == ["outer", "inner"]
    assert dict(timer.calls) == {"outer": 1}
    with pytest.raises(KeyError):
        hooks.fails()
    assert timer.calls["fails"] == 1
    wall, cpu = timer.take()
    assert wall > 0
    assert cpu >= 0
    assert timer.take() == (0, 0)
    hooks.inner()
    assert timer.calls["inner"] == 1, "once the outer call is over, a hook counts again"


@pytest.mark.parametrize("connector", engine.CONNECTORS)
def test_every_request_gets_its_kv_and_ends(connector: str, tmp_path: Path) -> None:
    result = engine.run(connector, 4, 24, tmp_path)
    assert result.failures == 0
    assert len(result.arrival_delays) == 24
    assert any(step.computing for step in result.steps)
    assert any(not step.computing for step in result.steps), "requests waited for their KV"
    assert max(step.in_flight for step in result.steps) <= 4
    calls = {name: calls for name, (calls, _, _) in result.hooks.items()}
    assert calls["scheduler.get_num_new_matched_tokens"] >= 24
    assert calls["scheduler.build_connector_meta"] == len(result.steps)
    if connector.startswith(engine.KVPUSH):
        assert result.worker_measured
        assert calls["worker.get_transfer_results"] == len(result.steps)
        assert all(step.worker_wall > 0 for step in result.steps)
    else:
        assert not result.worker_measured
        assert not any(name.startswith("worker.") for name in calls)


def test_the_section_says_which_rows_time_the_scheduler_role_only(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Other\n\nkept\n")
    parser = argparse.ArgumentParser()
    engine.add_arguments(parser)
    args = parser.parse_args(
        ["--quick", "--markdown", str(doc), "--results", str(tmp_path / "results")]
    )
    assert engine.main(args) == 0
    text = doc.read_text()
    assert "## Other\n\nkept" in text
    assert f"## {engine.SECTION}" in text
    for connector in engine.CONNECTORS:
        assert f"| {connector} |" in text
    assert "stand-in, not timed" in text
    assert "Not judged here" in text
    assert list((tmp_path / "results").glob("engine-*.json"))


# ---- the real-server variant's records ----------------------------------------------------

from kvpush_lab.bench import engine_servers  # noqa: E402
from kvpush_lab.bench.engine_servers import Row  # noqa: E402


def row(at: int, role: str, hook: str, wall: int = 10, scheduled: int | None = None) -> Row:
    return Row(at, 1, 1, "C", role, hook, wall, wall // 2, scheduled)


def test_worker_steps_begin_at_binding_and_compute_when_the_forward_called_a_layer_hook() -> None:
    rows = [
        row(1, "worker", "bind_connector_metadata"),
        row(2, "worker", "wait_for_layer_load"),
        row(3, "worker", "save_kv_layer"),
        row(4, "worker", "get_transfer_results", 100),
        row(5, "scheduler", "build_connector_meta", 7, scheduled=0),
        row(6, "worker", "bind_connector_metadata"),
        row(7, "worker", "get_transfer_results", 2000),
    ]
    steps = engine_servers.worker_steps(rows)
    assert [(s.computing, s.wall_ns, s.calls) for s in steps] == [(True, 130, 4), (False, 2010, 2)]


def test_scheduler_steps_end_at_build_and_compute_when_tokens_were_scheduled() -> None:
    rows = [
        row(1, "scheduler", "get_num_new_matched_tokens"),
        row(2, "scheduler", "build_connector_meta", scheduled=64),
        row(3, "scheduler", "update_connector_output"),
        row(4, "scheduler", "build_connector_meta", scheduled=0),
        row(5, "scheduler", "request_finished"),  # no build after it: not a step yet
    ]
    steps = engine_servers.scheduler_steps(rows)
    assert [(s.computing, s.calls) for s in steps] == [(True, 2), (False, 2)]


def test_the_plugin_does_nothing_without_its_directory_and_times_every_class_with_it(
    tmp_path: Path,
) -> None:
    # In a process of its own: the plugin patches vLLM's and kvpush's connector classes.
    import subprocess
    import sys

    script = """
import sys
from kvpush_lab import hooktimer
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
from kvpush.vllm.connector import KvPushConnector
hooktimer.register()
timed = getattr(KvPushConnector.get_finished, "__kvpush_timed__", False)
print(timed, getattr(NixlPullConnector.build_connector_meta, "__kvpush_timed__", False))
if timed:
    class Role:
        name = "WORKER"
    connector = KvPushConnector.__new__(KvPushConnector)
    connector._role = Role()
    connector._worker = None
    connector._scheduler = None
    print(connector.get_finished(set()))
"""
    env = {k: v for k, v in __import__("os").environ.items() if k != "KVPUSH_HOOK_TIMER_DIR"}
    off = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert off.returncode == 0, off.stderr
    assert off.stdout.split("\n")[0] == "False False"
    on = subprocess.run(
        [sys.executable, "-c", script],
        env={**env, "KVPUSH_HOOK_TIMER_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
    )
    assert on.returncode == 0, on.stderr
    assert on.stdout.split("\n")[0] == "True True"
    rows = engine_servers.load_rows(tmp_path)
    assert [(r.connector, r.role, r.hook) for r in rows] == [
        ("KvPushConnector", "worker", "get_finished")
    ]
