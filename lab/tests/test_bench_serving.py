"""``kvpush bench serving``'s pure parts, without vLLM: schedules and prompts that repeat for
every connector, the client's push and pull routing against fake P and D servers, the
statistics, CPU accounting from ``/proc``, the JSON round trip and the report. No vLLM server
starts here, and no timing is asserted."""

from __future__ import annotations

import argparse
import ctypes
import datetime
import itertools
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpush.router import PrefillInstance
from kvpush_lab.bench import serving, serving_cpu, serving_report, serving_result
from kvpush_lab.bench.serving_client import (
    Route,
    Sample,
    arrival_offsets,
    phase_prompts,
    run_phase,
    send,
    summarize,
)
from kvpush_lab.bench.serving_cpu import GroupUsage
from kvpush_lab.bench.serving_result import (
    KVPUSH,
    NIXL_PULL,
    NIXL_PUSH,
    NO_CONNECTOR,
    IdleCost,
    KvSource,
    PairRun,
    Phase,
    ServingConfig,
    ServingResult,
)
from tests.support.fake_http import Fake, FakeHandler, Received, Respond, answer

# --- schedules and prompts ---------------------------------------------------------------------


def test_same_seed_gives_the_same_arrivals_and_prompts_for_every_connector() -> None:
    assert arrival_offsets(20, 3.0, 7, "load 1.5x") == arrival_offsets(20, 3.0, 7, "load 1.5x")
    assert phase_prompts(3, 64, 2048, 7, "p") == phase_prompts(3, 64, 2048, 7, "p")
    assert arrival_offsets(20, 3.0, 7, "load 1.5x") != arrival_offsets(20, 3.0, 8, "load 1.5x")
    assert phase_prompts(3, 64, 2048, 7, "p") != phase_prompts(3, 64, 2048, 8, "p")


def test_arrivals_start_at_zero_increase_and_scale_with_the_rate() -> None:
    slow = arrival_offsets(50, 1.0, 0, "x")
    fast = arrival_offsets(50, 4.0, 0, "x")
    assert slow[0] == 0.0
    assert all(b > a for a, b in itertools.pairwise(slow))
    assert fast == pytest.approx([t / 4.0 for t in slow])
    assert arrival_offsets(3, None, 0, "x") == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="positive"):
        arrival_offsets(3, 0.0, 0, "x")


def test_prompts_are_distinct_ordinary_tokens_of_the_length_asked() -> None:
    prompts = phase_prompts(4, 300, 2048, 0, "sequential 300")
    assert [len(p) for p in prompts] == [300] * 4
    assert len({tuple(p) for p in prompts}) == 4
    assert all(3 <= t < 2048 for p in prompts for t in p)


# --- routing against fake P and D --------------------------------------------------------------


def stream_tokens(count: int) -> Respond:
    def respond(handler: FakeHandler, _received: Received) -> None:
        handler.start_stream()
        for i in range(count):
            event = {"id": "cmpl-x", "choices": [{"text": f"t{i}", "index": 0}]}
            handler.send_chunk(f"data: {json.dumps(event)}\n\n".encode())
        handler.send_chunk(b"data: [DONE]\n\n")
        handler.end_stream()

    return respond


def route(routing: str, p: Fake, d: Fake) -> Route:
    return Route(
        routing,  # type: ignore[arg-type]
        PrefillInstance(p.url, "engine-p", "127.0.0.1", 5600),
        d.url,
    )


BODY = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 4, "stream": True}


def test_push_sends_both_legs_with_one_request_id_and_transfer_id(
    fakes: Callable[[Respond], Fake],
) -> None:
    p = fakes(answer(200, {"choices": [{"text": "x"}]}))
    d = fakes(stream_tokens(4))
    sample = send(route("push", p, d), dict(BODY), Sample(0, 3), timeout_s=10.0)
    assert sample.ok, sample.error
    p_leg, d_leg = p.only(), d.only()
    assert p_leg.request_id == d_leg.request_id == sample.request_id
    assert p_leg.body["max_tokens"] == 1
    assert p_leg.body["stream"] is False
    assert p_leg.params["do_remote_decode"] is True
    assert d_leg.params["transfer_id"] == p_leg.params["transfer_id"]
    assert d_leg.params["remote_engine_id"] == "engine-p"
    assert d_leg.params["remote_request_id"] == sample.request_id
    assert d_leg.body["max_tokens"] == 4
    assert sample.chunks == 4
    assert sample.prefill_done is not None
    assert sample.handover is not None
    assert sample.tpot is not None


def test_pull_sends_d_the_params_p_answered(fakes: Callable[[Respond], Fake]) -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_engine_id": "e"}
    p = fakes(answer(200, {"choices": [{"text": "x"}], "kv_transfer_params": params}))
    d = fakes(stream_tokens(2))
    sample = send(route("pull", p, d), dict(BODY), Sample(0, 3), timeout_s=10.0)
    assert sample.ok, sample.error
    assert p.only().params["do_remote_decode"] is True
    assert p.only().body["max_tokens"] == 1
    assert d.only().params == params
    assert d.only().request_id == p.only().request_id
    assert sample.chunks == 2


def test_pull_without_params_from_p_fails_without_asking_d(
    fakes: Callable[[Respond], Fake],
) -> None:
    p = fakes(answer(200, {"choices": [{"text": "x"}]}))
    d = fakes(stream_tokens(2))
    sample = send(route("pull", p, d), dict(BODY), Sample(0, 3), timeout_s=10.0)
    assert not sample.ok
    assert sample.error is not None
    assert sample.error.startswith("P: P answered no kv_transfer_params")
    assert d.received == []


def test_a_d_that_never_answers_fails_the_request_at_its_deadline(
    fakes: Callable[[Respond], Fake],
) -> None:
    release = threading.Event()

    def hang(handler: FakeHandler, _received: Received) -> None:
        release.wait(10.0)

    p = fakes(answer(200, {"choices": [{"text": "x"}]}))
    d = fakes(hang)
    try:
        sample = send(route("push", p, d), dict(BODY), Sample(0, 3), timeout_s=0.5)
    finally:
        release.set()
    assert not sample.ok
    assert sample.error is not None
    assert sample.error.startswith("D: ")


def test_a_failed_p_leg_is_reported_with_its_status(fakes: Callable[[Respond], Fake]) -> None:
    p = fakes(answer(500, {"error": {"message": "boom"}}))
    d = fakes(stream_tokens(2))
    sample = send(route("pull", p, d), dict(BODY), Sample(0, 3), timeout_s=10.0)
    assert sample.error is not None
    assert sample.error.startswith("P: HTTP 500")
    assert "boom" in sample.error


def test_an_open_loop_phase_sends_every_request(fakes: Callable[[Respond], Fake]) -> None:
    p = fakes(answer(200, {"choices": [{"text": "x"}]}))
    d = fakes(stream_tokens(3))
    prompts = phase_prompts(5, 8, 100, 0, "load")
    samples = run_phase(
        route("push", p, d),
        Path("m"),
        prompts,
        arrival_offsets(5, 200.0, 0, "load"),
        max_tokens=3,
        timeout_s=10.0,
    )
    assert [s.ok for s in samples] == [True] * 5
    assert sorted(r.body["prompt"] for r in d.received) == sorted(prompts)
    assert len(p.received) == 5


# --- statistics --------------------------------------------------------------------------------


def sample(index: int, ttft: float, handover: float, tpot: float, *, chunks: int = 5) -> Sample:
    s = Sample(index, 1024, sent=1000.0 + index)
    s.first_token = s.sent + ttft
    s.prefill_done = s.first_token - handover
    s.last_token = s.first_token + tpot * (chunks - 1)
    s.chunks = chunks
    return s


def test_summary_percentiles_skip_failed_requests() -> None:
    samples = [sample(i, 0.1 * (i + 1), 0.01 * (i + 1), 0.005) for i in range(5)]
    failed = Sample(9, 1024, sent=1009.0, error="D: timed out")
    stats = summarize([*samples, failed])
    assert stats.requests == 6
    assert stats.failed == 1
    assert stats.ttft_p50 == pytest.approx(0.3)
    assert stats.ttft_p99 == pytest.approx(0.496)
    assert stats.handover_p50 == pytest.approx(0.03)
    assert stats.tpot_p50 == pytest.approx(0.005)
    assert stats.prefill_p50 == pytest.approx(0.27)


def test_a_sample_survives_json() -> None:
    original = sample(3, 0.25, 0.02, 0.004)
    original.request_id = "r-3"
    again = Sample.from_json(json.loads(json.dumps(original.to_json())))
    assert again.request_id == "r-3"
    assert again.ttft == pytest.approx(original.ttft)
    assert again.handover == pytest.approx(original.handover)
    assert again.tpot == pytest.approx(original.tpot)


# --- CPU accounting ----------------------------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names are Linux's")
def test_a_thread_that_names_itself_is_counted_under_its_name() -> None:
    named, done = threading.Event(), threading.Event()
    tids: list[int] = []

    def spin() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.prctl(15, b"kvpush (a) 1", 0, 0, 0) == 0  # PR_SET_NAME; odd on purpose
        tids.append(threading.get_native_id())
        named.set()
        done.wait(10.0)

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        assert named.wait(10.0)
        assert serving_cpu.comm(os.getpid(), tids[0]) == "kvpush (a) 1"
        taken = serving_cpu.snapshot([os.getpgrp()])
        group, name, _ = taken.threads[(os.getpid(), tids[0])]
        assert group == os.getpgrp()
        assert name == f"{taken.processes[os.getpid()][1]}/kvpush (a) 1"
    finally:
        done.set()
        thread.join(10.0)
    # Gone (the kernel reaps it a moment after join returns): left out, not an error.
    deadline = time.monotonic() + 5.0
    while serving_cpu.comm(os.getpid(), tids[0]) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert serving_cpu.comm(os.getpid(), tids[0]) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_this_process_group_is_found_with_its_threads_and_its_ticks_only_grow() -> None:
    group = os.getpgrp()
    before = serving_cpu.snapshot([group])
    total = 0
    for i in range(2_000_000):  # some CPU time, so there is something to count
        total += i * i
    after = serving_cpu.snapshot([group])
    assert os.getpid() in before.processes
    assert before.processes[os.getpid()][0] == group
    assert (os.getpid(), threading.get_native_id()) in after.threads
    assert after.processes[os.getpid()][2] >= before.processes[os.getpid()][2]
    usage = serving_cpu.usage(before, after, group)
    assert usage.group == group
    assert usage.cores >= 0.0
    assert all(cores >= 0.0 for cores in usage.processes.values())
    assert total > 0


def test_usage_counts_only_the_named_group_and_new_processes_from_zero() -> None:
    before = serving_cpu.Snapshot(0.0, {1: (10, "api", 1.0), 2: (20, "other", 0.0)}, {})
    after = serving_cpu.Snapshot(
        2.0,
        {1: (10, "api", 2.0), 2: (20, "other", 10.0), 3: (10, "new", 0.0)},
        {(1, 1): (10, "api/main", 1.0), (1, 5): (10, "api/spin", 1.0)},
    )
    usage = serving_cpu.usage(before, after, 10)
    assert usage.cores == pytest.approx(0.5)
    assert usage.processes == pytest.approx({"api": 0.5, "new": 0.0})
    assert set(usage.threads) == {"api/main", "api/spin"}


# --- configuration -----------------------------------------------------------------------------


def parse(*argv: str) -> ServingConfig:
    parser = argparse.ArgumentParser()
    serving.add_arguments(parser)
    return serving.config_from_args(parser.parse_args(list(argv)))


def test_options_become_the_config_and_its_command_line_says_so() -> None:
    config = parse("--connectors", "kvpush,NixlConnector", "--loads", "0.5,2", "--repeat", "2")
    assert config.connectors == (KVPUSH, NIXL_PULL)
    assert config.loads == (0.5, 2.0)
    assert config.order(0) == (KVPUSH, NIXL_PULL)
    assert config.order(1) == (NIXL_PULL, KVPUSH)
    again = parse(*config.command().split()[3:])
    assert again == config
    assert parse() == ServingConfig()
    assert parse("--quick").lengths == (1024,)


def test_bad_options_are_refused_with_the_reason() -> None:
    with pytest.raises(serving_result.ServingBenchError, match="choose from"):
        parse("--connectors", "LMCache")
    with pytest.raises(serving_result.ServingBenchError, match="positive"):
        parse("--loads", "0")


def test_the_model_length_fits_the_longest_prompt_and_its_answer() -> None:
    config = ServingConfig(lengths=(1024, 8192), load_length=3000)
    assert config.sequential_lengths == (1024, 3000, 8192)
    assert config.max_model_len >= 8192 + config.max_tokens


# --- results and report ------------------------------------------------------------------------


def usage(cores: float) -> GroupUsage:
    return GroupUsage(1, 10.0, cores, {"python": cores}, {"python/spin": cores})


def idle(p: float, d: float) -> IdleCost:
    return IdleCost(10.0, usage(p), usage(d))


def fake_result(kvpush_handover: float) -> ServingResult:
    """Three connectors, one sequential and one load phase each; upstream handover 100 ms."""
    config = ServingConfig(lengths=(1024,), load_length=1024, loads=(1.5,))
    result = ServingResult(config, datetime.datetime(2026, 12, 1, 12, 0), "/tmp/run")
    result.capacity, result.capacity_source = 4.0, "test"
    result.orders = [[KVPUSH, NIXL_PUSH, NIXL_PULL]]
    result.pairs.append(PairRun(NO_CONNECTOR, 0, "", idle_fresh=idle(0.002, 0.002)))
    for connector in (KVPUSH, NIXL_PUSH, NIXL_PULL):
        handover = kvpush_handover if connector == KVPUSH else 0.1
        idle_p = 0.003 if connector == KVPUSH else 1.0
        pair = PairRun(
            connector,
            0,
            "",
            idle_fresh=idle(idle_p, 0.002),
            idle_after=idle(idle_p, 0.002),
            source=KvSource(2048, 2048),
        )
        for name, load in (("sequential 1024", None), ("load 1.5x", 1.5)):
            samples = [sample(i, 0.2 + handover, handover, 0.01) for i in range(4)]
            pair.phases.append(Phase(name, 1024, None if load is None else 6.0, load, samples))
        if connector == KVPUSH:
            pair.phases[0].breakdown = {"ready → posted": 1.5}
            pair.phases[0].breakdown_n = 4
        result.pairs.append(pair)
    return result


def test_goals_are_judged_from_the_figures() -> None:
    good = fake_result(kvpush_handover=0.02)
    assert serving_report.handover_verdict(good).met is True
    assert serving_report.ttft_verdict(good).met is True
    assert serving_report.idle_verdict(good).met is True
    bad = fake_result(kvpush_handover=0.08)
    verdict = serving_report.handover_verdict(bad)
    assert verdict.met is False
    assert "1024 at 1.5x vs NixlPushConnector" in verdict.text
    assert serving_report.ttft_verdict(fake_result(0.2)).met is False


def test_a_result_survives_its_json_file(tmp_path: Path) -> None:
    result = fake_result(0.02)
    path = tmp_path / "results" / "serving.json"
    serving_result.save_result(result, path)
    again = serving_result.load_result(path)
    assert again.config == result.config
    assert [p.connector for p in again.pairs] == [p.connector for p in result.pairs]
    assert serving_report.report_text(again) == serving_report.report_text(result)


def test_report_text_has_every_connector_ratio_and_verdict() -> None:
    text = serving_report.report_text(fake_result(0.02))
    for label in ("kvpush", "NixlPushConnector", "NixlConnector (pull)", "no connector"):
        assert label in text
    assert "0.20x" in text  # kvpush's 20 ms handover over upstream's 100 ms
    assert "handover goal" in text
    assert "idle goal" in text


def test_markdown_rewrites_only_its_two_sections(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Core (criterion)\n\nkept\n\n## Idle cost\n\nstale figures\n")
    serving_report.write_markdown(fake_result(0.02), doc, tmp_path / "img")
    text = doc.read_text()
    assert "## Core (criterion)\n\nkept" in text
    assert text.count("## Idle cost") == 1
    assert "stale figures" not in text
    assert "## End to end (vLLM)" in text
    assert "| 1024 at 1.5x (6.00/s) | kvpush |" in text
    assert "ready → posted (ms)" in text
    images = sorted(p.name for p in (tmp_path / "img").iterdir())
    assert images == ["serving-handover-load.png", "serving-ttft-load.png"]
    assert all(f"](img/{name})" in text for name in images)


def test_no_request_goes_out_once_the_phase_budget_is_spent(
    fakes: Callable[[Respond], Fake],
) -> None:
    p = fakes(answer(200, {"choices": [{"text": "x"}]}))
    d = fakes(stream_tokens(1))
    prompts = phase_prompts(3, 8, 100, 0, "late")
    for offsets in (None, arrival_offsets(3, 100.0, 0, "late")):
        samples = run_phase(
            route("push", p, d),
            Path("m"),
            prompts,
            offsets,
            max_tokens=1,
            timeout_s=10.0,
            stop_at=time.monotonic() - 1.0,
        )
        assert samples == []
    assert p.received == []
    assert d.received == []


def test_threads_are_named_main_unnamed_or_by_their_own_name() -> None:
    assert serving_cpu.thread_name(100, "VLLM::Worker", 100, "VLLM::Worker") == "main"
    assert serving_cpu.thread_name(100, "VLLM::Worker", 101, "VLLM::Worker") == "unnamed"
    assert serving_cpu.thread_name(100, "VLLM::Worker", 102, "kvpush-writer") == "kvpush-writer"


def test_an_upstream_phase_without_one_success_is_noted_not_compared() -> None:
    result = fake_result(kvpush_handover=0.02)
    push = next(p for p in result.pairs if p.connector == NIXL_PUSH)
    for s in push.phases[1].samples:
        s.error = "D: timed out"
    verdict = serving_report.handover_verdict(result)
    assert verdict.met is True
    assert "NixlPushConnector at 1024 at 1.5x had no successful request" in verdict.text


def test_a_handover_at_or_below_zero_is_not_given_a_ratio() -> None:
    result = fake_result(kvpush_handover=-0.005)
    assert "kvpush <= 0" in serving_report.ratio_table(result).text()
    assert serving_report.handover_verdict(result).met is True
