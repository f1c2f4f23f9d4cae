"""``kvpush bench engine --servers``: the engine-thread bill on real vLLM servers.

For each connector (kvpush, vLLM's ``NixlPushConnector`` and ``NixlConnector``, as shipped) a
prefill server (core 0) and a decode server (core 1) of the tiny local model, started as
``kvpush bench serving`` starts them, with kvpush's lab plugin timing every connector hook in
every server process (:mod:`kvpush_lab.hooktimer`, ``KVPUSH_HOOK_TIMER_DIR``): the worker
role's, on the thread that runs the model, and the scheduler role's, on the engine core's. The
load, routed as ``kvpush bench serving`` routes it (push for the push connectors, pull for
``NixlConnector``): requests one at a time, then bursts that hold many in flight.

The records become engine steps (:func:`worker_steps`, :func:`scheduler_steps`); a worker step
*computes* when the forward pass called the per-layer hooks (``wait_for_layer_load``,
``save_kv_layer``), a scheduler step when it scheduled tokens. Reported per server and role,
steps that compute apart from steps that do not: the connector's wall and thread CPU time per
step, p50 and p99. The worker hooks of vLLM's connectors run here for real (their NIXL agents,
handshakes, READs or WRITEs), which the in-process benchmark cannot do.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import secrets
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpush.router import PrefillInstance
from kvpush_lab.bench import report
from kvpush_lab.bench.report import microseconds as _us
from kvpush_lab.bench.report import percentile as _percentile
from kvpush_lab.bench.serving_client import Route, phase_prompts, run_phase
from kvpush_lab.bench.serving_result import KVPUSH, NIXL_PULL, NIXL_PUSH
from kvpush_lab.hooktimer import ENV
from kvpush_lab.servers import HOST, ServerError, VllmServer, shm_entries, stop_all, wait_healthy

SECTION = "Engine-thread bill (real vLLM servers)"
#: kvpush with its worker waiting up to 2 ms for a transfer event in a step that computes
#: nothing (``idle_wait_ms`` 2, kvpush's behaviour before it was measured; ``auto``, the
#: default, waits so only in an engine of several workers).
KVPUSH_WAIT = "kvpush idle_wait_ms=2"
CONNECTORS = (KVPUSH, KVPUSH_WAIT, NIXL_PUSH, NIXL_PULL)
PER_LAYER = frozenset({"wait_for_layer_load", "save_kv_layer"})
#: Issue 18's goal: kvpush's connector time in steps that compute at most this share of the
#: better upstream connector's.
SHARE_GOAL = 1 / 20


@dataclass(frozen=True)
class Row:
    """One hook call in a server process (see :mod:`kvpush_lab.hooktimer`)."""

    at_ns: int
    pid: int
    thread: int
    connector: str
    role: str
    hook: str
    wall_ns: int
    cpu_ns: int
    scheduled: int | None


@dataclass(frozen=True)
class StepBill:
    """One engine step's connector time (ns) in one process and role."""

    at_ns: int
    computing: bool
    wall_ns: int
    cpu_ns: int
    calls: int


def load_rows(directory: Path) -> list[Row]:
    rows: list[Row] = []
    for path in sorted(directory.glob("hooks-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                rows.append(Row(*json.loads(line)))
    rows.sort(key=lambda row: row.at_ns)
    return rows


def _by_thread(rows: Iterable[Row], role: str) -> dict[tuple[int, int], list[Row]]:
    threads: dict[tuple[int, int], list[Row]] = defaultdict(list)
    for row in rows:
        if row.role == role:
            threads[(row.pid, row.thread)].append(row)
    return threads


def worker_steps(rows: Iterable[Row]) -> list[StepBill]:
    """The worker role's steps: each begins at ``bind_connector_metadata``; it computes when
    the forward pass called a per-layer hook in it."""
    steps: list[StepBill] = []
    for thread_rows in _by_thread(rows, "worker").values():
        current: list[Row] = []
        for row in [*thread_rows, None]:
            if row is None or row.hook == "bind_connector_metadata":
                if current:
                    steps.append(_bill(current, any(r.hook in PER_LAYER for r in current)))
                current = []
            if row is not None:
                current.append(row)
    return steps


def scheduler_steps(rows: Iterable[Row]) -> list[StepBill]:
    """The scheduler role's steps: each ends at ``build_connector_meta`` (the step's admissions
    come before it; the previous step's output and finished requests fall in it too); it
    computes when it scheduled tokens."""
    steps: list[StepBill] = []
    for thread_rows in _by_thread(rows, "scheduler").values():
        current: list[Row] = []
        for row in thread_rows:
            current.append(row)
            if row.hook == "build_connector_meta":
                steps.append(_bill(current, bool(row.scheduled)))
                current = []
    return steps


def _bill(rows: Sequence[Row], computing: bool) -> StepBill:
    return StepBill(
        rows[0].at_ns,
        computing,
        sum(r.wall_ns for r in rows),
        sum(r.cpu_ns for r in rows),
        len(rows),
    )


def summarize(steps: Sequence[StepBill]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, chosen in (
        ("computing", [s for s in steps if s.computing]),
        ("idle", [s for s in steps if not s.computing]),
    ):
        out[kind] = {
            "steps": len(chosen),
            "wall_p50": _percentile([s.wall_ns for s in chosen], 50),
            "wall_p99": _percentile([s.wall_ns for s in chosen], 99),
            "cpu_p50": _percentile([s.cpu_ns for s in chosen], 50),
            "cpu_p99": _percentile([s.cpu_ns for s in chosen], 99),
        }
    return out


@dataclass
class Phase:
    name: str
    start_ns: int
    end_ns: int
    requests: int
    failed: int
    #: Client-side TTFT and handover (D's first token minus P's answer) of each request (s).
    ttft: list[float]
    handover: list[float]


def _servers(connector: str, model: Path, log_dir: Path, secret: str) -> tuple[VllmServer, ...]:
    from kvpush_lab.bench.serving import BLOCK_SIZE, kv_config

    servers = []
    for name, role, cpu in (("P", "kv_producer", "0"), ("D", "kv_consumer", "1")):
        env = {ENV: str(log_dir / "hooks" / name)}
        config = kv_config(KVPUSH if connector == KVPUSH_WAIT else connector, role)
        if connector.startswith(KVPUSH):
            env["KVPUSH_SECRET"] = secret
        if connector == KVPUSH_WAIT and config is not None:
            config["kv_connector_extra_config"] = {"idle_wait_ms": 2}
        servers.append(
            VllmServer(
                name,
                model,
                log_dir,
                cpu=cpu,
                kv_transfer_config=config,
                block_size=BLOCK_SIZE,
                extra_env=env,
                extra_args=["--no-enable-prefix-caching"] if name == "D" else [],
            )
        )
    return tuple(servers)


def run_pair(
    connector: str,
    model: Path,
    log_dir: Path,
    plan: Sequence[tuple[str, int, int]],
    prompt_tokens: int,
    max_tokens: int,
    say: Callable[[str], None],
) -> list[Phase]:
    """Starts ``connector``'s pair, runs ``plan`` (name, requests, in flight) and stops it."""
    from kvpush_lab.bench.serving import PREFILL_ENGINE, ROUTING, START_TIMEOUT_S

    prefill, decode = _servers(connector, model, log_dir, secrets.token_hex(16))
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    shm_before = shm_entries()
    phases: list[Phase] = []
    try:
        prefill.start()
        decode.start()
        say(f"[{connector}] starting P (core 0) and D (core 1); logs in {log_dir}")
        wait_healthy((prefill, decode), START_TIMEOUT_S)
        route = Route(
            ROUTING[KVPUSH if connector == KVPUSH_WAIT else connector],
            PrefillInstance(prefill.url, PREFILL_ENGINE, HOST, prefill.side_channel_port),
            decode.url,
        )
        for name, count, in_flight in [("warm-up", 2, 1), *plan]:
            prompts = phase_prompts(count, prompt_tokens, vocab, 7, f"{connector} {name}")
            started = time.monotonic_ns()
            failed = 0
            ttft: list[float] = []
            handover: list[float] = []
            for first in range(0, count, in_flight):
                batch = prompts[first : first + in_flight]
                # A burst: every request of the batch sent at once (open loop, offsets 0).
                offsets = None if in_flight == 1 else [0.0] * len(batch)
                samples = run_phase(
                    route, model, batch, offsets, max_tokens=max_tokens, timeout_s=300.0
                )
                failed += sum(1 for s in samples if not s.ok) + len(batch) - len(samples)
                ttft += [s.ttft for s in samples if s.ok and s.ttft is not None]
                handover += [s.handover for s in samples if s.ok and s.handover is not None]
            phases.append(Phase(name, started, time.monotonic_ns(), count, failed, ttft, handover))
            say(
                f"[{connector}] {name}: {count} requests, {in_flight} in flight, {failed} failed; "
                f"TTFT p50 {_ms(_percentile(ttft, 50))}, handover p50 "
                f"{_ms(_percentile(handover, 50))}"
            )
        # The plugin writes each process's records every second.
        time.sleep(2.5)
    except ServerError as error:
        say(f"[{connector}] did not start: {str(error).splitlines()[0]}")
    finally:
        stop_all((prefill, decode), shm_before)
    return phases


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"


def analyse(connector: str, log_dir: Path, phases: Sequence[Phase]) -> list[dict[str, Any]]:
    """Per phase, server and role: the summary of its steps."""
    out = []
    for server in ("P", "D"):
        rows = load_rows(log_dir / "hooks" / server)
        for role, steps in (("worker", worker_steps(rows)), ("scheduler", scheduler_steps(rows))):
            for phase in phases:
                if phase.name == "warm-up":
                    continue
                inside = [s for s in steps if phase.start_ns <= s.at_ns <= phase.end_ns]
                out.append(
                    {
                        "connector": connector,
                        "phase": phase.name,
                        "server": server,
                        "role": role,
                        "failed": phase.failed,
                        "ttft_p50": _percentile(phase.ttft, 50),
                        "ttft_p99": _percentile(phase.ttft, 99),
                        "handover_p50": _percentile(phase.handover, 50),
                        **summarize(inside),
                    }
                )
    return out


def _in_flight(phase: str) -> int:
    """A phase's requests in flight, from its name (``"64 in flight"``)."""
    head = phase.split(" ", 1)[0]
    return int(head) if head.isdigit() else 0


def table(summaries: Sequence[dict[str, Any]]) -> report.Table:
    t = report.Table(
        [
            "phase",
            "server, role",
            "connector",
            "steps computing / idle",
            "computing: wall p50 / p99 (µs)",
            "thread CPU p50 / p99 (µs)",
            "idle: wall p50 / p99 (µs)",
        ]
    )
    for s in sorted(
        summaries, key=lambda s: (_in_flight(s["phase"]), s["server"] != "D", s["role"])
    ):
        c, i = s["computing"], s["idle"]
        t.add(
            s["phase"],
            f"{s['server']} {s['role']}",
            s["connector"] + (f" ({s['failed']} failed)" if s["failed"] else ""),
            f"{c['steps']} / {i['steps']}",
            f"{_us(c['wall_p50'])} / {_us(c['wall_p99'])}",
            f"{_us(c['cpu_p50'])} / {_us(c['cpu_p99'])}",
            f"{_us(i['wall_p50'])} / {_us(i['wall_p99'])}",
        )
    return t


def client_table(summaries: Sequence[dict[str, Any]]) -> report.Table:
    """What the client saw in each phase, per connector."""
    t = report.Table(["phase", "connector", "TTFT p50 / p99 (ms)", "handover p50 (ms)"])
    seen = set()
    for s in sorted(
        summaries, key=lambda s: (_in_flight(s["phase"]), CONNECTORS.index(s["connector"]))
    ):
        if (s["phase"], s["connector"]) in seen:
            continue
        seen.add((s["phase"], s["connector"]))
        t.add(
            s["phase"],
            s["connector"],
            f"{_ms(s['ttft_p50'])[:-3]} / {_ms(s['ttft_p99'])[:-3]}",
            _ms(s["handover_p50"])[:-3],
        )
    return t


def verdicts(summaries: Sequence[dict[str, Any]]) -> list[str]:
    """Issue 18's goal per phase and server: in steps that compute, kvpush's connector time
    (worker + scheduler, p50) at most 1/20 of the better upstream connector's; in wall time
    (what the step waits, another thread on the same core included) and in the engine
    thread's own CPU time."""
    total: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for s in summaries:
        c = s["computing"]
        if c["wall_p50"] is not None:
            total[(s["phase"], s["server"], s["connector"])][0] += c["wall_p50"]
            total[(s["phase"], s["server"], s["connector"])][1] += c["cpu_p50"]
    lines = []
    points = {(k[0], k[1]) for k in total}
    for phase, server in sorted(points, key=lambda k: (_in_flight(k[0]), k[1] != "D")):
        mine = total.get((phase, server, KVPUSH))
        upstream = {
            c: total[(phase, server, c)]
            for c in (NIXL_PUSH, NIXL_PULL)
            if (phase, server, c) in total
        }
        if mine is None or not upstream:
            continue
        parts = []
        for index, what in ((0, "wall"), (1, "thread CPU")):
            name, best = min(upstream.items(), key=lambda item: item[1][index])
            share = mine[index] / best[index] if best[index] else math.inf
            parts.append(
                f"{what} kvpush {_us(mine[index])} µs vs {_us(best[index])} µs ({name}) = "
                f"{share:.2g}x, {'met' if share <= SHARE_GOAL else 'not met'}"
            )
        lines.append(
            f"{phase}, {server}, connector time per computing step (p50, worker + scheduler): "
            + "; ".join(parts)
            + f" (goal <= {SHARE_GOAL:.2f}x)"
        )
    return lines


def markdown(
    summaries: Sequence[dict[str, Any]], prompt_tokens: int, max_tokens: int, when: str
) -> str:
    """The ``## Engine-thread bill (real vLLM servers)`` section."""
    return "\n".join(
        [
            "Produced by `kvpush bench engine --servers` "
            "(`lab/kvpush_lab/bench/engine_servers.py`): for each connector a P/D pair of real "
            "vLLM servers (tiny model, P on core 0, D on core 1, vLLM's connectors as shipped), "
            "every connector hook timed in every server process by kvpush's lab plugin "
            "(`kvpush_lab.hooktimer`), summed per engine step. A worker step computes when the "
            "forward pass called the per-layer hooks; a scheduler step when it scheduled tokens. "
            f"Prompts of {prompt_tokens} tokens, {max_tokens} tokens out; bursts send all their "
            "requests at once; one round, the connectors one after the other.",
            "",
            "Wall time is how long the hooks kept the engine's thread; on these servers, each "
            "confined to one core, it includes the connector's own threads taking that core "
            "(kvpush's writer posting WRITEs on P, NIXL's progress threads and vLLM's handshake "
            "and notification threads for its connectors), which a GPU host runs on other cores. "
            "Thread CPU time is the engine thread's own work in the hooks, what a GPU host would "
            "see the same (scaled by its CPU).",
            "",
            f"Run: {when}.",
            "",
            table(summaries).markdown(),
            "",
            "What the client saw meanwhile (through kvpush's router core, as "
            "`kvpush bench serving` routes):",
            "",
            client_table(summaries).markdown(),
            "",
            "Goal (issue 18, item 2), per phase and server:",
            "",
            *[f"- {line}" for line in verdicts(summaries)],
        ]
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--bursts",
        default="64,512",
        help="comma-separated in-flight sizes of the burst phases (default 64,512), two "
        "bursts each",
    )


def main(args: argparse.Namespace) -> int:
    from kvpush_lab.demo_vllm import default_home
    from kvpush_lab.model import make_tiny_model

    quick = getattr(args, "quick", False)
    connectors = [c.strip() for c in (args.connectors or ",".join(CONNECTORS)).split(",")]
    unknown = [c for c in connectors if c and c not in CONNECTORS]
    if unknown:
        print(f"kvpush bench engine --servers: unknown connector(s) {unknown}; known: {CONNECTORS}")
        return 2
    connectors = [c for c in connectors if c]
    bursts = [int(n) for n in args.bursts.split(",") if n]
    plan = [("1 in flight", 4 if quick else 16, 1)] + [
        (f"{n} in flight", n * (1 if quick else 2), n) for n in ([8] if quick else bursts)
    ]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = default_home() / "runs" / f"engine-servers-{stamp}"
    model = make_tiny_model(default_home() / "tiny-qwen3")
    summaries: list[dict[str, Any]] = []
    failed = False
    for connector in connectors:
        log_dir = run_dir / connector
        phases = run_pair(
            connector, model, log_dir, plan, args.prompt_tokens, args.max_tokens, print
        )
        if len(phases) < len(plan) + 1:
            failed = True
            continue
        failed |= any(p.failed for p in phases)
        summaries += analyse(connector, log_dir, phases)
    t = table(summaries)
    clients = client_table(summaries)
    print()
    print(t.text())
    print()
    print(clients.text())
    lines = verdicts(summaries)
    for line in lines:
        print(f"  {line}")
    from kvpush_lab.bench.engine import results_dir

    out = results_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"engine-servers-{stamp}.json"
    path.write_text(json.dumps({"summaries": summaries, "run_dir": str(run_dir)}))
    print(f"\n  results: {path}; hook records in {run_dir}")
    if args.markdown:
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        body = markdown(summaries, args.prompt_tokens, args.max_tokens, when)
        report.replace_section(Path(args.markdown), SECTION, body)
        print(f"  section '{SECTION}' written to {args.markdown}")
    return 1 if failed else 0
