"""The endpoint calls an engine step makes, and the GIL (``kvpush bench gil``).

An engine step calls the endpoint from vLLM's engine thread: D's ``expect`` (a registration) and
``cancel``, P's ``ready`` (a finished prefill) and ``abort``, and ``streams_ready`` (a layer, in
layer-wise push). Each takes microseconds and never waits, so each keeps the GIL. A call that
released it, for however short, would hand it to any other Python thread of the process that
wants it (vLLM's input and output threads, decoding requests and encoding outputs under load),
and the engine thread would then wait up to the interpreter's switch interval (5 ms) to get it
back.

This bench times each call on the calling thread (wall time), call by call, alone and with
another Python thread of the process busy, beside a call that gives the GIL up for as short a
time: ``Endpoint.wait(0)``, which releases it to look for events (a long ``wait`` must). The
endpoints are real (loopback transport, a P and a D worker's, as the connector registers them);
nothing listens at the P address D registers with, and P's requests have no D, so each call's
background work is the endpoint's own (connection attempts, the table).
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpush_lab.bench import engine, report

SECTION = "Engine-thread calls and the GIL"
#: Over this, a call waited for the GIL (or for the core): the switch interval is 5 ms.
SLOW_NS = 1_000_000
#: A call that gives the GIL up, as the reference.
RELEASES = "wait(0) (releases the GIL)"
#: A call that keeps the GIL but is not one an engine step makes to start or end work.
POLL = "poll (keeps the GIL)"


@dataclass
class Samples:
    """One call's wall times (ns), alone and with another Python thread busy."""

    call: str
    alone: list[int] = field(default_factory=list)
    busy: list[int] = field(default_factory=list)


def _calls(d: Any, p: Any) -> list[tuple[str, Callable[[int], object]]]:
    """Each call an engine step makes, by name, given the sample's index."""
    from kvpush._native import LayerStreams
    from kvpush.vllm._layers import Stream

    streams = LayerStreams([Stream("bench-gil-stream", [[2, 3]], 32, None, None)])
    return [
        ("expect (D)", lambda i: d.expect(f"r{i}", "127.0.0.1:9", [[i % 1000]], 16)),
        ("cancel (D)", lambda i: d.cancel(f"r{i}")),
        ("ready (P)", lambda i: p.ready(f"r{i}", [[i % 1000]], 16)),
        ("abort (P)", lambda i: p.abort(f"r{i}")),
        ("streams_ready (P, a layer)", lambda i: p.streams_ready(streams, 0, 1)),
        (POLL, lambda i: d.poll()),
        (RELEASES, lambda i: d.wait(0.0)),
    ]


def _busy(running: threading.Event) -> None:
    """Pure Python work, wanting the GIL all the time (as a thread encoding outputs does)."""
    while running.is_set():
        sum(i * i for i in range(64))


def _sample(
    calls: Sequence[tuple[str, Callable[[int], object]]],
    count: int,
    start: int,
    into: dict[str, list[int]],
) -> None:
    """``count`` rounds of every call, in turn, each one timed."""
    for i in range(start, start + count):
        for name, call in calls:
            t = time.perf_counter_ns()
            call(i)
            into[name].append(time.perf_counter_ns() - t)


def run(count: int, progress: Callable[[str], None] = print) -> list[Samples]:
    """Every call ``count`` times alone, then ``count`` times with another thread busy."""
    arrays, views, model = engine.caches(1024)
    d = engine.push_worker("bench-gil-d", views, model)
    p = engine.push_worker("bench-gil-p", views, model)
    try:
        calls = _calls(d.endpoint, p.endpoint)
        samples = {name: Samples(name) for name, _ in calls}
        _sample(calls, min(count, 200), 0, {name: [] for name in samples})  # warm-up
        _sample(calls, count, count, {name: s.alone for name, s in samples.items()})
        progress(f"gil: {count} rounds of {len(calls)} calls alone")
        running = threading.Event()
        running.set()
        busy = threading.Thread(target=_busy, args=(running,), name="bench-gil-busy")
        busy.start()
        try:
            _sample(calls, count, 2 * count, {name: s.busy for name, s in samples.items()})
        finally:
            running.clear()
            busy.join()
        progress(f"gil: {count} rounds of {len(calls)} calls with another thread busy")
        return list(samples.values())
    finally:
        d.close()
        p.close()
        del arrays


def _mean(values: Sequence[int]) -> float:
    return sum(values) / len(values) if values else 0.0


def table(samples: Sequence[Samples]) -> report.Table:
    result = report.Table(
        [
            "call",
            "alone: p50 / p99 (µs)",
            "another thread busy: p50 / p99 / max (µs)",
            "mean, busy (µs)",
            "calls over 1 ms, busy",
        ]
    )
    for s in samples:
        result.add(
            s.call,
            f"{report.microseconds(report.percentile(s.alone, 50))} / "
            f"{report.microseconds(report.percentile(s.alone, 99))}",
            f"{report.microseconds(report.percentile(s.busy, 50))} / "
            f"{report.microseconds(report.percentile(s.busy, 99))} / "
            f"{report.microseconds(max(s.busy, default=0))}",
            report.microseconds(_mean(s.busy)),
            f"{sum(ns > SLOW_NS for ns in s.busy)} of {len(s.busy)}",
        )
    return result


def findings(samples: Sequence[Samples]) -> list[str]:
    """What the table says, from this run alone."""
    reference = next((s for s in samples if s.call == RELEASES), None)
    if reference is None or not reference.busy:
        return []
    engine_calls = [s for s in samples if s.call not in (RELEASES, POLL)]
    slow = sum(sum(ns > SLOW_NS for ns in s.busy) for s in engine_calls)
    total = sum(len(s.busy) for s in engine_calls)
    held_mean = _mean([ns for s in engine_calls for ns in s.busy])
    return [
        f"- With another Python thread busy, the engine step's calls (which keep the GIL) took "
        f"{report.microseconds(held_mean)} µs on average, {slow} of {total} over 1 ms; the call "
        f"that gives the GIL up took {report.microseconds(_mean(reference.busy))} µs on average, "
        f"{sum(ns > SLOW_NS for ns in reference.busy)} of {len(reference.busy)} over 1 ms "
        "(waiting for the GIL to come back). A call that keeps it can still wait for it now "
        "and then: once the other thread has waited a switch interval, it takes the GIL at the "
        "next bytecode, which may be one of the timing's own.",
        "- A GPU host runs the same Python and the same calls on the engine thread: the waits "
        "for the GIL depend on what its other threads do, not on the GPU.",
    ]


def markdown(samples: Sequence[Samples], command: str) -> str:
    return "\n".join(
        [
            f"`{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
            f"{report.cpu_model()}, load {report.load_average()}). Produced by "
            "`lab/kvpush_lab/bench/gil.py`: the wall time of each endpoint call an engine step "
            "makes, on the calling thread, call by call, alone and with another Python thread "
            "of the process busy (as vLLM's input and output threads are under load), beside "
            "`wait(0)`, a call as short that gives the GIL up. Real endpoints on the loopback "
            "transport.",
            "",
            table(samples).markdown(),
            "",
            *findings(samples),
        ]
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calls", type=int, default=5000, help="rounds of every call, each way")
    parser.add_argument("--quick", action="store_true", help="500 rounds")
    parser.add_argument("--markdown", metavar="PATH", help="write the section into PATH")


def main(args: argparse.Namespace) -> int:
    count = 500 if args.quick else args.calls
    samples = run(count)
    print()
    print(table(samples).text())
    for line in findings(samples):
        print(line)
    if args.markdown:
        body = markdown(samples, f"kvpush bench gil --calls {count}")
        report.replace_section(Path(args.markdown), SECTION, body)
        print(f"\nwrote the '{SECTION}' section of {args.markdown}")
    return 0
