"""Layer-wise push on P: a layer's KV goes to the endpoint once it is final, never holding up
the forward pass.

A CPU forward is synchronous: when vLLM calls ``save_kv_layer`` the layer's KV is written, so
it goes at once. A GPU forward has only queued the layer's kernels by then: the gate records a
CUDA event on the current stream (no host synchronisation on the forward path) and a waiter
thread waits on it, then hands the layer to the endpoint. A layer still waiting when its
request's whole KV is offered (or its prefill aborted) is dropped, never handed over after:
the request's WRITE carries it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvpush._native import LayerStreams

logger = logging.getLogger("vllm.kvpush")

#: How long :meth:`LayerGate.close` waits for the waiter to finish the layers it holds.
CLOSE_WAIT_S = 5.0

# The records below are read-only by convention, not frozen: a frozen dataclass assigns each
# field through ``object.__setattr__``, about 1 µs more per record, one per layer of a GPU forward.


@dataclass(slots=True)
class Stream:
    """A prefill that ends in this step's forward, as ``Endpoint.layers_ready`` takes it (the
    worker reads the step's into one :class:`LayerStreams`)."""

    request_id: str
    blocks: Sequence[Sequence[int]]
    num_tokens: int
    transfer_id: str | None
    first_tokens: Sequence[int] | None


class Event(Protocol):
    """What the gate needs of a CUDA event (``torch.cuda.Event``)."""

    def record(self) -> None:
        """Marks the current stream's work queued so far."""

    def synchronize(self) -> None:
        """Returns once that work completed (without the GIL)."""


#: Hands the layer whose regions are ``[start, end)`` of ``streams`` to the endpoint; never
#: raises.
Write = Callable[[LayerStreams, int, int], None]


@dataclass(slots=True)
class _Pending:
    seq: int
    event: Event
    streams: LayerStreams
    start: int
    end: int


def cuda_events() -> Event:
    """A CUDA event whose ``synchronize`` sleeps rather than spins (the waiter shares the
    host's cores with the engine)."""
    import torch

    return torch.cuda.Event(blocking=True)  # type: ignore[no-any-return]


class LayerGate:
    """Hands each layer to ``write`` once its KV is final: at once without ``events``, else
    from a waiter thread once an event recorded on the layer's stream completed."""

    def __init__(self, write: Write, events: Callable[[], Event] | None = None) -> None:
        self._write = write
        self._events = events
        self._pending: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        #: Guards the counters and ``_closed``, and is held while a layer is handed over, so
        #: that a request closed by the engine thread is never handed over after.
        self._lock = threading.Lock()
        self._queued = 0
        self._handled = 0
        #: Requests whose layers may no longer go: each to the last layer queued when it
        #: closed (the waiter forgets it once past that one).
        self._closed: dict[str, int] = {}
        self._waiter: threading.Thread | None = None
        self._stopped = False

    @property
    def deferred(self) -> bool:
        """Whether layers wait for an event (a GPU forward)."""
        return self._events is not None

    def layer_done(self, streams: LayerStreams, start: int, end: int) -> None:
        """The forward pass queued (GPU) or ran (CPU) the layer of ``streams`` whose regions are
        ``[start, end)``. Returns without waiting for its kernels or its transfer."""
        if self._events is None:
            self._write(streams, start, end)
            return
        if self._stopped:
            return
        event = self._events()
        event.record()
        with self._lock:
            self._queued += 1
            item = _Pending(self._queued, event, streams, start, end)
        self._pending.put(item)
        if self._waiter is None:
            self._waiter = threading.Thread(target=self._wait, name="kvpush-layers", daemon=True)
            self._waiter.start()

    def close_stream(self, request_id: str) -> None:
        """``request_id``'s whole KV is about to be offered, or its prefill ended without KV: a
        layer of it still waiting is dropped. Call before offering it."""
        if self._events is None:
            return
        with self._lock:
            if self._handled < self._queued:
                self._closed[request_id] = self._queued

    def _wait(self) -> None:
        while (item := self._pending.get()) is not None:
            try:
                item.event.synchronize()
                ready = True
            except Exception:
                # Nothing streamed: each request's WRITE carries the layer.
                logger.exception("kvpush: a layer's CUDA event failed; its KV goes whole")
                ready = False
            with self._lock:
                streams = item.streams
                if self._closed:
                    streams = streams.without(set(self._closed))
                if ready and len(streams):
                    self._write(streams, item.start, item.end)
                self._handled = item.seq
                self._closed = {r: last for r, last in self._closed.items() if last > item.seq}

    def close(self) -> None:
        """Stops the waiter after the layers it holds (their events complete unless the GPU
        hangs: then it is left behind after :data:`CLOSE_WAIT_S`)."""
        self._stopped = True
        waiter, self._waiter = self._waiter, None
        if waiter is None:
            return
        self._pending.put(None)
        waiter.join(CLOSE_WAIT_S)
        if waiter.is_alive():
            logger.error(
                "kvpush: layers still wait for their CUDA events after %.0f s; left behind",
                CLOSE_WAIT_S,
            )
