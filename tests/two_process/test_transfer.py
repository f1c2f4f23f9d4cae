"""Push transfers end to end: a P worker and a D worker with paged KV caches in numpy.

Each test runs on three data paths: the in-process loopback transport (both workers in this
process), and NIXL between two processes over UCX on loopback, once with UCX's default
transports (cma for the WRITE: completes at post) and once with ``UCX_TLS=tcp`` (completes
asynchronously, so the writer's polling and deferred notifications are exercised). D checks its
whole cache byte for byte against an independent per-token copy: every token where D expects
it, and nothing else touched.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import kvpush
from kvpush_lab.cache import CacheShape, Request
from kvpush_lab.peer import RemoteWorker, Worker
from tests.support.nixl import nixl_or_skip
from tests.support.pair import (
    D_SHAPE,
    P_SEED,
    P_SHAPE,
    TRANSPORTS,
    UCX_LOOPBACK,
    Pair,
    make_requests,
)


@pytest.fixture(params=list(TRANSPORTS))
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    pair = Pair(request.param, b"shared-secret-of-the-test-pair", b"shared-secret-of-the-test-pair")
    try:
        yield pair
    finally:
        pair.close()


def wait_until_registered(pair: Pair, count: int = 1) -> None:
    """Until ``count`` of D's registrations sit in P's rendezvous table (bounded)."""
    deadline = time.monotonic() + 10.0
    while pair.p.pending() < count:
        assert time.monotonic() < deadline, "D's registration never reached P"
        time.sleep(0.02)


def by_request(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {e["request_id"]: e for e in events}


def test_both_arrival_orders_deliver_every_byte(pair: Pair) -> None:
    rng = random.Random(1)
    reg_first, kv_first = make_requests(rng, 4, "r")[:2], make_requests(rng, 4, "k")[2:]
    pair.d.expect(pair.source, reg_first)
    wait_until_registered(pair, len(reg_first))  # D's halves are in P's table first
    assert pair.p.ready(reg_first + kv_first) == []  # then P's; kv_first's wait for D
    pair.d.expect(pair.source, kv_first)

    received = by_request(pair.d.events(4, timeout=20.0))
    sent = by_request(pair.p.events(4, timeout=20.0))
    for r in reg_first + kv_first:
        assert received[r.request_id]["outcome"] == "done", received[r.request_id]
        assert sent[r.request_id]["outcome"] == "done", sent[r.request_id]
        assert sent[r.request_id]["bytes"] == 2 * P_SHAPE.layers * r.tokens * P_SHAPE.token_bytes
        assert received[r.request_id]["bytes"] == sent[r.request_id]["bytes"]
        timeline = sent[r.request_id]["timeline"]
        assert timeline["matched"] <= timeline["posted"] <= timeline["completed"]
    pair.verify(reg_first + kv_first)


@pytest.mark.parametrize("transport", ["nixl", "nixl-tcp"])
def test_whole_blocks_of_matching_layouts_land_byte_for_byte(transport: str) -> None:
    """P and D with one layout, requests of whole blocks: the WRITEs a NIXL transport builds
    from prepared descriptor lists (block indices), next to one with a partial last block."""
    pair = Pair(transport, None, None, d_shape=P_SHAPE)
    try:
        rng = random.Random(11)
        requests = make_requests(rng, 8, "w", d_shape=P_SHAPE, whole_blocks=True)
        assert all(r.tokens % P_SHAPE.block_tokens == 0 for r in requests)
        # And one whose last block is partial, on blocks of its own.
        used_p = {b for r in requests for b in r.p_blocks}
        used_d = {b for r in requests for b in r.d_blocks}
        free_p = [b for b in range(P_SHAPE.num_blocks) if b not in used_p]
        free_d = [b for b in range(P_SHAPE.num_blocks) if b not in used_d]
        last = Request(
            "cmpl-partial-0", 3 * P_SHAPE.block_tokens + 5, tuple(free_p[:4]), tuple(free_d[:4])
        )
        everything = [*requests, last]
        pair.d.expect(pair.source, everything)
        wait_until_registered(pair, len(everything))
        assert pair.p.ready(everything) == []
        received = by_request(pair.d.events(len(everything), timeout=30.0))
        assert {e["outcome"] for e in received.values()} == {"done"}, received
        sent = by_request(pair.p.events(len(everything), timeout=30.0))
        for r in everything:
            assert (
                sent[r.request_id]["bytes"] == 2 * P_SHAPE.layers * r.tokens * P_SHAPE.token_bytes
            )
        pair.verify(everything)
    finally:
        pair.close()


def test_many_concurrent_fragmented_requests(pair: Pair) -> None:
    rng = random.Random(2)
    requests = make_requests(rng, 24, "c")
    halves = [("d", r) for r in requests] + [("p", r) for r in requests]
    rng.shuffle(halves)
    for side, r in halves:
        if side == "d":
            pair.d.expect(pair.source, [r])
        else:
            assert pair.p.ready([r]) == []
    received = by_request(pair.d.events(len(requests), timeout=30.0))
    assert sorted(received) == sorted(r.request_id for r in requests)
    assert {e["outcome"] for e in received.values()} == {"done"}
    pair.verify(requests)


def test_prefix_hit_on_d_writes_only_the_uncached_suffix(pair: Pair) -> None:
    requests = make_requests(random.Random(3), 6, "x", cached_blocks=1)
    assert pair.p.ready(requests) == []
    pair.d.expect(pair.source, requests)
    received = pair.d.events(len(requests), timeout=20.0)
    assert [e["outcome"] for e in received] == ["done"] * len(requests)
    pair.verify(requests)


def test_p_abort_fails_d_at_once_and_writes_nothing(pair: Pair) -> None:
    (request,) = make_requests(random.Random(4), 1, "a")
    pair.d.expect(pair.source, [request])
    wait_until_registered(pair)
    assert pair.p.abort(request) == "released"
    (event,) = pair.d.events(1, timeout=5.0)
    assert event["outcome"] == "failed"
    assert "aborted" in event["reason"]
    assert pair.p.ready([request])[0].startswith("fenced")
    pair.verify([])


def test_d_cancel_is_confirmed_before_d_reuses_the_blocks(pair: Pair) -> None:
    (request,) = make_requests(random.Random(5), 1, "n")
    pair.d.expect(pair.source, [request])
    wait_until_registered(pair)
    pair.d.cancel(request.request_id)
    (event,) = pair.d.events(1, timeout=5.0)
    assert event["outcome"] == "cancelled"
    refused = pair.p.ready([request])
    assert refused, "P's late KV must be refused: D cancelled the transfer"
    assert "cancelled" in refused[0]
    pair.verify([])


def test_registration_naming_blocks_d_does_not_have_is_refused(pair: Pair) -> None:
    (good,) = make_requests(random.Random(6), 1, "b")
    beyond = tuple(10_000 + i for i in range(len(good.d_blocks)))
    bad = Request(good.request_id, good.tokens, good.p_blocks, beyond, transfer_id=good.transfer_id)
    assert pair.p.ready([bad]) == []
    pair.d.expect(pair.source, [bad])
    (received,) = pair.d.events(1, timeout=10.0)
    assert received["outcome"] == "failed"
    assert "names block 10000" in received["reason"]
    (sent,) = pair.p.events(1, timeout=10.0)
    assert sent["outcome"] == "failed"
    pair.verify([])


def test_d_deadline_cancels_with_p_and_reports_failure(pair: Pair) -> None:
    (request,) = make_requests(random.Random(7), 1, "t")
    pair.d.expect(pair.source, [request], 0.3)
    (event,) = pair.d.events(1, timeout=10.0)
    assert event["outcome"] == "failed"
    # Either side may notice the deadline first: D (and cancels with P) or P (and fails D).
    assert "no KV" in event["reason"] or "not ready in time" in event["reason"], event
    assert pair.p.ready([request]), "P's KV after D gave up must be refused"


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_peer_with_another_secret_is_refused(transport: str) -> None:
    pair = Pair(transport, b"prefill-secret-0123456789", b"decode-secret-9876543210")
    try:
        (request,) = make_requests(random.Random(8), 1, "s")
        pair.d.expect(pair.source, [request])
        (event,) = pair.d.events(1, timeout=10.0)
        assert event["outcome"] == "failed"
        assert "cannot reach P" in event["reason"]
        pair.verify([])
    finally:
        pair.close()


@pytest.mark.parametrize("transport", ["nixl", "nixl-tcp"])
def test_p_process_death_fails_d_once_p_write_horizon_passed(transport: str) -> None:
    """A lost P is not known to have stopped: D hands its blocks back only once P's advertised
    write horizon (lease + write timeout + margin) has passed since the connection closed."""
    pair = Pair(transport, None, None, options={"write_timeout": 1.0})
    try:
        horizon = 2.0 + 1.0 + 1.0  # peer_timeout + write_timeout + margin
        (request,) = make_requests(random.Random(9), 1, "k")
        pair.d.expect(pair.source, [request])
        wait_until_registered(pair)
        pair.p.kill()
        started = time.monotonic()
        (event,) = pair.d.events(1, timeout=horizon + 10.0)
        waited = time.monotonic() - started
        assert event["outcome"] == "failed"
        assert "lost P" in event["reason"]
        assert "write horizon" in event["reason"]
        assert waited >= horizon - 0.5, f"D gave up after {waited:.1f}s, inside P's horizon"
        pair.verify([])
    finally:
        pair.close()


def test_a_second_d_process_declaring_the_first_ones_agent_name_is_refused() -> None:
    """Two D processes declare one NIXL agent name (their agent metadata differ). P must refuse
    the second at the handshake, naming the collision: sharing the first D's agent by name would
    write the second D's transfers into the first D's memory."""
    nixl_or_skip()
    secret = b"shared-secret-of-the-test-pair"

    def worker(role: str, shape: CacheShape, seed: int | None, **options: Any) -> RemoteWorker:
        return RemoteWorker(UCX_LOOPBACK, role=role, shape=shape, seed=seed, transport="nixl",
                            secret=secret, options=options)  # fmt: skip

    p = worker("p", P_SHAPE, P_SEED)
    first = worker("d", D_SHAPE, None, agent_name="d-one-name")
    second = worker("d", D_SHAPE, None, agent_name="d-one-name")
    try:
        mine, theirs = make_requests(random.Random(40), 2, "name")
        first.expect(p.address(), [mine])
        deadline = time.monotonic() + 10.0
        while p.pending() < 1:
            assert time.monotonic() < deadline, "the first D's registration never reached P"
            time.sleep(0.02)
        second.expect(p.address(), [theirs])
        (refused,) = second.events(1, timeout=10.0)
        assert refused["outcome"] == "failed"
        assert '"d-one-name"' in refused["reason"]
        assert "another agent" in refused["reason"]
        assert p.ready([mine, theirs]) == []
        (received,) = first.events(1, timeout=20.0)
        assert received["outcome"] == "done", received
        for d, delivered in ((first, [mine]), (second, [])):
            result = d.verify(P_SHAPE, P_SEED, delivered)
            assert result["wrong"] == 0, f"{result['wrong']} bytes of a D are wrong"
    finally:
        second.close()
        first.close()
        p.close()


def test_endpoint_binds_a_host_name() -> None:
    worker = Worker("p", P_SHAPE, P_SEED, "loopback")
    try:
        with kvpush.Endpoint(
            "named-host",
            worker.cache.layout(),
            memory=worker.cache.memory(),
            transport="loopback",
            agent_name="named-host-agent",
            bind="localhost:0",
        ) as endpoint:
            assert endpoint.address.startswith(("127.0.0.1:", "[::1]:"))
        with pytest.raises(ValueError, match="resolvable host:port"):
            kvpush.Endpoint(
                "bad-host",
                worker.cache.layout(),
                memory=worker.cache.memory(),
                transport="loopback",
                bind="no-such-host.invalid:0",
            )
    finally:
        worker.close()


def test_a_side_channel_beyond_loopback_needs_a_secret_or_an_explicit_opt_out() -> None:
    worker = Worker("p", P_SHAPE, P_SEED, "loopback")
    try:
        common: dict[str, Any] = {
            "memory": worker.cache.memory(),
            "transport": "loopback",
            "bind": "0.0.0.0:0",
        }
        with pytest.raises(kvpush.exceptions.ConfigError, match="KVPUSH_SECRET"):
            kvpush.Endpoint("open", worker.cache.layout(), agent_name="open-0", **common)
        with kvpush.Endpoint(
            "signed", worker.cache.layout(), agent_name="signed-0", secret=b"x" * 32, **common
        ) as signed:
            assert signed.health() is None
        with kvpush.Endpoint(
            "opted-out", worker.cache.layout(), agent_name="opted-0", insecure=True, **common
        ) as opted_out:
            assert opted_out.address.startswith("0.0.0.0:")
    finally:
        worker.close()


def test_an_absurd_ttl_is_refused_and_the_endpoint_stays_healthy() -> None:
    """A TTL from a bad config (~1e19 s) once overflowed the writer's clock and killed it."""
    pair = Pair("loopback", None, None)
    try:
        (request,) = make_requests(random.Random(30), 1, "ttl")
        with pytest.raises(kvpush.exceptions.ConfigError, match="ttl"):
            pair.p.endpoint.ready(request.request_id, [list(request.p_blocks)], request.tokens,
                                  ttl=1e19)  # fmt: skip
        with pytest.raises(kvpush.exceptions.ConfigError, match="ttl"):
            pair.d.endpoint.expect(request.request_id, pair.source, [list(request.d_blocks)],
                                   request.tokens, ttl=1e19)  # fmt: skip
        assert pair.p.endpoint.health() is None
        assert pair.d.endpoint.health() is None
        pair.d.expect(pair.source, [request])
        assert pair.p.ready([request]) == []
        (event,) = pair.d.events(1, timeout=10.0)
        assert event["outcome"] == "done"
        pair.verify([request])
    finally:
        pair.close()


def test_poll_does_not_wait_for_another_threads_wait() -> None:
    """A thread in ``wait(5.0)`` holds the endpoint's events, GIL released, for up to 5 s. A
    ``poll()`` in another thread holds the GIL: it once waited for that lock, stalling every
    Python thread until the wait ended. It must return at once; an event arriving meanwhile
    goes to the waiter."""
    pair = Pair("loopback", None, None)
    endpoint = pair.p.endpoint
    waited: list[kvpush.TransferEvent] = []
    waiting = threading.Event()

    def waiter() -> None:
        waiting.set()
        waited.extend(endpoint.wait(5.0))

    thread = threading.Thread(target=waiter, name="kvpush-test-waiter")
    try:
        thread.start()
        waiting.wait()
        for _ in range(50):
            assert endpoint.poll() == []
            time.sleep(0.01)  # lets the waiter run (and, had a poll waited, finish)
        assert thread.is_alive(), "poll() waited for the other thread's wait() to end"
        # P's KV, never registered, expires at once: its event ends the waiter's wait.
        (request,) = make_requests(random.Random(31), 1, "poll")
        endpoint.ready(request.request_id, [list(request.p_blocks)], request.tokens, ttl=0.05)
        thread.join(10.0)
        assert [(e.request_id, e.outcome) for e in waited] == [
            (request.request_id, kvpush.Outcome.CANCELLED)
        ]
    finally:
        thread.join(10.0)
        pair.close()


def test_a_registration_over_the_hosts_byte_budget_is_refused_with_the_budget() -> None:
    pair = Pair("loopback", None, None, options={"max_registration_bytes_per_host": 100})
    try:
        (request,) = make_requests(random.Random(32), 1, "bytes")
        pair.d.expect(pair.source, [request])
        (event,) = pair.d.events(1, timeout=10.0)
        assert (event["outcome"], event["code"]) == ("failed", "refused"), event
        assert "max_registration_bytes_per_host" in event["reason"], event
        assert pair.p.stats()["refused_registrations"] == 1
        assert pair.p.stats()["overloaded"] == 0
        with pytest.raises(kvpush.exceptions.ConfigError, match="inbox_capacity"):
            kvpush.Endpoint("p", pair.p.cache.layout(), memory=[], transport="loopback",
                            inbox_capacity=0)  # fmt: skip
    finally:
        pair.close()


def test_a_gpu_cache_is_registered_as_vram_and_a_transport_unable_to_reach_it_is_refused() -> None:
    """D's KV on ``cuda:1`` (host memory standing in for it: what matters is what reaches the
    registration and the handshake): registered and advertised as VRAM of device 1; a P whose
    transport (loopback: memcpy) cannot write into VRAM refuses D at the handshake, naming both
    memory spaces, instead of failing each request."""
    p_worker = Worker("p", P_SHAPE, P_SEED, "loopback")
    d_worker = Worker("d", D_SHAPE, None, "loopback")
    try:
        with kvpush.Endpoint(
            "gpu-decode",
            d_worker.cache.layout(),
            memory=d_worker.cache.memory(),
            transport="loopback",
            agent_name="gpu-decode-0",
            compatibility="test-model",
            device=1,
        ) as d:
            assert d.memory_space == ("vram", 1)
            assert p_worker.endpoint.memory_space == ("dram", 0)
            (request,) = make_requests(random.Random(31), 1, "gpu")
            d.expect(request.request_id, p_worker.address(), [list(request.d_blocks)],
                     request.tokens, ttl=10.0)  # fmt: skip
            (event,) = d.wait(10.0)
            assert event.outcome == "failed"
            assert event.reason is not None
            assert "GPU memory (VRAM) of device 1" in event.reason
            assert "host memory (DRAM)" in event.reason
            assert "loopback" in event.reason
        assert p_worker.pending() == 0
    finally:
        d_worker.close()
        p_worker.close()


def test_events_and_aborts_carry_the_enums_own_members() -> None:
    """An event's role, outcome and code, and abort's answer, are the classes' own members
    (``is`` holds), each equal to its stable code."""
    pair = Pair("loopback", None, None)
    try:
        (request,) = make_requests(random.Random(32), 1, "code")
        pair.d.expect(pair.source, [request])
        wait_until_registered(pair)
        assert pair.p.abort(request) is kvpush.AbortOutcome.RELEASED
        (event,) = pair.d.endpoint.wait(10.0)
        assert event.code is kvpush.Reason.ABORTED
        assert event.outcome is kvpush.Outcome.FAILED
        assert event.role is kvpush.Role.RECEIVE
        # Each equal to its code too, which code written against strings relies on.
        assert event.outcome == "failed"
        assert event.code == "aborted"
        assert event.role == "receive"
    finally:
        pair.close()
