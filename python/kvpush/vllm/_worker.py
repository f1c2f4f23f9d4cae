"""The connector's worker side, in plain Python (no vLLM import): one native endpoint per worker
process, fed by the scheduler's metadata, reporting finished transfers back."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import IO

import kvpush
from kvpush._native import LayerStreams
from kvpush.exceptions import (
    BusyError,
    KvPushError,
    LayoutError,
    RendezvousError,
    TransportError,
    UnhealthyError,
)
from kvpush.vllm import _stats
from kvpush.vllm._layers import Event, LayerGate, Stream, cuda_events
from kvpush.vllm._layout import CacheLayout, Model, TensorView, layout_from_caches, sources_of
from kvpush.vllm.config import WorkerConfig, native_thread_cpus, timeline_dir
from kvpush.vllm.metadata import PushMetadata, RecvRefused, RecvRequest, SendRequest

logger = logging.getLogger("vllm.kvpush")

#: No streams (they are immutable, so every step without any shares this one).
NO_STREAMS = LayerStreams()


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

    def __init__(
        self,
        config: WorkerConfig,
        model: Model,
        *,
        layer_events: Callable[[], Event] | None = None,
    ) -> None:
        """``layer_events`` makes the events a layer's KV waits for before it streams (default:
        CUDA events on a GPU worker, none on a CPU one, whose forward is synchronous)."""
        self._config = config
        self._model = model
        self._endpoint: kvpush.Endpoint | None = None
        self._closed = False
        self._cache: CacheLayout | None = None
        #: Transfers the endpoint took and vLLM waits for: each is reported once, when its
        #: event comes (a refused one is reported at once and never enters these).
        self._sending: set[str] = set()
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
        self._busy_aborts: list[tuple[str, str | None, bool]] = []
        self._busy_cancels: list[str] = []
        #: Unix time of the endpoint clock's zero, taken once while the worker is quiet: two
        #: clock reads on a busy machine can be tens of ms apart, which would skew timelines.
        self._clock_offset = 0.0
        #: Layer-wise push: each moved layer's regions (empty: layers do not stream here), the
        #: step's streams (read once per step, see `_layer_streams`), and the gate that hands a
        #: layer over once its KV is final (see `save_layer`).
        self._layer_regions: dict[str, tuple[int, int]] = {}
        self._streams = NO_STREAMS
        self._layer_events = layer_events
        self._gate = LayerGate(self._stream_layer)

    @property
    def endpoint(self) -> kvpush.Endpoint:
        """The endpoint, for new work: refused before registration and after :meth:`close`
        (a closed endpoint still takes a ``ready`` it has no registration for, and would never
        report it)."""
        if self._closed:
            raise KvPushError("the connector is shut down: no new transfers")
        if self._endpoint is None:
            raise KvPushError("the connector's KV caches are not registered yet")
        return self._endpoint

    @property
    def _layout(self) -> CacheLayout:
        if self._cache is None:
            raise KvPushError("the connector's KV caches are not registered yet")
        return self._cache

    def register(
        self,
        views: Sequence[TensorView],
        groups: Sequence[int] | None = None,
        layers: Mapping[str, int] | None = None,
    ) -> None:
        """Starts the endpoint over the KV cache tensors (one per layer, in layer order), each
        in the KV cache group ``groups`` names (default: one group); ``layers`` names each
        view's layers (layer name to view index), for layer-wise push."""
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
        self._layer_regions = self._streamed_layers(cache, layers or {}, device)
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
            options = kvpush.EndpointOptions(
                transport=self._config.transport,  # type: ignore[arg-type]
                # VRAM of that GPU, registered with its device id (NIXL's VRAM_SEG), and
                # advertised in the handshake; None registers host memory (DRAM).
                device=device,
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
                max_connections=self._config.max_connections,
                max_connections_per_host=self._config.max_connections_per_host,
                max_handshakes=self._config.max_handshakes,
                compatibility=compatibility(self._config.model_fingerprint, cache),
            )
            self._endpoint = kvpush.Endpoint(
                self._config.engine_id, layout, memory=list(cache.memory), options=options
            )
        self._clock_offset = time.time() - self._endpoint.clock()
        timelines = timeline_dir()
        if timelines is not None:
            path = timelines / f"{self._config.engine_id}-tp{self._model.tp_rank}.jsonl"
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

    def _streamed_layers(
        self, cache: CacheLayout, layers: Mapping[str, int], device: int | None
    ) -> dict[str, tuple[int, int]]:
        """Each layer's regions, when this worker streams layers (``layerwise`` on or auto).
        A GPU worker's layers wait for a CUDA event each: vLLM calls ``save_kv_layer`` when
        the layer's kernels are queued, not done."""
        if self._config.layerwise == "off" or not layers:
            return {}
        events = self._layer_events
        if events is None and device is not None:
            events = cuda_events
        self._gate = LayerGate(self._stream_layer, events)
        return {name: cache.layer_regions[index] for name, index in layers.items()}

    def apply(self, metadata: PushMetadata) -> None:
        """Acts on one step's instructions. Never raises: whatever the endpoint answers (a
        refusal, an unhealthy writer, a closed endpoint, an unexpected error), that request
        alone is reported finished (a receive also failed) so vLLM frees or recomputes it."""
        self._idle_step = metadata.idle
        if self._layer_regions:
            self._streams = (
                self._layer_streams(metadata.streams) if metadata.streams else NO_STREAMS
            )
        if not (metadata or self._busy_aborts or self._busy_cancels):
            return  # most steps: nothing to start or end
        for send in metadata.sends:
            self._ready(send)
        # Each with whether vLLM holds its blocks until reported (it streamed layers).
        aborts = [
            *self._busy_aborts,
            *((request, transfer, False) for request, transfer in metadata.aborts),
            *((request, transfer, True) for request, transfer in metadata.stream_aborts),
        ]
        self._busy_aborts = []
        for request_id, transfer_id, held in aborts:
            self._abort(request_id, transfer_id, held)
        for recv in metadata.recvs:
            self._expect(recv)
        for refused in metadata.refused:
            self._refused(refused)
        cancels, self._busy_cancels = [*self._busy_cancels, *metadata.cancels], []
        for request_id in cancels:
            self._cancel(request_id)
        if self._busy_aborts or self._busy_cancels:
            logger.warning(
                "kvpush: the endpoint's writer is behind; %d aborts and %d cancels wait for the "
                "next step",
                len(self._busy_aborts),
                len(self._busy_cancels),
            )

    def _layer_streams(self, streams: Sequence[SendRequest]) -> LayerStreams:
        """The step's streams, read into the native form once (each layer then hands them all
        over in one call); none if they cannot be read, their WRITEs carrying every layer."""
        tokens = self._layout.tokens_to_write
        try:
            return LayerStreams(
                [
                    Stream(
                        s.request_id,
                        s.blocks,
                        tokens(s.num_tokens),
                        s.transfer_id,
                        s.first_tokens or None,
                    )
                    for s in streams
                ]
            )
        except Exception:
            logger.exception(
                "kvpush: requests %s do not stream their layers (each WRITE carries them all)",
                [s.request_id for s in streams],
            )
            return NO_STREAMS

    def save_layer(self, layer_name: str) -> None:
        """P, layer-wise push: the forward pass ran ``layer_name`` (a GPU one queued its
        kernels): once its KV of the step's streams is final, the endpoint writes it where D
        registered (and nothing happens where D did not). Never raises, and never waits for
        the kernels or the transfer."""
        if self._streams is NO_STREAMS:
            return
        regions = self._layer_regions.get(layer_name)
        if regions is None:
            return
        try:
            self._gate.layer_done(self._streams, *regions)
        except Exception:
            # Nothing streamed: each request's WRITE carries this layer.
            logger.exception("kvpush: layer %s not streamed", layer_name)

    def _stream_layer(self, streams: LayerStreams, start: int, end: int) -> None:
        """Regions ``[start, end)`` of ``streams`` are final: the endpoint writes them."""
        try:
            self.endpoint.streams_ready(streams, start, end)
        except Exception as error:
            # Nothing streamed: each request's WRITE carries these regions.
            logger.debug(
                "kvpush: requests %s: regions %d..%d not streamed: %s",
                streams.request_ids,
                start,
                end,
                error,
            )

    def end_forward(self) -> None:
        """The step's forward is over: its streams end."""
        self._streams = NO_STREAMS

    def _ready(self, send: SendRequest) -> None:
        """P: the KV of a finished prefill may be written to D."""
        request_id = send.request_id
        if request_id in self._sending:
            logger.error("kvpush: request %s offered twice; the first offer stands", request_id)
            return
        self._gate.close_stream(request_id)  # no layer of it is handed over after the offer
        try:
            self.endpoint.ready(
                request_id,
                send.blocks,  # tuples: the endpoint reads them as it reads lists
                self._layout.tokens_to_write(send.num_tokens),
                transfer_id=send.transfer_id,
                first_tokens=send.first_tokens or None,
                ttl=self._config.ttl,
            )
        except Exception as error:
            # Refused before any WRITE was posted (D cancelled or gave up first, or the endpoint
            # cannot take work): nothing will be written, so the blocks are freed now.
            # D cancelling or giving up first (the rendezvous fenced it) is routine.
            routine = isinstance(error, RendezvousError)
            _log_failure(
                error,
                "kvpush: request %s not sent (its blocks are freed): %s",
                request_id,
                logging.INFO if routine else logging.WARNING,
            )
            self._finished_sending.add(request_id)
            return
        self._sending.add(request_id)
        self._decided[request_id] = send.decided_at

    def _abort(self, request_id: str, transfer_id: str | None, held: bool) -> None:
        """P: a prefill ended without KV to send; D is told if it registered. vLLM freed the
        blocks already, unless the prefill streamed layers (``held``): then they are reported
        free once no WRITE of them can be in flight, now or with the send's event."""
        self._gate.close_stream(request_id)
        outcome = None
        try:
            outcome = self.endpoint.abort(request_id, transfer_id)
        except BusyError:
            # Nothing was done: the writer is far behind. Tried again with the next step's.
            self._busy_aborts.append((request_id, transfer_id, held))
            return
        except Exception as error:
            _log_failure(
                error,
                "kvpush: request %s: D could not be told that P has no KV for it (%s); D fails "
                "or recomputes it when its receive times out",
                request_id,
            )
        if not held:
            return
        if outcome == kvpush.AbortOutcome.IN_FLIGHT:
            self._sending.add(request_id)  # a layer's WRITE: its event reports the blocks free
        else:
            self._finished_sending.add(request_id)

    def _expect(self, recv: RecvRequest) -> None:
        """D: register the blocks of a remote prefill with P."""
        request_id = recv.request_id
        blocks = [b for group in recv.blocks for b in group]
        if request_id in self._recv_blocks:
            logger.error("kvpush: request %s registered twice; the first stands", request_id)
            return
        try:
            cache = self._layout
            sources = sources_of(self._model, cache, recv.remote_tp_size)
            # P's workers listen on consecutive ports from its base (one stage: base + tp rank).
            self.endpoint.expect(
                request_id,
                [f"{recv.remote_host}:{recv.remote_port + rank}" for rank in sources.ranks],
                recv.blocks,
                cache.tokens_to_write(recv.num_tokens),
                transfer_id=recv.transfer_id,
                first_tokens=recv.first_tokens or [recv.first_token] * len(recv.blocks),
                ttl=self._config.receive_timeout,
                share=sources.share,
            )
        except Exception as error:
            # The endpoint checks before it sends anything to P: nothing was registered, so no
            # write can land in these blocks.
            self._fail_recv(request_id, blocks, _explain(error), error)
            return
        self._recv_blocks[request_id] = set(blocks)
        self._decided[request_id] = recv.decided_at

    def _refused(self, refused: RecvRefused) -> None:
        """D: a remote prefill the scheduler could not register (it logged why)."""
        if refused.request_id in self._recv_blocks:
            logger.error(
                "kvpush: request %s refused while registered; its receive stands",
                refused.request_id,
            )
            return
        self._fail_recv(refused.request_id, refused.blocks, refused.reason, logged=True)

    def _cancel(self, request_id: str) -> None:
        """D: a request aborted while waiting for its KV. Its receive is reported once the
        endpoint confirms P will not write (the event of the cancel)."""
        if request_id not in self._recv_blocks:
            return  # reported already (failed or done in the same step as the abort)
        try:
            self.endpoint.cancel(request_id)
        except BusyError:
            # Nothing was done: the writer is far behind. Tried again with the next step's.
            self._busy_cancels.append(request_id)
        except Exception as error:
            # No cancel reached P: its write may still land, so the blocks stay held until the
            # endpoint reports the receive over (P done, failed, or its write horizon passed).
            _log_failure(
                error,
                "kvpush: request %s: cancel not sent (%s); its blocks stay held until its "
                "receive ends",
                request_id,
            )

    def _fail_recv(
        self,
        request_id: str,
        blocks: Sequence[int],
        reason: str,
        error: BaseException | None = None,
        *,
        logged: bool = False,
    ) -> None:
        """Reports a receive finished and failed, once, with its blocks as load errors where
        vLLM takes them (one KV cache group: vLLM refuses block-level errors with several and
        goes by ``failed_recving`` alone)."""
        if not logged:
            logger.warning(
                "kvpush: KV for request %s not received: %s",
                request_id,
                reason,
                exc_info=error if _is_unexpected(error) else None,
            )
        self._decided.pop(request_id, None)
        self._finished_recving.add(request_id)
        self._failed_recving.add(request_id)
        groups = self._model.groups
        if groups is None or groups.total == 1:
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
            "role": str(event.role),
            "request_id": event.request_id,
            "key": event.key,
            "outcome": str(event.outcome),
            "reason": event.reason,
            "bytes": event.bytes,
            "runs": event.runs,
            "streamed_bytes": event.streamed_bytes,
            "rewritten_bytes": event.rewritten_bytes,
            "wall": wall,
        }
        self._timeline.write(json.dumps(line) + "\n")
        self._timeline.flush()

    def poll(self, wait: float = 0.0) -> None:
        """Collects the endpoint's events into the sets vLLM asks for, waiting up to ``wait``
        seconds for the first one. Only requests this worker tracks are reported, each once:
        vLLM knows no other (its scheduler asserts it does)."""
        endpoint = self._endpoint  # closed too: its last events (what it failed) still count
        if endpoint is None:
            return
        try:
            events = endpoint.wait(wait) if wait > 0 else endpoint.poll()
        except Exception as error:
            logger.error(
                "kvpush: transfer events not collected this step: %s",
                _explain(error),
                exc_info=error if _is_unexpected(error) else None,
            )
            return
        for event in events:
            quarantined = event.outcome == kvpush.Outcome.QUARANTINED
            # A quarantine notice is not the request's end: its final event keeps the decision.
            decided = (
                self._decided.get(event.request_id)
                if quarantined
                else self._decided.pop(event.request_id, None)
            )
            try:
                self._record(event, decided, self._clock_offset)
                _stats.observe(self._stats, event, decided, self._clock_offset)
            except Exception:
                # A timeline or statistic lost, never the event: vLLM waits for its report.
                logger.exception("kvpush: event of %s not recorded", event.request_id)
            self._report(event)

    def _report(self, event: kvpush.TransferEvent) -> None:
        request_id = event.request_id
        if event.outcome == kvpush.Outcome.QUARANTINED:
            # A notice, not the end: a WRITE may still be moving bytes (P stalled, a link cut, a
            # peer that never confirmed), so the request is not reported finished and vLLM keeps
            # its blocks allocated (a receive's even if the request is aborted). Its final event
            # follows once the transport or P settles it, or never: alert on these. Logged for a
            # request not offered yet too (a layer's WRITE, streamed during its prefill).
            logger.error(
                "kvpush: %s of %s quarantined, its KV blocks stay held until it settles: %s",
                event.role,
                request_id,
                event.reason,
            )
            return
        tracked = request_id in (
            self._sending if event.role == kvpush.Role.SEND else self._recv_blocks
        )
        if not tracked:
            logger.warning(
                "kvpush: %s event (%s) for request %s, which this worker does not track; ignored",
                event.role,
                event.outcome,
                request_id,
            )
            return
        if event.role == kvpush.Role.SEND:
            if event.outcome == kvpush.Outcome.FAILED:
                logger.warning("kvpush: send of %s failed: %s", request_id, event.reason)
            self._sending.discard(request_id)
            self._finished_sending.add(request_id)
            return
        blocks = self._recv_blocks.pop(request_id)
        if event.outcome == kvpush.Outcome.DONE:
            self._finished_recving.add(request_id)
        else:
            self._fail_recv(request_id, sorted(blocks), event.reason or str(event.outcome))

    def take_finished(self) -> tuple[set[str], set[str], set[str]]:
        """Sends finished, receives finished (failed ones included), receives failed.

        In a step that computes nothing while transfers are outstanding, waits up to the
        configured ``idle_wait_ms`` (:attr:`WorkerConfig.idle_wait`; by default none with one
        worker, 2 ms with several) for the next of them to end, the first event ending it.
        """
        wait = self._config.idle_wait
        outstanding = bool(self._sending or self._recv_blocks)
        idle = wait > 0 and self._idle_step and outstanding and not self._has_finished()
        self._idle_step = False
        self.poll(wait if idle else 0.0)
        out = (self._finished_sending, self._finished_recving, self._failed_recving)
        self._finished_sending, self._finished_recving, self._failed_recving = set(), set(), set()
        return out

    def _has_finished(self) -> bool:
        return bool(self._finished_sending or self._finished_recving)

    def take_stats(self) -> dict[str, object] | None:
        """Statistics of the transfers :meth:`take_finished` collected since the last call (None
        when none). vLLM asks for them right after the step's results: a transfer that ends
        in between is counted with the next step's, not collected a second time here."""
        if _stats.is_empty(self._stats):
            return None
        stats, self._stats = self._stats, _stats.empty()
        return stats

    def take_load_errors(self) -> set[int]:
        """Block ids of failed receives (reported no later than the receive's finish)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        """Closes the endpoint (failing what is pending) and the timeline; never raises."""
        self._closed = True
        try:
            self._gate.close()  # the layers it holds go first
        except Exception:
            logger.exception("kvpush: stopping the layer waiter failed")
        try:
            if self._endpoint is not None:
                stuck = self._endpoint.close()
                if stuck is not None:
                    logger.error("kvpush: closing the endpoint: %s", stuck)
        except Exception:
            logger.exception("kvpush: closing the endpoint failed")
        try:
            if self._timeline is not None:
                self._timeline.close()
        except OSError:
            logger.exception("kvpush: closing the timeline failed")


def _explain(error: BaseException) -> str:
    """What an endpoint's refusal (or an unexpected error) means, for the request's log line."""
    detail = str(error)
    if len(detail) > 500:
        detail = detail[:497] + "..."
    if isinstance(error, UnhealthyError):
        return f"the endpoint stopped taking work ({detail}); restart this server"
    if isinstance(error, TransportError) and getattr(error, "code", None) == "closed":
        return f"the endpoint is closed ({detail}): the server is shutting down"
    if isinstance(error, KvPushError):
        return f"{getattr(error, 'code', None) or type(error).__name__}: {detail}"
    return f"unexpected {type(error).__name__}: {detail}; please report this (traceback follows)"


def _is_unexpected(error: BaseException | None) -> bool:
    """An error kvpush did not raise on purpose: logged with its traceback."""
    return error is not None and not isinstance(error, KvPushError)


def _log_failure(
    error: BaseException, message: str, request_id: str, level: int = logging.WARNING
) -> None:
    """``message`` (``%s`` for the request id, then one for what went wrong) at ``level``; an
    unexpected error with its traceback."""
    logger.log(
        level,
        message,
        request_id,
        _explain(error),
        exc_info=error if _is_unexpected(error) else None,
    )
