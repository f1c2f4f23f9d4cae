"""``kvpush bench client``'s reading of vLLM's benchmark client: what it sends the client, how it
pools rounds, which upstream counts as the better one, and what it says about each goal (met,
not met, or not measured, never a verdict from missing data). The runs themselves are in
``tests/e2e/test_bench_client.py``."""

from __future__ import annotations

import argparse
import json
import sys
import types
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvpush_lab import upstream_best
from kvpush_lab.bench import client, client_report
from kvpush_lab.bench.client_result import (
    FLOOR_ONE,
    FLOOR_TWO,
    KVPUSH_LAYERWISE,
    ClientConfig,
    ClientResult,
    Point,
    PointRun,
    load,
)
from kvpush_lab.bench.serving_result import KVPUSH

CONFIG = ClientConfig(
    systems=(FLOOR_ONE, FLOOR_TWO, KVPUSH, "NixlConnector", "NixlConnector-best"),
    input_lens=(1024,),
    loads=(0.25, 0.8),
    concurrencies=(),
    prompts=4,
    headline_prompts=4,
    rounds=2,
)
LIGHT, NEAR = CONFIG.points()


def _run(
    system: str, point: Point, ttft_ms: float, tpot_ms: float, round_index: int = 0
) -> PointRun:
    return PointRun(
        system,
        round_index,
        point,
        rate=1.0,
        completed=point.prompts,
        ttft=[ttft_ms / 1e3] * point.prompts,
        tpot=[tpot_ms / 1e3] * point.prompts,
        handover=[] if system.startswith("aggregated") else [ttft_ms / 1e4] * point.prompts,
    )


def _result(*runs: PointRun) -> ClientResult:
    return ClientResult(CONFIG, "2026-12-06T00:00:00", "/tmp/x", {1024: 20.0}, list(runs))


def test_the_headline_points_get_more_prompts_and_the_concurrency_sweep_its_own_points() -> None:
    config = ClientConfig(
        input_lens=(1024, 4096, 8192),
        loads=(0.25, 0.5, 0.8, 1.1),
        concurrencies=(1, 4, 16),
        headline_prompts=200,
    )
    points = config.points()
    big = {(p.input_len, p.load) for p in points if p.prompts == config.headline_prompts}
    assert big == {(1024, 0.25), (1024, 0.8), (4096, 0.25), (4096, 0.8)}
    assert [p.concurrency for p in points if p.concurrency is not None] == [1, 4, 16]
    assert all(p.input_len == 1024 for p in points if p.concurrency is not None)


def test_a_config_without_the_one_core_floor_or_with_an_unknown_system_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        ClientConfig(systems=(KVPUSH,)).validate()
    with pytest.raises(ValueError, match="unknown system"):
        ClientConfig(systems=(FLOOR_ONE, "LMCache")).validate()
    with pytest.raises(ValueError, match="max-model-len"):
        ClientConfig(input_lens=(16384,)).validate()


def test_the_client_gets_vllms_own_options_and_a_rate_only_for_poisson_points() -> None:
    out = Path("/tmp/r/client-x.json")
    command = client.client_command("http://h:1", Path("/m"), LIGHT, 2.5, CONFIG, out)
    assert command[:2] == [sys.executable, "-c"]
    assert "from vllm.benchmarks.serve import add_cli_args, main" in command[2]
    args = command[3:]
    for flag, value in (
        ("--base-url", "http://h:1"),
        ("--dataset-name", "random"),
        ("--random-input-len", "1024"),
        ("--random-output-len", "128"),
        ("--request-rate", "2.5000"),
        ("--result-filename", "client-x.json"),
    ):
        assert args[args.index(flag) + 1] == value
    assert {"--ignore-eos", "--save-detailed", "--save-result"} <= set(args)
    closed = client.client_command(
        "http://h:1", Path("/m"), Point(1024, 4, concurrency=4), None, CONFIG, out
    )
    assert "--request-rate" not in closed
    assert closed[closed.index("--max-concurrency") + 1] == "4"


def test_rounds_are_pooled_and_their_spread_kept() -> None:
    result = _result(_run(KVPUSH, LIGHT, 40, 5, 0), _run(KVPUSH, LIGHT, 60, 5, 1))
    (summary,) = client_report.summarize(result)
    assert summary.sent == 8
    assert summary.completed == 8
    assert summary.round_ttft_p50 == [0.04, 0.06]
    assert summary.q("ttft", 50) == pytest.approx(0.05)


def test_the_better_upstream_is_the_lower_one_and_one_that_did_not_finish_never_wins() -> None:
    stuck = _run("NixlConnector-best", LIGHT, 10, 1)
    stuck.error = "not finished within 90 s (saturated)"
    summaries = client_report.summarize(_result(_run("NixlConnector", LIGHT, 200, 12), stuck))
    assert client_report._better_upstream(summaries, LIGHT, "ttft", 50) == ("NixlConnector", 0.2)


def test_each_goal_is_met_not_met_or_not_measured_from_the_run_alone() -> None:
    runs = [
        _run(FLOOR_ONE, LIGHT, 40, 4),
        _run(FLOOR_ONE, NEAR, 400, 20),
        _run(FLOOR_TWO, LIGHT, 30, 3),
        _run(FLOOR_TWO, NEAR, 90, 9),
        _run(KVPUSH, LIGHT, 42, 5),
        _run(KVPUSH, NEAR, 100, 6),
        _run("NixlConnector", LIGHT, 100, 10),
        _run("NixlConnector", NEAR, 80, 10),
    ]
    lines = client_report.verdicts(client_report.summarize(_result(*runs)), CONFIG.points())
    assert lines[0] == "TTFT p50 at 1024 in at 0.25x <= 1.1x aggregated-1core's: 1.05x, met"
    assert lines[1] == (
        "TPOT p99 at 1024 in below aggregated-2core's: from 0.8x P's capacity on (the crossover)"
    )
    assert lines[2].startswith("TTFT and TPOT p99 never worse than the better upstream's: not met")
    assert "TTFT p99 at 1024 in at 0.8x (1.25x NixlConnector)" in lines[2]
    assert lines[3] == (
        "Handover p50 <= 0.5x the better upstream's: not met: 1024 in at 0.8x (1.25x NixlConnector)"
    )

    lonely = client_report.verdicts(
        client_report.summarize(_result(_run(KVPUSH, LIGHT, 42, 5))), CONFIG.points()
    )
    assert lonely[0].endswith("not measured")
    assert lonely[1].endswith("not measured")
    assert lonely[2].endswith("not measured")


def test_a_saved_result_reads_back_the_same(tmp_path: Path) -> None:
    run = _run(KVPUSH, NEAR, 50, 5)
    run.stages = {"posted → completed": [0.1, 0.2]}
    result = _result(run)
    path = tmp_path / "client.json"
    result.save(path)
    again = load(path)
    assert again.config == CONFIG
    assert again.capacity == {1024: 20.0}
    assert again.runs == [run]


def test_the_stages_come_from_both_sides_timelines_within_the_points_window(tmp_path: Path) -> None:
    def lines(key: str, at: float, outcome: str = "done") -> list[dict[str, Any]]:
        send = {
            "role": "send",
            "key": key,
            "outcome": outcome,
            "wall": {
                "scheduled": at,
                "ready": at + 0.002,
                "registered": at - 0.03,
                "matched": at + 0.002,
                "posted": at + 0.0025,
                "completed": at + 0.003,
            },
        }
        receive = {
            "role": "receive",
            "key": key,
            "outcome": "done",
            "wall": {"scheduled": at - 0.032, "registered": at - 0.031, "completed": at + 0.004},
        }
        return [send, receive]

    records = lines("in", 100.0) + lines("before", 50.0) + lines("failed", 100.5, "failed")
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    stages = client.stages(tmp_path, (99.0, 101.0), expected=2)
    assert stages["D admitted → P's prefill done"] == [32.0]
    assert stages["posted → completed"] == [0.5]
    assert stages["D admitted after P's KV ready"] == [-34.0]


def test_the_streamed_share_counts_ps_done_sends_within_the_window(tmp_path: Path) -> None:
    def send(at: float, total: int, streamed: int, outcome: str = "done") -> dict[str, Any]:
        return {"role": "send", "outcome": outcome, "bytes": total, "streamed_bytes": streamed,
                "wall": {"scheduled": at}}  # fmt: skip

    records = [
        send(100.0, 300, 300),
        send(100.5, 100, 0),
        send(50.0, 100, 100),  # before the window
        send(100.2, 100, 100, "failed"),
        {"role": "receive", "wall": {"scheduled": 100.1}},
    ]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert client.streamed_shares(tmp_path, (99.0, 101.0)) == (0.75, 0.5)
    assert client.streamed_shares(tmp_path, (200.0, 201.0)) == (None, None)


def test_whole_request_and_layer_wise_push_are_shown_side_by_side() -> None:
    config = replace(CONFIG, systems=(*CONFIG.systems, KVPUSH_LAYERWISE))
    runs = [_run(KVPUSH, LIGHT, 100.0, 5.0), _run(KVPUSH_LAYERWISE, LIGHT, 80.0, 5.0)]
    summaries = client_report.summarize(
        ClientResult(config, "2026-12-06T00:00:00", "/tmp/x", {1024: 20.0}, runs)
    )
    rows = client_report.layerwise_table(summaries, config.points()).rows
    assert len(rows) == 1, "only the point both ran"
    assert rows[0][0] == LIGHT.label
    assert rows[0][1:] == ["100 / 80 (0.80x)", "100 / 80 (0.80x)", "5 / 5 (1.00x)",
                           "10 / 8 (0.80x)", "10 / 8 (0.80x)"], rows[0]  # fmt: skip


def test_quick_mode_is_small_and_options_override_it() -> None:
    parser = argparse.ArgumentParser()
    client.add_arguments(parser)
    quick = client.config_from_args(parser.parse_args(["--quick"]))
    assert quick.systems == (FLOOR_ONE, KVPUSH)
    assert quick.rounds == 1
    custom = client.config_from_args(
        parser.parse_args(["--input-lens", "1024,2048", "--rounds", "3"])
    )
    assert custom.input_lens == (1024, 2048)
    assert custom.rounds == 3
    assert custom.max_model_len >= 2048 + custom.output_len


def _fake_nixl(monkeypatch: pytest.MonkeyPatch) -> tuple[type, list[int]]:
    """A stand-in for ``nixl._api``: its agent config class and the poll delays agents got."""

    class AgentConfig:
        def __init__(self, enable_prog_thread: bool = True, num_threads: int = 0) -> None:
            self.enable_prog_thread = enable_prog_thread
            self.num_threads = num_threads

    delays: list[int] = []

    def agent(name: str, config: Any) -> str:
        delays.append(config.pthrDelay)
        return name

    fake = types.ModuleType("nixl._api")
    fake.nixl_agent_config = AgentConfig  # type: ignore[attr-defined]
    fake.nixlBind = types.SimpleNamespace(nixlAgent=agent)  # type: ignore[attr-defined]
    package = types.ModuleType("nixl")
    package._api = fake  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nixl", package)
    monkeypatch.setitem(sys.modules, "nixl._api", fake)
    return AgentConfig, delays


def _make_agent(name: str) -> None:
    """What ``nixl_agent.__init__`` does: a bindings config with delay 0, then the agent."""
    config = types.SimpleNamespace(pthrDelay=0)
    sys.modules["nixl._api"].nixlBind.nixlAgent(name, config)


def test_the_upstream_plugin_turns_nixls_progress_thread_off_only_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    agent_config, delays = _fake_nixl(monkeypatch)
    monkeypatch.delenv(upstream_best.ENV, raising=False)
    upstream_best.register()
    assert agent_config().enable_prog_thread, "unset: NIXL's default"
    _make_agent("a")
    assert delays == [0]

    monkeypatch.setenv(upstream_best.ENV, "off")
    upstream_best.register()
    upstream_best.register()  # loaded twice in one process: still one wrapper
    assert not agent_config(num_threads=4).enable_prog_thread
    assert not agent_config(True, 4).enable_prog_thread
    assert agent_config(num_threads=4).num_threads == 4


def test_the_upstream_plugin_sets_the_progress_threads_poll_delay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    agent_config, delays = _fake_nixl(monkeypatch)
    monkeypatch.setenv(upstream_best.ENV, "poll:1000")
    upstream_best.register()
    upstream_best.register()
    _make_agent("a")
    assert delays == [1000]
    assert agent_config().enable_prog_thread


@pytest.mark.parametrize("value", ["on", "poll", "poll:0", "poll:-5", "poll:1ms"])
def test_the_upstream_plugin_refuses_what_it_does_not_know(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    _fake_nixl(monkeypatch)
    monkeypatch.setenv(upstream_best.ENV, value)
    with pytest.raises(ValueError, match="KVPUSH_LAB_NIXL_PROGRESS_THREAD"):
        upstream_best.register()


def test_no_point_replays_anothers_prompts_and_every_system_gets_the_same_ones() -> None:
    config = ClientConfig()
    seeds = [
        client.point_seed(p)
        for p in replace(config, input_lens=(1024, 4096), concurrencies=(1, 4)).points()
    ]
    assert len(set(seeds)) == len(seeds)
    out = Path("/tmp/r/c.json")
    a = client.client_command("http://a:1", Path("/m"), LIGHT, 1.0, CONFIG, out)
    b = client.client_command("http://b:2", Path("/m"), LIGHT, 1.0, CONFIG, out)
    assert a[a.index("--seed") + 1] == b[b.index("--seed") + 1]


def test_the_proxys_request_lines_give_each_requests_p_leg_and_first_byte(tmp_path: Path) -> None:
    log = tmp_path / "proxy.log"
    ok = (
        "2026-12-06 12:37:32,142 INFO kvpush.router: request 5b3f transfer 3aa6 push "
        "/v1/completions -> 200 | prefill http://127.0.0.1:23632 200 0.233 s | decode "
        "http://127.0.0.1:21340 200 first byte 0.269 s | 0.342 s\n"
    )
    failed = ok.replace("-> 200", "-> 502").replace("INFO", "WARNING")
    serial = ok.replace("0.233 s", "0.100 s (serial: learned P's coordinates)")
    log.write_text(ok + failed + serial)
    assert client.proxy_legs(log, 0) == [(0.233, 0.269), (0.1, 0.269)]
    assert client.proxy_legs(log, len(ok)) == [(0.1, 0.269)]
