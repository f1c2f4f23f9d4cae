"""The layer gate (layer-wise push on P): a layer goes once its event completed, off the
forward's thread, in forward order, and never after its request's whole KV was offered."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvpush._native import LayerStreams
from kvpush.vllm._layers import LayerGate, Stream
from tests.support.layers import Events, Pending


class Written:
    def __init__(self) -> None:
        self.layers: list[tuple[list[str], int, int]] = []
        self.changed = threading.Condition()

    def __call__(self, streams: LayerStreams, start: int, end: int) -> None:
        with self.changed:
            self.layers.append((streams.request_ids, start, end))
            self.changed.notify_all()

    def wait_for(self, count: int) -> list[tuple[list[str], int, int]]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.layers) >= count, 10.0), self.layers
            return list(self.layers)


@contextmanager
def deferred_gate() -> Iterator[tuple[LayerGate, Events, Written]]:
    """A gate whose layers wait for events the test completes; closed after the test."""
    events, written = Events(), Written()
    gate = LayerGate(written, events)
    try:
        yield gate, events, written
    finally:
        gate.close()


def streams(*request_ids: str) -> LayerStreams:
    return LayerStreams([Stream(r, [[1, 2]], 32, None, None) for r in request_ids])


def test_without_events_a_layer_goes_at_once() -> None:
    written = Written()
    gate = LayerGate(written)
    gate.layer_done(streams("a"), 0, 2)
    assert written.layers == [(["a"], 0, 2)]
    assert not gate.deferred
    gate.close()


def test_a_layer_waits_for_its_event_and_the_forward_does_not() -> None:
    with deferred_gate() as (gate, events, written):
        for layer in range(3):
            gate.layer_done(streams("a", "b"), 2 * layer, 2 * layer + 2)
        assert [e.recorded for e in events] == [True] * 3
        time.sleep(0.05)
        assert written.layers == [], "no layer goes before its kernels completed"
        events[1].done.set()
        time.sleep(0.05)
        assert written.layers == [], "a later layer waits for the earlier ones (forward order)"
        events[0].done.set()
        assert written.wait_for(2) == [(["a", "b"], 0, 2), (["a", "b"], 2, 4)]
        events[2].done.set()
        assert written.wait_for(3)[2] == (["a", "b"], 4, 6)


def test_a_layer_waiting_when_its_request_is_offered_whole_is_dropped() -> None:
    with deferred_gate() as (gate, events, written):
        gate.layer_done(streams("a", "b"), 0, 2)
        gate.layer_done(streams("a", "b"), 2, 4)
        gate.close_stream("a")  # a's whole KV is offered: its layers must not follow
        events[0].done.set()
        events[1].done.set()
        assert written.wait_for(2) == [(["b"], 0, 2), (["b"], 2, 4)]
        # Once the waiter is past every layer queued before the close, the request is
        # forgotten: a later prefill of the same id (a recomputed request) streams again.
        gate.layer_done(streams("a"), 0, 2)
        events[2].done.set()
        assert written.wait_for(3)[2] == (["a"], 0, 2)


def test_an_event_that_fails_drops_its_layer_and_the_waiter_goes_on() -> None:
    class Broken(Pending):
        def synchronize(self) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    second = Pending()
    made = iter([Broken(), second])
    written = Written()
    gate = LayerGate(written, lambda: next(made))
    try:
        gate.layer_done(streams("a"), 0, 2)
        gate.layer_done(streams("a"), 2, 4)
        second.done.set()
        assert written.wait_for(1) == [(["a"], 2, 4)]
    finally:
        gate.close()


def test_close_hands_over_what_the_waiter_holds_then_takes_nothing() -> None:
    event = Pending()
    written = Written()
    gate = LayerGate(written, lambda: event)
    gate.layer_done(streams("a"), 0, 2)
    event.done.set()
    gate.close()
    assert written.layers == [(["a"], 0, 2)]
    gate.layer_done(streams("a"), 2, 4)
    assert written.layers == [(["a"], 0, 2)], "a closed gate takes no layer"
