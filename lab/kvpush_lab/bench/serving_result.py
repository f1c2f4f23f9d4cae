"""What a serving benchmark run is (:mod:`kvpush_lab.bench.serving`): its configuration, the
connectors it compares, and its results (:class:`ServingResult`, saved as JSON), apart from the
runner and the report (:mod:`kvpush_lab.bench.serving_report`) so that both read it and neither
imports the other."""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import kvpush
from kvpush_lab.bench.serving_client import PhaseStats, Sample, summarize
from kvpush_lab.bench.serving_cpu import GroupUsage

KVPUSH = "kvpush"
NIXL_PUSH = "NixlPushConnector"
NIXL_PULL = "NixlConnector"
NO_CONNECTOR = "none"
CONNECTORS = (KVPUSH, NIXL_PUSH, NIXL_PULL)
#: A load phase may send for at least this long, however slow the phases before it were (the
#: first seconds of its Poisson schedule): the comparison at load is the one that matters most.
#: A one-at-a-time phase that starts with the budget spent sends nothing.
MIN_PHASE_S = 5.0

#: kvpush's handover, step by step, from the connector's timelines: (name, from, to), each end
#: ``p:<step>`` / ``d:<step>`` on P's or D's line, or ``client:first_token``.
BREAKDOWN: tuple[tuple[str, str, str], ...] = (
    ("step wait (P scheduled → ready)", "p:scheduled", "p:ready"),
    ("P ready → P's answer at the client", "p:ready", "client:prefill_done"),
    ("registration at P after ready", "p:ready", "p:registered"),
    ("ready → posted", "p:ready", "p:posted"),
    ("posted → completed", "p:posted", "p:completed"),
    ("completed → D DONE", "p:completed", "d:completed"),
    ("completed → first token", "p:completed", "client:first_token"),
)


class ServingBenchError(RuntimeError):
    """The benchmark could not run (wrong interpreter, bad options)."""


@dataclass(frozen=True)
class ServingConfig:
    """What to measure. ``loads`` are multiples of P's prefill capacity at ``load_length``
    (prefills per second, measured on the connector-less pair unless ``capacity`` is given)."""

    connectors: tuple[str, ...] = CONNECTORS
    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)
    sequential_requests: int = 4
    load_length: int = 2048
    loads: tuple[float, ...] = (0.5, 1.5)
    load_requests: int = 16
    capacity: float | None = None
    max_tokens: int = 32
    repeat: int = 1
    rotate: bool = True
    idle_baseline: bool = True
    idle_s: float = 10.0
    settle_s: float = 5.0
    warmup_requests: int = 2
    request_timeout_s: float = 45.0
    #: Seconds one pair's measured phases may take, shared among them: a connector whose
    #: requests take tens of seconds gets fewer requests, not an hour-long run.
    pair_budget_s: float = 120.0
    seed: int = 0

    @classmethod
    def quick(cls, **overrides: Any) -> ServingConfig:
        """A few requests at one length: minutes, for trying the benchmark out."""
        base = cls(
            lengths=(1024,),
            sequential_requests=2,
            load_length=1024,
            loads=(1.5,),
            load_requests=4,
            idle_s=3.0,
            settle_s=2.0,
            warmup_requests=1,
            max_tokens=16,
        )
        return replace(base, **overrides)

    def validate(self) -> None:
        unknown = [c for c in self.connectors if c not in CONNECTORS]
        if unknown or not self.connectors:
            raise ServingBenchError(
                f"connectors {', '.join(unknown) or '(none)'}: choose from {', '.join(CONNECTORS)}"
            )
        if len(set(self.connectors)) != len(self.connectors):
            raise ServingBenchError("a connector is named twice")
        if not self.lengths or min(self.lengths) < 1 or self.load_length < 1:
            raise ServingBenchError("prompt lengths must be at least 1 token")
        if any(load <= 0 for load in self.loads):
            raise ServingBenchError("loads are positive multiples of P's capacity")
        if self.repeat < 1 or self.sequential_requests < 1 or self.load_requests < 1:
            raise ServingBenchError("--repeat and request counts must be at least 1")
        if self.capacity is not None and self.capacity <= 0:
            raise ServingBenchError("--capacity must be positive")

    @property
    def sequential_lengths(self) -> tuple[int, ...]:
        """Every length once, in order; the load length is among them (the first connector's
        P legs at it give the capacity when no connector-less pair measured it)."""
        wanted = set(self.lengths) | ({self.load_length} if self.loads else set())
        return tuple(sorted(wanted))

    @property
    def max_model_len(self) -> int:
        return max(4096, max(self.sequential_lengths) + self.max_tokens)

    def order(self, round_index: int) -> tuple[str, ...]:
        """The connectors' order in one round: rotated by one each round when ``rotate``."""
        if not self.rotate:
            return self.connectors
        shift = round_index % len(self.connectors)
        return self.connectors[shift:] + self.connectors[:shift]

    def command(self, program: str = "kvpush bench serving") -> str:
        """The command line that runs this configuration."""
        default = ServingConfig()
        parts = [program]
        if self.connectors != default.connectors:
            parts.append(f"--connectors {','.join(self.connectors)}")
        if self.lengths != default.lengths:
            parts.append(f"--lengths {','.join(map(str, self.lengths))}")
        for name, flag in (
            ("sequential_requests", "--sequential-requests"),
            ("load_length", "--load-length"),
            ("load_requests", "--load-requests"),
            ("max_tokens", "--max-tokens"),
            ("repeat", "--repeat"),
            ("idle_s", "--idle-s"),
            ("settle_s", "--settle-s"),
            ("warmup_requests", "--warmup-requests"),
            ("request_timeout_s", "--request-timeout-s"),
            ("pair_budget_s", "--pair-budget-s"),
            ("seed", "--seed"),
        ):
            value = getattr(self, name)
            if value != getattr(default, name):
                parts.append(f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}")
        if self.loads != default.loads:
            parts.append(f"--loads {','.join(f'{x:g}' for x in self.loads)}")
        if self.capacity is not None:
            parts.append(f"--capacity {self.capacity:g}")
        if not self.rotate:
            parts.append("--no-rotate")
        if not self.idle_baseline:
            parts.append("--no-idle-baseline")
        return " ".join(parts)


# --- results -----------------------------------------------------------------------------------


@dataclass
class IdleCost:
    """Cores busy on average while the pair sat idle, per server."""

    seconds: float
    prefill: GroupUsage
    decode: GroupUsage

    @property
    def cores(self) -> float:
        return self.prefill.cores + self.decode.cores

    def to_json(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "P": asdict(self.prefill), "D": asdict(self.decode)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> IdleCost:
        return cls(float(data["seconds"]), GroupUsage(**data["P"]), GroupUsage(**data["D"]))


@dataclass
class Phase:
    """One phase's requests: one length, one at a time (``rate`` None) or Poisson."""

    name: str
    length: int
    rate: float | None
    load: float | None
    samples: list[Sample]
    #: requests the phase meant to send (``samples`` holds those sent before the budget ran out)
    planned: int = 0
    #: kvpush only: median milliseconds of each :data:`BREAKDOWN` step, and how many requests
    breakdown: dict[str, float] = field(default_factory=dict)
    breakdown_n: int = 0

    @property
    def stats(self) -> PhaseStats:
        return summarize(self.samples)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "length": self.length,
            "rate": self.rate,
            "load": self.load,
            "stats": summarize(self.samples).to_json(),
            "planned": self.planned,
            "breakdown_ms": self.breakdown,
            "breakdown_n": self.breakdown_n,
            "samples": [s.to_json() for s in self.samples],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Phase:
        return cls(
            data["name"],
            int(data["length"]),
            data.get("rate"),
            data.get("load"),
            [Sample.from_json(s) for s in data.get("samples", [])],
            int(data.get("planned") or len(data.get("samples", []))),
            dict(data.get("breakdown_ms") or {}),
            int(data.get("breakdown_n") or 0),
        )


@dataclass
class KvSource:
    """Where D's prompt tokens came from during the measured phases (D's ``/metrics``)."""

    prompt_tokens: float = 0.0
    p2p_tokens: float = 0.0
    prefix_hits: float = 0.0
    failed_transfers: float = 0.0  # NIXL connectors' counter on P and D; kvpush's timelines

    @property
    def p2p_share(self) -> float | None:
        return self.p2p_tokens / self.prompt_tokens if self.prompt_tokens else None


@dataclass
class PairRun:
    """One connector's pair, start to stop."""

    connector: str
    round: int
    log_dir: str
    ready_s: tuple[float | None, float | None] = (None, None)
    idle_fresh: IdleCost | None = None
    idle_after: IdleCost | None = None
    warmup: list[Sample] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
    source: KvSource | None = None
    #: P legs' median at the load length on a connector-less pair (``none`` only)
    capacity_probe_s: float | None = None
    error: str | None = None
    elapsed_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "connector": self.connector,
            "round": self.round,
            "log_dir": self.log_dir,
            "ready_s": list(self.ready_s),
            "idle_fresh": self.idle_fresh.to_json() if self.idle_fresh else None,
            "idle_after": self.idle_after.to_json() if self.idle_after else None,
            "warmup": [s.to_json() for s in self.warmup],
            "phases": [p.to_json() for p in self.phases],
            "source": asdict(self.source) if self.source else None,
            "capacity_probe_s": self.capacity_probe_s,
            "error": self.error,
            "elapsed_s": self.elapsed_s,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PairRun:
        ready = data.get("ready_s") or [None, None]
        return cls(
            connector=data["connector"],
            round=int(data["round"]),
            log_dir=data.get("log_dir", ""),
            ready_s=(ready[0], ready[1]),
            idle_fresh=IdleCost.from_json(data["idle_fresh"]) if data.get("idle_fresh") else None,
            idle_after=IdleCost.from_json(data["idle_after"]) if data.get("idle_after") else None,
            warmup=[Sample.from_json(s) for s in data.get("warmup", [])],
            phases=[Phase.from_json(p) for p in data.get("phases", [])],
            source=KvSource(**data["source"]) if data.get("source") else None,
            capacity_probe_s=data.get("capacity_probe_s"),
            error=data.get("error"),
            elapsed_s=float(data.get("elapsed_s", 0.0)),
        )


@dataclass
class ServingResult:
    config: ServingConfig
    started: datetime.datetime
    run_dir: str
    pairs: list[PairRun] = field(default_factory=list)
    #: P's prefills per second at the load length, and where that figure came from
    capacity: float | None = None
    capacity_source: str = ""
    orders: list[list[str]] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)
    elapsed_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        config = asdict(self.config)
        return {
            "benchmark": "kvpush bench serving",
            "kvpush": kvpush.__version__,
            "config": config,
            "command": self.config.command(),
            "started": self.started.isoformat(),
            "run_dir": self.run_dir,
            "capacity": self.capacity,
            "capacity_source": self.capacity_source,
            "orders": self.orders,
            "notes": self.notes,
            "elapsed_s": self.elapsed_s,
            "pairs": [p.to_json() for p in self.pairs],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ServingResult:
        raw = dict(data["config"])
        for key in ("connectors", "lengths", "loads"):
            raw[key] = tuple(raw[key])
        return cls(
            config=ServingConfig(**raw),
            started=datetime.datetime.fromisoformat(data["started"]),
            run_dir=data.get("run_dir", ""),
            pairs=[PairRun.from_json(p) for p in data.get("pairs", [])],
            capacity=data.get("capacity"),
            capacity_source=data.get("capacity_source", ""),
            orders=[list(o) for o in data.get("orders", [])],
            notes=dict(data.get("notes") or {}),
            elapsed_s=float(data.get("elapsed_s", 0.0)),
        )


def load_result(path: Path) -> ServingResult:
    return ServingResult.from_json(json.loads(path.read_text()))


def save_result(result: ServingResult, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_json(), indent=1) + "\n")
