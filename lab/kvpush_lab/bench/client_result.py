"""What a ``kvpush bench client`` run is (:mod:`kvpush_lab.bench.client`): the systems it points
vLLM's benchmark client at, its points and configuration, and its results (:class:`ClientResult`,
saved as JSON), apart from the runner and the report (:mod:`kvpush_lab.bench.client_report`) so
that both read it and neither imports the other."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpush_lab.bench.serving_result import KVPUSH, NIXL_PULL, NIXL_PUSH

OUTPUT_TOKENS = 128
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


@dataclass(frozen=True)
class System:
    """One thing the client is pointed at: an aggregated server or a P/D pair behind the proxy."""

    name: str
    #: The pair's connector; None for an aggregated server.
    connector: str | None = None
    #: An aggregated server's CPUs.
    cpus: str = "0"
    #: Upstream tuned: ``KVPUSH_LAB_NIXL_PROGRESS_THREAD`` in its servers
    #: (:mod:`kvpush_lab.upstream_best`: ``off``, or ``poll:<µs>``); None: as shipped.
    progress: str | None = None
    #: kvpush: P's ``layerwise`` option (``off``: whole-request push, as shipped).
    layerwise: str = "off"

    @property
    def aggregated(self) -> bool:
        return self.connector is None

    @property
    def mode(self) -> str:
        return "pull" if self.connector == NIXL_PULL else "push"


#: kvpush with layer-wise push on P (``layerwise: "on"``).
KVPUSH_LAYERWISE = f"{KVPUSH}-layerwise"
#: The ``-poll`` variants' NIXL progress thread poll delay (µs).
POLL_US = 1000

SYSTEMS = {
    s.name: s
    for s in (
        System("aggregated-1core", cpus="0"),
        System("aggregated-2core", cpus="0-1"),
        System(KVPUSH, KVPUSH),
        System(KVPUSH_LAYERWISE, KVPUSH, layerwise="on"),
        System(NIXL_PULL, NIXL_PULL),
        System(f"{NIXL_PULL}-best", NIXL_PULL, progress="off"),
        System(NIXL_PUSH, NIXL_PUSH),
        System(f"{NIXL_PUSH}-best", NIXL_PUSH, progress="off"),
        System(f"{NIXL_PULL}-poll", NIXL_PULL, progress=f"poll:{POLL_US}"),
        System(f"{NIXL_PUSH}-poll", NIXL_PUSH, progress=f"poll:{POLL_US}"),
    )
}
#: What a run compares unless told otherwise: the ``-poll`` variants are options.
DEFAULT_SYSTEMS = tuple(name for name in SYSTEMS if not name.endswith("-poll"))
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

    systems: tuple[str, ...] = DEFAULT_SYSTEMS
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
    #: kvpush only: of the bytes P sent, the share written layer by layer before each
    #: request's KV was ready, and the share of transfers that streamed any.
    streamed_bytes_share: float | None = None
    streamed_transfers_share: float | None = None
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
