"""The serving benchmark's client: routed requests, arrival schedules and their statistics.

Owns what happens between the benchmark and one P/D pair, identical for every connector:

* :func:`send` routes one streamed completion through kvpush's router core in-process
  (:mod:`kvpush.router`, the code ``kvpush proxy`` serves; no HTTP hop in between, so every
  connector sees the same client): **push** sends P's leg (``max_tokens=1``) and D's leg at the
  same moment with one ``X-Request-Id`` and ``transfer_id``, the contract kvpush and upstream
  ``NixlPushConnector`` both read; **pull** (upstream ``NixlConnector``) sends P's leg with
  ``do_remote_decode`` first and D's leg with the ``kv_transfer_params`` P answered. Every
  request has one deadline; past it both legs are closed (vLLM then aborts the request) and it
  counts as failed.
* :func:`arrival_offsets` and :func:`phase_prompts`: the same seed gives the same prompts and
  the same arrival times for every connector;
* :func:`run_phase`: one phase, one request at a time or open loop at the scheduled times;
* :func:`summarize`: TTFT, TPOT and handover percentiles of a phase.

Times are unix seconds taken as monotonic offsets from one ``time.time()`` read per request, so
a request's figures are differences of one clock.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvpush.router import Completion, PrefillInstance, RouterThread, Timeouts
from kvpush_lab.demo_vllm import completion_body, percentile, prompt_token_ids

Routing = Literal["push", "pull"]
JSON = dict[str, Any]


@dataclass(frozen=True)
class Route:
    """How the client reaches one pair: ``push`` or ``pull`` routing, P's and D's URLs, and
    P's coordinates for a push D leg."""

    routing: Routing
    prefill: PrefillInstance
    decode_url: str


@dataclass
class Sample:
    """One request as the client saw it (unix seconds; None where it never happened)."""

    index: int
    prompt_tokens: int
    offset_s: float = 0.0
    request_id: str = ""
    sent: float = 0.0
    prefill_done: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    chunks: int = 0
    error: str | None = None
    #: ``time.monotonic()`` when :attr:`sent` was taken: later times are offsets from it.
    mono_sent: float = field(default=0.0, repr=False)

    def start(self) -> None:
        self.mono_sent = time.monotonic()
        self.sent = time.time()

    def now(self) -> float:
        """Unix time now, on this request's clock (``sent`` plus monotonic time since)."""
        return self.sent + (time.monotonic() - self.mono_sent)

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def prefill_s(self) -> float | None:
        """P's leg: sent to P's answer (its prefill, queueing included)."""
        return None if self.prefill_done is None else self.prefill_done - self.sent

    @property
    def handover(self) -> float | None:
        """First token from D minus P's answer: what disaggregation adds after the prefill."""
        if self.first_token is None or self.prefill_done is None:
            return None
        return self.first_token - self.prefill_done

    @property
    def tpot(self) -> float | None:
        """Mean time between streamed tokens after the first."""
        if self.first_token is None or self.last_token is None or self.chunks < 2:
            return None
        return (self.last_token - self.first_token) / (self.chunks - 1)

    def to_json(self) -> JSON:
        def rel(value: float | None) -> float | None:
            return None if value is None else value - self.sent

        return {
            "index": self.index,
            "prompt_tokens": self.prompt_tokens,
            "offset_s": self.offset_s,
            "request_id": self.request_id,
            "sent": self.sent,
            "prefill_done_s": rel(self.prefill_done),
            "first_token_s": rel(self.first_token),
            "last_token_s": rel(self.last_token),
            "chunks": self.chunks,
            "error": self.error,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Sample:
        sent = float(data["sent"])

        def unrel(key: str) -> float | None:
            value = data.get(key)
            return None if value is None else sent + float(value)

        return cls(
            index=int(data["index"]),
            prompt_tokens=int(data["prompt_tokens"]),
            offset_s=float(data.get("offset_s", 0.0)),
            request_id=str(data.get("request_id", "")),
            sent=sent,
            prefill_done=unrel("prefill_done_s"),
            first_token=unrel("first_token_s"),
            last_token=unrel("last_token_s"),
            chunks=int(data.get("chunks", 0)),
            error=data.get("error"),
        )


# --- schedules and prompts ---------------------------------------------------------------------


def arrival_offsets(count: int, rate: float | None, seed: int, label: str) -> list[float]:
    """Seconds after a phase's start at which its requests go out: 0 for every request of a
    one-at-a-time phase (``rate`` None), else a Poisson process of ``rate`` per second starting
    at 0. The gaps are unit exponentials from ``(seed, label)`` scaled by ``1 / rate``, so the
    same seed gives the same schedule for every connector."""
    if count < 0:
        raise ValueError(f"count {count} < 0")
    if rate is None:
        return [0.0] * count
    if rate <= 0:
        raise ValueError(f"rate {rate} must be positive")
    rng = random.Random(f"{seed}:{label}:arrivals")
    offsets, at = [], 0.0
    for i in range(count):
        if i:
            at += rng.expovariate(1.0) / rate
        offsets.append(at)
    return offsets


def phase_prompts(count: int, length: int, vocab: int, seed: int, label: str) -> list[list[int]]:
    """``count`` random prompts of ``length`` ordinary token ids, fixed by ``(seed, label)``;
    all different, so no prefix cache serves any of them."""
    rng = random.Random(f"{seed}:{label}:prompts")
    return [prompt_token_ids(length, vocab, rng) for _ in range(count)]


# --- one request -------------------------------------------------------------------------------


def _router(route: Route, timeout_s: float) -> RouterThread:
    """The router core for ``route``'s pair: its P coordinates, its mode, bounds no shorter
    than a request's deadline (which :func:`send` enforces itself)."""
    bound = timeout_s + 5.0
    return RouterThread(
        [route.prefill],
        [route.decode_url],
        mode=route.routing,
        timeouts=Timeouts(prefill_s=bound, decode_s=bound, client_s=bound),
    )


def _take(sample: Sample, completion: Completion) -> Sample:
    """The router's view of one request, on the sample's clock."""

    def at(offset: float | None) -> float | None:
        return None if offset is None else completion.sent + offset

    sample.request_id = completion.request_id
    sample.sent, sample.mono_sent = completion.sent, completion.mono_sent
    sample.prefill_done = at(completion.prefill_s)
    sample.first_token = at(completion.first_token_s)
    sample.last_token = at(completion.last_token_s)
    sample.chunks = completion.chunks
    if not completion.ok:
        leg = "P" if completion.failed_leg == "prefill" else "D"
        sample.error = f"{leg}: {completion.error or 'no token streamed'}"
    return sample


def send(
    route: Route,
    body: JSON,
    sample: Sample,
    timeout_s: float,
    router: RouterThread | None = None,
) -> Sample:
    """One request through the pair, routed as ``route`` says (through ``router``, else a
    router of its own); never raises, never outlives ``timeout_s`` by much. Errors end up in
    ``sample.error``, prefixed with the leg that failed (``P:`` or ``D:``)."""
    if router is None:
        with _router(route, timeout_s) as own:
            return send(route, body, sample, timeout_s, own)
    completion = router.complete({**body, "stream": True}, timeout_s=timeout_s)
    return _take(sample, completion)


# --- one phase ---------------------------------------------------------------------------------


def run_phase(
    route: Route,
    model: Path,
    prompts: Sequence[list[int]],
    offsets: Sequence[float] | None,
    *,
    max_tokens: int,
    timeout_s: float,
    stop_at: float | None = None,
) -> list[Sample]:
    """Sends ``prompts``: one at a time when ``offsets`` is None, else each at its offset after
    the phase's start (open loop: a late answer never delays the next arrival). No request goes
    out after ``stop_at`` (``time.monotonic()``); the samples of those sent are returned."""
    samples = [
        Sample(i, len(p), offsets[i] if offsets is not None else 0.0) for i, p in enumerate(prompts)
    ]
    bodies = [completion_body(model, p, max_tokens) for p in prompts]
    sent: list[Sample] = []

    def past_stop(at: float) -> bool:
        return stop_at is not None and at > stop_at

    with _router(route, timeout_s) as router:
        if offsets is None:
            for sample, body in zip(samples, bodies, strict=True):
                if past_stop(time.monotonic()):
                    break
                sent.append(send(route, body, sample, timeout_s, router))
            return sent
        threads: list[threading.Thread] = []
        start = time.monotonic()
        for sample, body in zip(samples, bodies, strict=True):
            if past_stop(start + sample.offset_s):
                break
            wait = start + sample.offset_s - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            thread = threading.Thread(
                target=send,
                args=(route, body, sample, timeout_s, router),
                name=f"bench-request-{sample.index}",
                daemon=True,
            )
            thread.start()
            threads.append(thread)
            sent.append(sample)
        for thread in threads:
            thread.join(timeout_s + 10.0)
        return sent


# --- statistics --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PhaseStats:
    """A phase's figures in seconds (NaN where no request gave one)."""

    requests: int
    failed: int
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    handover_p50: float
    handover_p99: float
    prefill_p50: float
    #: Requests per second that went out (the schedule's, as kept).
    offered_rate: float

    def to_json(self) -> JSON:
        return {k: (None if v != v else v) for k, v in self.__dict__.items()}


def _values(samples: Sequence[Sample], name: str) -> list[float]:
    out = []
    for sample in samples:
        if sample.ok:
            value = getattr(sample, name)
            if value is not None:
                out.append(float(value))
    return out


def summarize(samples: Sequence[Sample]) -> PhaseStats:
    ttft = _values(samples, "ttft")
    handover = _values(samples, "handover")
    sent = sorted(s.sent for s in samples if s.sent)
    span = sent[-1] - sent[0] if len(sent) > 1 else 0.0
    return PhaseStats(
        requests=len(samples),
        failed=sum(1 for s in samples if not s.ok),
        ttft_p50=percentile(ttft, 50),
        ttft_p99=percentile(ttft, 99),
        tpot_p50=percentile(_values(samples, "tpot"), 50),
        handover_p50=percentile(handover, 50),
        handover_p99=percentile(handover, 99),
        prefill_p50=percentile(_values(samples, "prefill_s"), 50),
        offered_rate=(len(sent) - 1) / span if span > 0 else float("nan"),
    )


def median_or_nan(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")
