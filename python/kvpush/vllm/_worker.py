"""The connector's worker side, in plain Python (no vLLM import): one native endpoint per worker
process, fed by the scheduler's metadata, reporting finished transfers back."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import kvpush
from kvpush.exceptions import BusyError, KvPushError, LayoutError
from kvpush.vllm import _stats
from kvpush.vllm._layout import CacheLayout, Model, TensorView, layout_from_caches, sources_of
from kvpush.vllm._scheduler import PushMetadata, RecvRequest

logger = logging.getLogger("vllm.kvpush")

#: When set, each worker appends one JSON line per finished transfer to
#: ``$KVPUSH_TIMELINE_DIR/<engine>-tp<rank>.jsonl`` (``kvpush demo`` reads them).
TIMELINE_DIR_ENV = "KVPUSH_TIMELINE_DIR"

#: CPUs for the endpoint's native threads (writer, side channel, NIXL's): ``inherit`` keeps the
#: creating thread's affinity, a list such as ``2,3`` or ``4-7`` names them. Unset: the CPUs the
#: engine process was allowed (see :func:`native_thread_cpus`).
THREAD_CPUS_ENV = "KVPUSH_THREAD_CPUS"


def cpu_list(text: str) -> set[int]:
    """CPUs written as Linux lists them: ``0``, ``2,3``, ``4-7``, ``0,2-3``."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def native_thread_cpus() -> set[int] | None:
    """Where the endpoint's threads should run, or None to leave them where they are born.

    vLLM's CPU worker pins the thread that runs the forward pass to one core (each OpenMP thread
    to its own); threads it starts inherit that, so a writer born there would wait for the
    forward pass to yield the core before it could post a WRITE. The native threads get the CPUs
    the engine process (the worker's parent, or the process itself with vLLM's in-process
    executor) was allowed instead: the operator's own pinning (``taskset``, cgroups) still holds.
    """
    configured = os.environ.get(THREAD_CPUS_ENV, "").strip()
    if configured == "inherit":
        return None
    if configured:
        try:
            return cpu_list(configured)
        except ValueError:
            raise KvPushError(
                f"{THREAD_CPUS_ENV}={configured!r}: expected 'inherit' or CPUs like '2,3' or '4-7'"
            ) from None
    current = os.sched_getaffinity(0)
    parent = os.getppid()
    if parent <= 1:
        return None  # orphaned (or a container's first process): no engine to take CPUs from
    try:
        engine = os.sched_getaffinity(parent) | os.sched_getaffinity(os.getpid())
    except OSError:
        return None
    return engine if not engine <= current else None


@contextmanager
def _threads_born_on(cpus: set[int] | None) -> Iterator[None]:
    """Threads started inside inherit ``cpus`` as their affinity; this thread's is restored."""
    if cpus is None:
        yield
        return
    previous = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as error:
        logger.warning("kvpush: cannot run the endpoint's threads on CPUs %s: %s", cpus, error)
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)


#: How long a worker's report in a step that computes nothing may wait for a transfer event (s).
IDLE_STEP_WAIT = 0.002


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker's endpoint needs that is not in the KV tensors."""

    engine_id: str
    side_channel_host: str
    side_channel_port: int
    secret: bytes | None
    #: Listen beyond loopback without a secret (``insecure`` / ``KVPUSH_INSECURE=1``).
    insecure: bool
    ttl: float
    receive_timeout: float
    transport: str
    model_fingerprint: str
    #: The endpoint's timeouts (s): see docs/operations.md, "The fence".
    write_timeout: float = 10.0
    peer_timeout: float = 5.0
    heartbeat_interval: float = 1.0


def compatibility(model_fingerprint: str, cache: CacheLayout) -> str:
    """What P and D must agree on: the model's KV geometry; block sizes and TP sizes only where
    kvpush cannot translate between them (opaque blocks move whole, so their size must match;
    heads that cannot be sliced need the same share on both sides)."""
    layout = cache.layout
    total_heads = layout.heads * layout.tp_size
    digest = hashlib.sha256(
        f"{model_fingerprint}|{len(layout.regions)}|{total_heads}|{layout.head_bytes}|"
        f"{layout.token_order}|{cache.agreement()}|kvpush/{kvpush.PROTOCOL_VERSION}".encode()
    )
    return digest.hexdigest()[:32]


class PushWorker:
    """One worker's endpoint and the requests it tracks for vLLM."""

    def __init__(self, config: WorkerConfig, model: Model) -> None:
        self._config = config
        self._model = model
        self._endpoint: kvpush.Endpoint | None = None
        self._cache: CacheLayout | None = None
        self._recv_blocks: dict[str, set[int]] = {}
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._timeline: IO[str] | None = None
        self._decided: dict[str, float] = {}
        self._stats = _stats.empty()
        #: This step computes nothing: the next report may wait for an event (see `apply`).
        self._idle_step = False
        #: Aborts and cancels the endpoint refused because its writer was far behind
        #: (`BusyError`: nothing was done); each step tries them again first.
        self._busy_aborts: list[tuple[str, str | None]] = []
        self._busy_cancels: list[str] = []
        #: Unix time of the endpoint clock's zero, taken once while the worker is quiet: two
        #: clock reads on a busy machine can be tens of ms apart, which would skew timelines.
        self._clock_offset = 0.0

    @property
    def endpoint(self) -> kvpush.Endpoint:
        if self._endpoint is None:
            raise KvPushError("the connector's KV caches are not registered yet")
        return self._endpoint

    def register(self, views: Sequence[TensorView], groups: Sequence[int] | None = None) -> None:
        """Starts the endpoint over the KV cache tensors (one per layer, in layer order), each
        in the KV cache group ``groups`` names (default: one group)."""
        cache = layout_from_caches(views, self._model, groups)
        layout = cache.layout
        self._cache = cache
        if cache.opaque_because is not None:
            logger.info(
                "kvpush: KV blocks move whole (P and D need the same block size): %s",
                cache.opaque_because,
            )
        devices = {view.cuda_device for view in views}
        if len(devices) > 1:
            raise LayoutError(
                f"KV cache tensors on several devices ({sorted(map(str, devices))}): one worker's "
                "cache must live on one GPU (or in host memory)"
            )
        (device,) = devices or {None}
        if self._model.pp_size > 1:
            # Each P stage holds only its own layers, so a D would have to register with every
            # stage and count one DONE per stage (docs/operations.md, "Pipeline parallelism"):
            # refused here, with the reason, rather than failing every request at its handshake.
            raise LayoutError(
                f"engine {self._config.engine_id} runs {self._model.pp_size} pipeline stages: "
                "kvpush's connector moves KV between single-stage engines only for now; run "
                "P and D with --pipeline-parallel-size 1"
            )
        port = self._config.side_channel_port + self._model.worker_index
        cpus = native_thread_cpus()
        with _threads_born_on(cpus):
            self._endpoint = kvpush.Endpoint(
                self._config.engine_id,
                layout,
                memory=list(cache.memory),
                # VRAM of that GPU, registered with its device id (NIXL's VRAM_SEG), and
                # advertised in the handshake; None registers host memory (DRAM).
                device=device,
                transport=self._config.transport,  # type: ignore[arg-type]
                # No agent_name: the endpoint makes one unique to this process, so that two
                # replicas sharing an engine id, or a restarted worker, never share an agent.
                bind=f"{self._config.side_channel_host}:{port}",
                secret=self._config.secret,
                insecure=self._config.insecure,
                pp_rank=self._model.pp_rank,
                pp_size=self._model.pp_size,
                write_timeout=self._config.write_timeout,
                peer_timeout=self._config.peer_timeout,
                heartbeat_interval=self._config.heartbeat_interval,
                compatibility=compatibility(self._config.model_fingerprint, cache),
            )
        self._clock_offset = time.time() - self._endpoint.clock()
        timeline_dir = os.environ.get(TIMELINE_DIR_ENV)
        if timeline_dir:
            path = Path(timeline_dir) / f"{self._config.engine_id}-tp{self._model.tp_rank}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._timeline = path.open("a", encoding="utf-8")
        logger.info(
            "kvpush endpoint %s listening on %s (%d regions, %d-token blocks, threads on CPUs %s)",
            self._config.engine_id,
            self._endpoint.address,
            len(layout.regions),
            layout.block_tokens,
            "inherited" if cpus is None else ",".join(map(str, sorted(cpus))),
        )

    def apply(self, metadata: PushMetadata) -> None:
        """Acts on one step's instructions. Never raises for one request's trouble: a refused
        request is reported finished (and failed) so vLLM frees or recomputes it."""
        endpoint = self.endpoint
        assert self._cache is not None
        self._idle_step = metadata.idle
        for send in metadata.sends:
            self._decided[send.request_id] = send.decided_at
            try:
                endpoint.ready(
                    send.request_id,
                    [list(group) for group in send.blocks],
                    self._cache.tokens_to_write(send.num_tokens),
                    transfer_id=send.transfer_id,
                    first_tokens=list(send.first_tokens) or None,
                    ttl=self._config.ttl,
                )
            except KvPushError as error:
                # D cancelled or gave up first: nothing will be written, free the blocks now.
                logger.info("kvpush: request %s not sent: %s", send.request_id, error)
                self._decided.pop(send.request_id, None)
                self._finished_sending.add(send.request_id)
        aborts, self._busy_aborts = [*self._busy_aborts, *metadata.aborts], []
        for request_id, transfer_id in aborts:
            try:
                endpoint.abort(request_id, transfer_id)
            except BusyError:
                self._busy_aborts.append((request_id, transfer_id))
        for recv in metadata.recvs:
            self._expect(endpoint, recv)
        cancels, self._busy_cancels = [*self._busy_cancels, *metadata.cancels], []
        for request_id in cancels:
            try:
                endpoint.cancel(request_id)
            except BusyError:
                self._busy_cancels.append(request_id)
        if self._busy_aborts or self._busy_cancels:
            logger.warning(
                "kvpush: the endpoint's writer is behind; %d aborts and %d cancels wait for the "
                "next step",
                len(self._busy_aborts),
                len(self._busy_cancels),
            )

    def _expect(self, endpoint: kvpush.Endpoint, recv: RecvRequest) -> None:
        assert self._cache is not None
        try:
            sources = sources_of(self._model, self._cache, recv.remote_tp_size)
        except LayoutError as error:
            self._fail_recv(recv.request_id, [b for g in recv.blocks for b in g], str(error))
            return
        # P's workers listen on consecutive ports from its base (one stage: base + tp rank).
        try:
            endpoint.expect(
                recv.request_id,
                [f"{recv.remote_host}:{recv.remote_port + rank}" for rank in sources.ranks],
                [list(group) for group in recv.blocks],
                self._cache.tokens_to_write(recv.num_tokens),
                transfer_id=recv.transfer_id,
                first_tokens=list(recv.first_tokens) or [recv.first_token] * len(recv.blocks),
                ttl=self._config.receive_timeout,
                share=sources.share,
            )
        except KvPushError as error:
            # Nothing was registered (the writer is behind, or the request is out of range):
            # the request fails alone, and `kv_load_failure_policy` applies.
            self._fail_recv(recv.request_id, [b for g in recv.blocks for b in g], str(error))
            return
        self._recv_blocks[recv.request_id] = {b for g in recv.blocks for b in g}
        self._decided[recv.request_id] = recv.decided_at

    def _fail_recv(self, request_id: str, blocks: Sequence[int], reason: str) -> None:
        logger.warning("kvpush: KV for request %s not received: %s", request_id, reason)
        self._finished_recving.add(request_id)
        self._failed_recving.add(request_id)
        self._load_errors.update(blocks)

    def _record(self, event: kvpush.TransferEvent, decided: float | None, offset: float) -> None:
        """One timeline line, its times moved from the endpoint's clock to unix time (``offset``).

        ``scheduled`` is when vLLM's scheduler decided (P: the prefill finished; D: the blocks
        were allocated): ``ready``/``registered`` minus it is the wait for the scheduler's
        metadata to reach the worker.
        """
        if self._timeline is None:
            return
        wall = {step: at + offset for step, at in event.timeline.items()}
        if decided is not None:
            wall["scheduled"] = decided
        line = {
            "engine": self._config.engine_id,
            "role": event.role,
            "request_id": event.request_id,
            "key": event.key,
            "outcome": event.outcome,
            "reason": event.reason,
            "bytes": event.bytes,
            "runs": event.runs,
            "wall": wall,
        }
        self._timeline.write(json.dumps(line) + "\n")
        self._timeline.flush()

    def poll(self, wait: float = 0.0) -> None:
        """Collects the endpoint's events into the sets vLLM asks for, waiting up to ``wait``
        seconds for the first one."""
        offset = self._clock_offset
        events = self.endpoint.wait(wait) if wait > 0 else self.endpoint.poll()
        for event in events:
            if event.outcome == "quarantined":
                # A notice, not the end: a WRITE may still be moving bytes (P stalled, a link
                # cut, a peer that never confirmed), so the request is not reported finished and
                # vLLM keeps its blocks allocated (a receive's even if the request is aborted).
                # Its final event follows once the transport or P settles it, or never.
                self._record(event, self._decided.get(event.request_id), offset)
                _stats.observe(self._stats, event, None, offset)
                logger.error(
                    "kvpush: %s of %s quarantined, its KV blocks stay held until it settles: %s",
                    event.role,
                    event.request_id,
                    event.reason,
                )
                continue
            decided = self._decided.pop(event.request_id, None)
            self._record(event, decided, offset)
            _stats.observe(self._stats, event, decided, offset)
            if event.role == "send":
                if event.outcome == "failed":
                    logger.warning("kvpush: send of %s failed: %s", event.request_id, event.reason)
                self._finished_sending.add(event.request_id)
                continue
            blocks = self._recv_blocks.pop(event.request_id, set())
            if event.outcome == "done":
                self._finished_recving.add(event.request_id)
            else:
                self._fail_recv(event.request_id, sorted(blocks), event.reason or event.outcome)

    def take_finished(self) -> tuple[set[str], set[str], set[str]]:
        """Sends finished, receives finished (failed ones included), receives failed.

        In a step that computes nothing while transfers are outstanding, waits up to
        :data:`IDLE_STEP_WAIT` for the next of them to end: vLLM's engine loop steps without
        pause while a request waits for its KV, and would otherwise spin a core (on P, while
        the KV is sent) that the transfer itself may need. An event ends the wait at once.
        """
        idle = self._idle_step and bool(self._decided) and not self._has_finished()
        self._idle_step = False
        self.poll(IDLE_STEP_WAIT if idle else 0.0)
        out = (self._finished_sending, self._finished_recving, self._failed_recving)
        self._finished_sending, self._finished_recving, self._failed_recving = set(), set(), set()
        return out

    def _has_finished(self) -> bool:
        return bool(self._finished_sending or self._finished_recving)

    def take_stats(self) -> dict[str, object] | None:
        """Transfer statistics since the last call (None when nothing happened)."""
        self.poll()
        if _stats.is_empty(self._stats):
            return None
        stats, self._stats = self._stats, _stats.empty()
        return stats

    def take_load_errors(self) -> set[int]:
        """Block ids of failed receives (reported no later than the receive's finish)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        if self._endpoint is not None:
            stuck = self._endpoint.close()
            if stuck is not None:
                logger.error("kvpush: closing the endpoint: %s", stuck)
        if self._timeline is not None:
            self._timeline.close()
