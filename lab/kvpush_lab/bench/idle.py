"""Idle cost of the transfer machinery alone: the CPU a warm, idle P+D pair burns per second.

Each variant runs in its own spawned process holding both sides (P and D) over NIXL's UCX
backend on loopback. It moves one request first (connections made, UCX wired up), then sleeps
while every thread of the process is accounted (user + system CPU time, from psutil):

* **kvpush**: two :class:`~kvpush.Endpoint` objects (native writer threads, side channels,
  heartbeats), NIXL progressed by the writers;
* **NIXL as vLLM configures it**: two ``nixl_agent`` objects made the way vLLM's NIXL connectors
  make theirs (``nixl_agent_config(num_threads=4, capture_telemetry=True)``, NIXL's own progress
  thread on, which is the Python API's default).

The whole servers' idle cost with each connector is measured by :mod:`kvpush_lab.bench.serving`;
this isolates the part a connector adds. The process's main thread only sleeps meanwhile.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil

import kvpush
from kvpush_lab.bench import report
from kvpush_lab.bench.child import run_in_child
from kvpush_lab.bench.serving_cpu import comm
from kvpush_lab.cache import CacheShape
from kvpush_lab.plain_nixl import nixl_module

SECTION = "Idle cost: the transfer machinery alone"
GEOMETRY = CacheShape(layers=2, num_blocks=64, block_tokens=16, heads=2, head_dim=64)
VARIANTS = ("kvpush", "nixl-vllm-config")
LABELS = {
    "kvpush": "kvpush endpoints (writer drives NIXL)",
    "nixl-vllm-config": "NIXL agents as vLLM's connectors make them",
}
#: Goal of issue 5: an idle kvpush pair under 1% of one core.
GOAL_PERCENT = 1.0


@dataclass
class IdleSample:
    variant: str
    seconds: float
    #: CPU seconds per wall second, in percent of one core.
    percent: float
    #: Thread name -> percent of one core, busiest first.
    threads: dict[str, float] = field(default_factory=dict)


def _thread_seconds() -> dict[int, tuple[str, float]]:
    """Thread id -> (name, user + system CPU seconds) for this process."""
    seconds: dict[int, tuple[str, float]] = {}
    pid = os.getpid()
    for thread in psutil.Process(pid).threads():
        name = comm(pid, thread.id)  # None: the thread ended between listing and reading
        if name is not None:
            seconds[thread.id] = (name, thread.user_time + thread.system_time)
    return seconds


def _measure(seconds: float, variant: str) -> IdleSample:
    before = _thread_seconds()
    started = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - started
    after = _thread_seconds()
    per_name: dict[str, float] = {}
    for tid, (name, used) in after.items():
        delta = used - before.get(tid, (name, 0.0))[1]
        per_name[name] = per_name.get(name, 0.0) + 100.0 * delta / wall
    total = sum(per_name.values())
    busiest = dict(sorted(((n, p) for n, p in per_name.items() if p > 0), key=lambda x: -x[1]))
    return IdleSample(variant, wall, total, busiest)


def _idle_kvpush(seconds: float) -> IdleSample:
    nixl_module()  # the same wheel's C API as the NIXL variant
    p_buffer = np.zeros(GEOMETRY.bytes, np.uint8)
    d_buffer = np.zeros(GEOMETRY.bytes, np.uint8)
    endpoints = [
        kvpush.Endpoint(
            f"idle-{role}",
            GEOMETRY.layout(buffer.ctypes.data),
            memory=[(buffer.ctypes.data, buffer.nbytes)],
            agent_name=f"idle-{role}-kvpush",
        )
        for role, buffer in (("p", p_buffer), ("d", d_buffer))
    ]
    p, d = endpoints
    try:
        p.ready("warm-up", [0, 1, 2, 3], 4 * GEOMETRY.block_tokens)
        d.expect("warm-up", p.address, [4, 5, 6, 7], 4 * GEOMETRY.block_tokens)
        outcomes = [e.outcome for e in d.wait(30.0)] + [e.outcome for e in p.wait(30.0)]
        if outcomes != ["done", "done"]:
            raise RuntimeError(f"kvpush warm-up transfer did not finish: {outcomes}")
        time.sleep(1.5)  # past the writers' settling period: measure the steady idle state
        return _measure(seconds, "kvpush")
    finally:
        for endpoint in endpoints:
            endpoint.close()


def _idle_nixl(seconds: float) -> IdleSample:
    nixl = nixl_module()
    config = nixl.nixl_agent_config(num_threads=4, capture_telemetry=True, backends=["UCX"])
    buffers = [np.zeros(GEOMETRY.bytes, np.uint8) for _ in range(2)]
    agents = [nixl.nixl_agent(f"idle-{role}-nixl", config) for role in ("p", "d")]
    for agent, buffer in zip(agents, buffers, strict=True):
        region = np.array([[buffer.ctypes.data, buffer.nbytes, 0]], dtype=np.uint64)
        agent.register_memory(region, "DRAM")
    p, d = agents
    peer = p.add_remote_agent(d.get_agent_metadata())
    p_side = p.get_xfer_descs(np.array([[buffers[0].ctypes.data, 4096, 0]], np.uint64), "DRAM")
    d_side = p.get_xfer_descs(np.array([[buffers[1].ctypes.data, 4096, 0]], np.uint64), "DRAM")
    handle = p.initialize_xfer("WRITE", p_side, d_side, peer, b"warm-up")
    state = p.transfer(handle)
    deadline = time.monotonic() + 30.0
    while state == "PROC" and time.monotonic() < deadline:
        time.sleep(0.001)
        state = p.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"NIXL warm-up WRITE ended in state {state}")
    p.release_xfer_handle(handle)
    time.sleep(1.5)
    return _measure(seconds, "nixl-vllm-config")


def _idle(variant: str, seconds: float) -> IdleSample:
    return _idle_kvpush(seconds) if variant == "kvpush" else _idle_nixl(seconds)


def run(
    seconds: float = 10.0,
    variants: tuple[str, ...] = VARIANTS,
    progress: Callable[[str], None] = print,
) -> list[IdleSample]:
    """Each variant in its own process, one after the other."""
    env = {"UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
    os.environ.update(env)
    samples = []
    for variant in variants:
        progress(f"idle: {LABELS[variant]}: warm-up transfer, then {seconds:g} s idle ...")
        sample = run_in_child(_idle, (variant, seconds), seconds + 90.0, f"idle bench, {variant}")
        progress(f"idle: {variant}: {sample.percent:.2f}% of a core")
        samples.append(sample)
    return samples


def table(samples: list[IdleSample]) -> report.Table:
    result = report.Table(["pair", "CPU (% of one core)", "busiest threads"])
    for sample in samples:
        threads = ", ".join(
            f"{name} {share:.2f}%" for name, share in list(sample.threads.items())[:3]
        )
        result.add(LABELS[sample.variant], f"{sample.percent:.2f}", threads or "-")
    return result


def markdown(samples: list[IdleSample], command: str) -> str:
    by_variant = {s.variant: s for s in samples}
    kvpush_sample = by_variant.get("kvpush")
    verdict = ""
    if kvpush_sample is not None:
        met = "met" if kvpush_sample.percent < GOAL_PERCENT else "not met"
        verdict = (
            f"Goal (issue 5): an idle kvpush pair under {GOAL_PERCENT:g}% of a core: **{met}** "
            f"({kvpush_sample.percent:.2f}%)."
        )
    return "\n".join(
        [
            f"`{command}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, shared). Each pair "
            "lives in its own process with P and D both in it, moves one request over NIXL "
            "(UCX on loopback) to be warm, then idles while every thread's CPU time is read "
            "from `/proc/self/task`. kvpush's writer sleeps on its inbox (a command wakes it at "
            "once) and, once quiet for 1 s, wakes twice a second; the side channel's accept "
            "poll runs 20 times a second. NIXL's Python API hard-wires its progress thread's "
            "poll delay to 0, so that thread spins. Whole vLLM servers with each connector: "
            "see the end-to-end section.",
            "",
            table(samples).markdown(),
            "",
            verdict,
        ]
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=10.0, help="idle time measured")
    parser.add_argument("--markdown", metavar="PATH", help="write the section into PATH")


def main(args: argparse.Namespace) -> int:
    samples = run(args.seconds)
    print()
    print(table(samples).text())
    if args.markdown:
        command = f"kvpush bench idle --seconds {args.seconds:g}"
        report.replace_section(Path(args.markdown), SECTION, markdown(samples, command))
        print(f"\nwrote the '{SECTION}' section of {args.markdown}")
    return 0
