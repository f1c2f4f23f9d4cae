"""The rendezvous table through the binding: matching, epochs, cancels, expiry, errors."""

from __future__ import annotations

import threading

import pytest

import kvpush
from kvpush._native import lab
from kvpush.exceptions import (
    DuplicateReadyError,
    FencedError,
    NotMatchedError,
    RendezvousError,
    StaleEpochError,
    TableFullError,
)

TTL = 30.0


@pytest.mark.parametrize("registration_first", [True, False])
def test_second_arrival_matches_in_either_order(registration_first: bool) -> None:
    table = lab.RendezvousTable()
    reg = {"blocks": [1, 2]}
    ready = [7, 8, 9]

    def register() -> lab.Arrival:
        return table.register("cmpl-abc-0-11111111", 1, reg, ttl=TTL)

    def make_ready() -> lab.Arrival:
        return table.ready("cmpl-abc-0-22222222", ready, ttl=TTL)

    first, second = (register, make_ready) if registration_first else (make_ready, register)
    assert not first().matched
    arrival = second()
    assert arrival.matched
    assert arrival.key == "abc-0"
    assert arrival.epoch == 1
    assert arrival.registration is reg
    assert arrival.ready is ready


def test_transfer_id_is_the_key_when_given() -> None:
    table = lab.RendezvousTable()
    table.ready("p-side-id", "kv", ttl=TTL, transfer_id="xfer-9")
    arrival = table.register("d-side-id", 1, "reg", ttl=TTL, transfer_id="xfer-9")
    assert arrival.matched
    assert arrival.key == "xfer-9"


def test_write_lifecycle_leaves_a_fence_that_refuses_late_halves() -> None:
    table = lab.RendezvousTable()
    table.ready("req-1", "kv", ttl=TTL)
    arrival = table.register("req-1", 1, "reg", ttl=TTL)
    table.begin_write(arrival.key, 1)
    finished = table.finish(arrival.key, 1)
    assert finished.outcome == "done"
    assert not finished.cancel_acknowledged
    assert len(table) == 0
    assert table.fences == 1
    with pytest.raises(FencedError, match="already delivered") as caught:
        table.register("req-1", 2, "late", ttl=TTL)
    assert caught.value.code == "fenced"
    assert caught.value.key == "req-1"  # type: ignore[attr-defined]


def test_stale_epoch_is_refused_and_higher_epoch_supersedes() -> None:
    table = lab.RendezvousTable()
    table.register("req-2", 2, "reg@2", ttl=TTL)
    with pytest.raises(StaleEpochError, match="epoch 2 is current") as caught:
        table.register("req-2", 2, "again", ttl=TTL)
    assert isinstance(caught.value, RendezvousError)
    newer = table.register("req-2", 3, "reg@3", ttl=TTL)
    assert newer.superseded == "reg@2"
    arrival = table.ready("req-2", "kv", ttl=TTL)
    assert arrival.registration == "reg@3"


def test_cancel_during_write_is_deferred_until_finish() -> None:
    table = lab.RendezvousTable()
    table.ready("req-3", "kv", ttl=TTL)
    arrival = table.register("req-3", 1, "reg", ttl=TTL)
    table.begin_write(arrival.key, 1)
    assert table.cancel(arrival.key).status == "deferred"
    finished = table.finish(arrival.key, 1, error="nixl write failed")
    assert finished.outcome == "failed"
    assert finished.cancel_acknowledged


def test_cancel_before_any_write_returns_the_halves() -> None:
    table = lab.RendezvousTable()
    table.ready("req-4", ["p-blocks"], ttl=TTL)
    cancellation = table.cancel(kvpush.transfer_key("req-4"))
    assert cancellation.status == "removed"
    assert cancellation.ready == ["p-blocks"]
    assert table.cancel("never-seen").status == "not_found"
    with pytest.raises(FencedError, match="cancelled"):
        table.register("never-seen", 1, "reg", ttl=TTL)


def test_superseded_match_cannot_be_written() -> None:
    table = lab.RendezvousTable()
    table.ready("req-5", "kv", ttl=TTL)
    old = table.register("req-5", 1, "old", ttl=TTL)
    new = table.register("req-5", 2, "new", ttl=TTL)
    assert old.matched
    assert new.matched
    assert new.ready == "kv"
    with pytest.raises(NotMatchedError):
        table.begin_write(old.key, 1)
    table.begin_write(new.key, 2)


def test_duplicate_ready_is_refused() -> None:
    table = lab.RendezvousTable()
    table.ready("req-6", "kv", ttl=TTL)
    with pytest.raises(DuplicateReadyError):
        table.ready("req-6", "kv", ttl=TTL)


def test_expiry_reports_what_was_waiting_and_empties_the_table() -> None:
    table = lab.RendezvousTable(fence_ttl=5.0)
    table.register("req-7", 4, {"d": 1}, ttl=10.0, now=0.0)
    table.ready("req-8", "kv", ttl=20.0, now=0.0)
    assert table.expire(now=9.9) == []
    expired = table.expire(now=10.0)
    assert [(e.key, e.epoch, e.registration, e.was_matched) for e in expired] == [
        ("req-7", 4, {"d": 1}, False)
    ]
    later = table.expire(now=100.0)
    assert [(e.key, e.ready) for e in later] == [("req-8", "kv")]
    assert len(table) == 0
    assert table.fences == 0


def test_table_full_is_backpressure_not_a_crash() -> None:
    table = lab.RendezvousTable(shards=1, max_entries=2)
    table.register("a", 1, "r", ttl=TTL)
    table.register("b", 1, "r", ttl=TTL)
    with pytest.raises(TableFullError, match="full"):
        table.register("c", 1, "r", ttl=TTL)


def test_bad_arguments_are_value_errors() -> None:
    with pytest.raises(ValueError, match="power of two"):
        lab.RendezvousTable(shards=3)
    table = lab.RendezvousTable()
    with pytest.raises(ValueError, match="ttl"):
        table.register("x", 1, "r", ttl=-1.0)
    with pytest.raises(ValueError, match="now"):
        table.ready("x", "r", ttl=1.0, now=float("nan"))


def test_threads_racing_halves_match_each_key_exactly_once() -> None:
    table = lab.RendezvousTable()
    keys = [f"race-{i}" for i in range(2000)]
    matches: list[int] = [0, 0]
    start = threading.Barrier(2)

    def side(index: int) -> None:
        start.wait()
        for key in keys:
            if index == 0:
                arrival = table.register(key, 1, key, ttl=TTL)
            else:
                arrival = table.ready(key, key, ttl=TTL)
            matches[index] += arrival.matched

    threads = [threading.Thread(target=side, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(matches) == len(keys)
