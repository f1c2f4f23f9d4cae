"""The serving benchmark's client: routed requests, arrival schedules and their statistics.

Owns what happens between the benchmark and one P/D pair, identical for every connector:

* :func:`send` routes one streamed completion itself (no proxy in between, so every connector
  sees the same client): **push** sends P's leg (``max_tokens=1``) and D's leg at the same
  moment with one ``X-Request-Id`` and ``transfer_id`` (the bodies are :mod:`kvpush.proxy`'s,
  the contract kvpush and upstream ``NixlPushConnector`` both read); **pull** (upstream
  ``NixlConnector``) sends P's leg with ``do_remote_decode`` first and D's leg with the
  ``kv_transfer_params`` P answered when P's answer arrives. Every request has one deadline;
  past it both legs' sockets are shut (vLLM then aborts the request) and it counts as failed.
* :func:`arrival_offsets` and :func:`phase_prompts`: the same seed gives the same prompts and
  the same arrival times for every connector;
* :func:`run_phase`: one phase, one request at a time or open loop at the scheduled times;
* :func:`summarize`: TTFT, TPOT and handover percentiles of a phase.

Times are unix seconds taken as monotonic offsets from one ``time.time()`` read per request, so
a request's figures are differences of one clock.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from kvpush.proxy import PrefillInstance, decode_body, prefill_body
from kvpush_lab.demo_vllm import completion_body, percentile, prompt_token_ids

Routing = Literal["push", "pull"]
JSON = dict[str, Any]

#: The pull router's P leg (vLLM's ``disagg_proxy`` for ``NixlConnector``): P keeps the blocks
#: for D to read and answers where they are.
PULL_PREFILL_PARAMS: JSON = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


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


class _Connection:
    """One HTTP exchange with a deadline, which another thread may abort at any point."""

    def __init__(self, url: str, deadline: float) -> None:
        parts = urlsplit(url)
        self._deadline = deadline
        self._conn = http.client.HTTPConnection(
            parts.hostname or "127.0.0.1", parts.port or 80, timeout=self.remaining()
        )
        self._lock = threading.Lock()
        self._aborted = False

    def remaining(self) -> float:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("past the request's deadline")
        return left

    def post(self, body: JSON, headers: Mapping[str, str]) -> http.client.HTTPResponse:
        self._conn.connect()
        with self._lock:
            if self._aborted:
                raise ConnectionAbortedError("aborted")
        self._conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **headers},
        )
        self._arm()
        return self._conn.getresponse()

    def _arm(self) -> None:
        """Bounds the next socket wait by what is left of the deadline."""
        sock = self._conn.sock
        if sock is not None:
            sock.settimeout(self.remaining())

    def lines(self, response: http.client.HTTPResponse) -> Iterator[bytes]:
        while True:
            self._arm()
            line = response.readline()
            if not line:
                return
            yield line

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            sock = self._conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._conn.close()


def _describe(error: BaseException) -> str:
    if isinstance(error, TimeoutError | socket.timeout):
        return "timed out"
    return f"{type(error).__name__}: {error}"


def _error_text(payload: bytes) -> str:
    text = " ".join(payload.decode(errors="replace").split())
    return text[:300]


def _prefill(
    body: JSON,
    headers: Mapping[str, str],
    sample: Sample,
    conn: _Connection,
    on_failure: _Connection | None = None,
) -> JSON | None:
    """P's leg: returns P's ``kv_transfer_params`` (or {}), None with ``sample.error`` set.
    A failed leg aborts ``on_failure`` (a push D leg, which would wait for KV that never comes).
    """
    params = None
    try:
        response = conn.post(body, headers)
        payload = response.read()
        sample.prefill_done = sample.now()
        if response.status != 200:
            sample.error = sample.error or f"P: HTTP {response.status}: {_error_text(payload)}"
            return None
        params = dict(json.loads(payload).get("kv_transfer_params") or {})
    except (OSError, http.client.HTTPException, ValueError) as error:
        sample.error = sample.error or f"P: {_describe(error)}"
    finally:
        conn.close()
        if params is None and on_failure is not None:
            on_failure.abort()
    return params


def _decode(body: JSON, headers: Mapping[str, str], sample: Sample, conn: _Connection) -> None:
    """D's leg, streamed: the first and last token's arrival and how many chunks came."""
    try:
        response = conn.post(body, {**headers, "Accept": "text/event-stream"})
        if response.status != 200:
            sample.error = sample.error or (
                f"D: HTTP {response.status}: {_error_text(response.read())}"
            )
            return
        done = False
        for raw in conn.lines(response):
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                sample.error = sample.error or f"D: error event: {json.dumps(event['error'])[:300]}"
                return
            if event.get("choices"):
                now = sample.now()
                if sample.first_token is None:
                    sample.first_token = now
                sample.last_token = now
                sample.chunks += 1
        if not done:
            sample.error = sample.error or "D: the stream ended without [DONE]"
        elif sample.first_token is None:
            sample.error = sample.error or "D: no token streamed"
    except (OSError, http.client.HTTPException, ValueError) as error:
        sample.error = sample.error or f"D: {_describe(error)}"
    finally:
        conn.close()


def send(route: Route, body: JSON, sample: Sample, timeout_s: float) -> Sample:
    """One request through the pair, routed as ``route`` says; never raises, never outlives
    ``timeout_s`` by more than a join. Errors end up in ``sample.error``."""
    rid = str(uuid.uuid4())
    sample.request_id = rid
    headers = {"X-Request-Id": rid}
    deadline = time.monotonic() + timeout_s
    sample.start()
    p_conn = _Connection(route.prefill.url, deadline)
    d_conn = _Connection(route.decode_url, deadline)
    if route.routing == "pull":
        p_body = {**body, "max_tokens": 1, "stream": False}
        p_body.pop("stream_options", None)
        p_body["kv_transfer_params"] = dict(PULL_PREFILL_PARAMS)
        params = _prefill(p_body, headers, sample, p_conn)
        if params is None:
            return sample
        if not params:
            sample.error = "P answered no kv_transfer_params"
            return sample
        _decode({**body, "kv_transfer_params": params}, headers, sample, d_conn)
        return sample
    transfer_id = str(uuid.uuid4())
    p_leg = prefill_body(body, transfer_id)
    d_leg = decode_body(body, route.prefill, rid, transfer_id)
    thread = threading.Thread(
        target=_prefill,
        args=(p_leg, headers, sample, p_conn, d_conn),
        name=f"bench-prefill-{rid[:8]}",
        daemon=True,
    )
    thread.start()
    _decode(d_leg, headers, sample, d_conn)
    if not sample.ok:
        p_conn.abort()  # D failed: P's leg is of no use any more
    thread.join(max(0.0, deadline - time.monotonic()) + 5.0)
    if thread.is_alive():
        p_conn.abort()
        sample.error = sample.error or "P: no answer by the deadline"
    return sample


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

    if offsets is None:
        for sample, body in zip(samples, bodies, strict=True):
            if past_stop(time.monotonic()):
                break
            sent.append(send(route, body, sample, timeout_s))
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
            args=(route, body, sample, timeout_s),
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
