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
