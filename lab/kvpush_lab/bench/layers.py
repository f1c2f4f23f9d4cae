"""P's engine-thread bill of layer-wise push, per forward pass (``kvpush bench layers``).

In a forward pass that finishes the prefill of several requests D registered for, P's engine
thread hands each layer's KV to the endpoint as the layer runs (``save_kv_layer``). This bench
times that hand-over on the engine thread, per forward, two ways, interleaved forward by forward
on the same endpoint:

* **one call per layer**: what the connector's worker does (``PushWorker.apply`` reads the
  step's streams into one ``LayerStreams``, then each ``save_layer`` is one
  ``Endpoint.streams_ready`` for all of them);
* **one call per request per layer**: what it did before: each layer, each request's
  ``Endpoint.layers_ready`` with its block lists, converted again on every call.

The worker is the real one (``kvpush.vllm._worker.PushWorker``) over numpy caches, with a real
endpoint on the loopback transport and no D: the engine thread's side of each call is the same
whether D registered or not (the writer thread, which would post the WRITEs, is not timed, and
on a GPU host runs on a core of its own). Thread CPU time is the engine thread's own work, what a
GPU host sees the same (scaled by its CPU); wall time adds what the writer thread took from the
engine's core on this 2-core machine. ``layers not streamed``: a request's layer the endpoint
refused (its writer's inbox full), which the request's WRITE then carries (counted in the warm-up
forwards too).
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpush_lab.bench import engine, report

SECTION = "Layer-wise push: P's engine-thread bill per forward"
BLOCK_TOKENS = engine.BLOCK


@dataclass
class Point:
    """One batch size: per forward, the engine thread's CPU and wall time (ns) each way."""

    requests: int
    batched_cpu: list[int] = field(default_factory=list)
    batched_wall: list[int] = field(default_factory=list)
    per_request_cpu: list[int] = field(default_factory=list)
    per_request_wall: list[int] = field(default_factory=list)
    refused: int = 0
    batched_refused: int = 0


class _Refusals(logging.Handler):
    """Counts the requests' layers the worker logs not streamed (the endpoint refused them)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.layers = 0

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        if "not streamed" in str(record.msg) and args and isinstance(args[0], list):
            self.layers += len(args[0])


def _worker(layers: int, blocks: int) -> tuple[Any, list[str], list[tuple[int, int]], list[Any]]:
    """The connector's worker over ``layers`` layers, their names, each one's regions, and the
    arrays (kept alive until the worker closes)."""
    from kvpush.vllm._layout import layout_from_caches

    arrays, views, model = engine.caches(blocks, layers)
    worker = engine.push_worker("bench-layers-p", views, model, layerwise="on")
    regions = list(layout_from_caches(views, model).layer_regions)
    return worker, engine.layer_names(layers), regions, arrays


def _sends(requests: int, prompt_tokens: int, forward: int) -> list[Any]:
    from kvpush.vllm.metadata import SendRequest

    per_request = -(-prompt_tokens // BLOCK_TOKENS)
    return [
        SendRequest(
            f"bench-{forward}-{r}",
            None,
            (tuple(range(r * per_request, (r + 1) * per_request)),),
            prompt_tokens,
        )
        for r in range(requests)
    ]


#: One forward's hand-over of ``sends``' layers; returns the layers the endpoint refused.
Way = Callable[[list[Any]], int]


def _timed(way: Way, sends: list[Any]) -> tuple[int, int, int]:
    """The engine thread's CPU and wall time (ns) for one forward, and what was refused."""
    wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
    refused = way(sends)
    return time.thread_time_ns() - cpu, time.perf_counter_ns() - wall, refused


def _batched(worker: Any, names: Sequence[str], sends: list[Any]) -> int:
    """One forward as the connector's worker runs it."""
    from kvpush.vllm.metadata import PushMetadata

    worker.apply(PushMetadata(streams=sends))
    for name in names:
        worker.save_layer(name)
    worker.end_forward()
    return 0


def _per_request(worker: Any, regions: Sequence[tuple[int, int]], sends: list[Any]) -> int:
    """One forward as the worker ran it before: each layer, each request's own call."""
    endpoint, refused = worker.endpoint, 0
    streams = [
        (s.request_id, [list(g) for g in s.blocks], s.num_tokens, s.transfer_id) for s in sends
    ]
    for start, end in regions:
        for request_id, blocks, tokens, transfer in streams:
            try:
                endpoint.layers_ready(request_id, blocks, tokens, start, end, transfer_id=transfer)
            except Exception:
                refused += 1
    return refused


def run(
    requests: Sequence[int],
    layers: int,
    prompt_tokens: int,
    forwards: int,
    progress: Callable[[str], None] = print,
) -> list[Point]:
    blocks = max(requests) * -(-prompt_tokens // BLOCK_TOKENS)
    worker, names, regions, arrays = _worker(layers, blocks)
    ways: list[tuple[str, Way]] = [
        ("batched", functools.partial(_batched, worker, names)),
        ("per request", functools.partial(_per_request, worker, regions)),
    ]
    points = []
    logger, refusals = logging.getLogger("vllm.kvpush"), _Refusals()
    level = logger.level
    logger.addHandler(refusals)
    logger.setLevel(logging.DEBUG)
    try:
        for n in requests:
            point = Point(n)
            refusals.layers = 0
            gc.collect()
            for forward in range(forwards + 2):  # the first two warm up
                sends = _sends(n, prompt_tokens, forward)
                # Alternating which goes first, so neither always follows the other's commands.
                order = ways if forward % 2 == 0 else ways[::-1]
                timed = {name: _timed(way, sends) for name, way in order}
                batched, per_request = timed["batched"], timed["per request"]
                worker.endpoint.poll()
                point.refused += per_request[2]
                if forward < 2:
                    continue
                point.batched_cpu.append(batched[0])
                point.batched_wall.append(batched[1])
                point.per_request_cpu.append(per_request[0])
                point.per_request_wall.append(per_request[1])
            point.batched_refused = refusals.layers
            progress(
                f"layers: {n} requests x {layers} layers: CPU p50 "
                f"{report.microseconds(report.percentile(point.batched_cpu, 50))} µs one call "
                f"per layer, {report.microseconds(report.percentile(point.per_request_cpu, 50))} "
                "µs one per request per layer"
            )
            points.append(point)
    finally:
        logger.removeHandler(refusals)
        logger.setLevel(level)
        worker.close()
        del arrays
    return points


def table(points: Sequence[Point]) -> report.Table:
    result = report.Table(
        [
            "requests in the forward",
            "one call per request per layer: CPU p50 / p99 (µs)",
            "one call per layer: CPU p50 / p99 (µs)",
            "CPU p50 ratio",
            "wall p50: per request / per layer (µs)",
            "layers not streamed: per request / per layer",
        ]
    )
    for p in points:
        pc, bc = report.percentile(p.per_request_cpu, 50), report.percentile(p.batched_cpu, 50)
        result.add(
            p.requests,
            f"{report.microseconds(pc)} / "
            f"{report.microseconds(report.percentile(p.per_request_cpu, 99))}",
            f"{report.microseconds(bc)} / "
            f"{report.microseconds(report.percentile(p.batched_cpu, 99))}",
            report.ratio(bc or 0.0, pc or 0.0),
            f"{report.microseconds(report.percentile(p.per_request_wall, 50))} / "
            f"{report.microseconds(report.percentile(p.batched_wall, 50))}",
            f"{p.refused} / {p.batched_refused}",
        )
    return result


def markdown(points: Sequence[Point], command: str, layers: int, prompt_tokens: int) -> str:
    return "\n".join(
        [
            f"`{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
            f"{report.cpu_model()}, load {report.load_average()}). Produced by "
            "`lab/kvpush_lab/bench/layers.py`: the engine thread's time handing a forward's "
            f"{layers} layers to the endpoint, each request a {prompt_tokens}-token prompt "
            f"({-(-prompt_tokens // BLOCK_TOKENS)} blocks), the two ways interleaved forward by "
            "forward on one endpoint (loopback transport, no D: the engine thread's side is "
            "the same either way). Ratio: one call per layer over one per request per layer.",
            "",
            table(points).markdown(),
            "",
            *_findings(points),
        ]
    )


def _findings(points: Sequence[Point]) -> list[str]:
    """What the table says, from this run alone."""
    if not points:
        return []
    lines = []
    for p in (points[0], points[-1]):
        bc = report.percentile(p.batched_cpu, 50) or 0.0
        pc = report.percentile(p.per_request_cpu, 50) or 0.0
        lines.append(
            f"- {p.requests} request(s) per forward: {report.microseconds(pc)} -> "
            f"{report.microseconds(bc)} µs of engine-thread CPU per forward "
            f"({report.ratio(bc, pc)}), {report.microseconds(bc / p.requests)} µs per request."
        )
    refused = [p for p in points if p.refused]
    if refused:
        worst = max(refused, key=lambda p: p.refused)
        lines.append(
            f"- One call per request per layer filled the writer's inbox at {worst.requests} "
            f"requests: {worst.refused} of their layers were refused (not streamed: the "
            "requests' WRITEs carried them); one call per layer had "
            f"{worst.batched_refused} refused."
        )
    lines.append(
        "- A GPU host runs the same Python on the engine thread: these figures carry over, "
        "scaled by its CPU; it adds one CUDA event recorded per layer, not measured here (no GPU)."
    )
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--requests",
        default="1,8,64,256",
        help="comma-separated numbers of requests whose prefill one forward finishes",
    )
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--forwards", type=int, default=200, help="timed forwards per point")
    parser.add_argument("--quick", action="store_true", help="20 forwards, 1 and 8 requests")
    parser.add_argument("--markdown", metavar="PATH", help="write the section into PATH")


def main(args: argparse.Namespace) -> int:
    requests = [1, 8] if args.quick else [int(n) for n in args.requests.split(",") if n]
    forwards = 20 if args.quick else args.forwards
    points = run(requests, args.layers, args.prompt_tokens, forwards)
    print()
    print(table(points).text())
    if args.markdown:
        command = (
            f"kvpush bench layers --requests {','.join(map(str, requests))} --layers "
            f"{args.layers} --prompt-tokens {args.prompt_tokens} --forwards {forwards}"
        )
        body = markdown(points, command, args.layers, args.prompt_tokens)
        report.replace_section(Path(args.markdown), SECTION, body)
        print(f"\nwrote the '{SECTION}' section of {args.markdown}")
    return 0
