"""The fault matrix: kvpush's fence under partitions, pauses, stalls, crashes and hostile bytes.

The property every test checks is the fence: **no byte lands in D's cache after D reported the
receive failed.** D's worker snapshots its whole cache as it takes a final failed (or
cancelled) receive's event (``Worker.events``; a ``quarantined`` notice keeps the blocks, and
is no such event); the test then watches that snapshot for longer than P could still be
writing (past P's own silence timeout plus a write's timeout) and fails on the first byte that
changed. Besides the fence, each test bounds when each side's outcome arrives and checks that P
ends holding no entry for the transfer (``pending() == 0``).

Transports are those of ``test_transfer``: the in-process loopback and NIXL between two
processes over UCX on loopback (default transports, and ``UCX_TLS=tcp``). Faults that need a
process of their own (SIGSTOP, SIGKILL, one thread stopped with ptrace) run on NIXL only; a
WRITE caught in flight by them is the section "a WRITE in flight when P stops".
"""

from __future__ import annotations

import dataclasses
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

import pytest

from kvpush_lab.cache import CacheShape, Request
from kvpush_lab.peer import RemoteWorker, Worker
from tests.support.faults import (
    LOOPBACK,
    Bounds,
    Direction,
    Fault,
    FenceBrokenError,
    Outcomes,
    PeakRss,
    ProcessPause,
    Relay,
    SpawnedThreadRunsFirst,
    ThreadStall,
    fenced_through,
    garbage,
    loopback_address,
    oversized,
    paused,
    silent_prefixes,
    slowloris,
    unread_tcp_bytes,
    wait_for,
)
from tests.support.nixl import nixl_or_skip
from tests.support.pair import P_SHAPE, TRANSPORTS, Pair, make_requests

SECRET = b"shared-secret-of-the-fault-pair"
HEARTBEAT_INTERVAL = 0.2
PEER_TIMEOUT = 2.0
WRITE_TIMEOUT = 2.0
CONNECT_TIMEOUT = 3.0
OPTIONS = {
    "heartbeat_interval": HEARTBEAT_INTERVAL,
    "peer_timeout": PEER_TIMEOUT,
    "write_timeout": WRITE_TIMEOUT,
    "connect_timeout": CONNECT_TIMEOUT,
}
# P's write horizon as it advertises it: its lease (peer timeout) + write timeout + 1 s margin.
HORIZON = PEER_TIMEOUT + WRITE_TIMEOUT + 1.0
# How long after D's failure event its cache is watched: past the time P takes to notice D is
# gone (its own peer timeout) plus a posted write's timeout, and then some.
FENCE_WATCH = PEER_TIMEOUT + WRITE_TIMEOUT + 1.0
# The latest either side's outcome may come, from the moment the fault makes it due: D notices
# the silence (peer timeout), waits out P's horizon, plus the 1 s the issue allows.
OUTCOME_BOUND = PEER_TIMEOUT + HORIZON + 1.0
# The threads of the workers' endpoints (engine ids "p-engine", "d-engine") that faults stop:
# each one's writer (D's also starts a thread of its own for each connect to a P).
P_WRITER, D_WRITER = "kvpush-writer-p-engine", "kvpush-writer-d-engine"
#: Each case's measured time to outcome and canary result, printed at the end of the session
#: (tests/conftest.py) and written to $KVPUSH_FAULT_REPORT as JSON lines when set.
REPORT: list[dict[str, Any]] = []
NIXL_TRANSPORTS = [t for t in TRANSPORTS if TRANSPORTS[t] is not None]
MIB = 1 << 20

T = TypeVar("T")


def case_name() -> str:
    """The running test's name (with its parameters), for the report."""
    return os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0].split("::")[-1]


class FaultPair(Pair):
    """``test_transfer``'s P and D pair with the matrix's timeouts, D reaching P directly or
    through a :class:`Relay`, and this case's line of the report."""

    def __init__(self, transport: str, *, relay: bool) -> None:
        #: This case's line of the report: outcomes, their times, the canary.
        self.row: dict[str, Any] = {"case": case_name()}
        super().__init__(transport, SECRET, SECRET, OPTIONS)
        self.relay = Relay(self.p.address()) if relay else None
        self.source = self.relay.address if self.relay else self.p.address()

    def note(self, column: str, what: str) -> None:
        """Adds ``what`` to this case's ``column`` (a case may see several outcomes in turn)."""
        self.row[column] = f"{self.row[column]}, then {what}" if column in self.row else what

    def close(self) -> None:
        REPORT.append(self.row)
        try:
            super().close()
        finally:
            if self.relay:
                self.relay.close()


@contextmanager
def fault_pair(transport: str, *, relay: bool = False) -> Iterator[FaultPair]:
    pair = FaultPair(transport, relay=relay)
    try:
        yield pair
    finally:
        pair.close()


def one_request(seed: int, prefix: str) -> Request:
    (request,) = make_requests(random.Random(seed), 1, prefix)
    return request


def wait_until_registered(pair: FaultPair, count: int = 1) -> None:
    assert wait_for(lambda: pair.p.pending() >= count, 10.0), "D's registration never reached P"


def receive_outcome(pair: FaultPair, bound: float = OUTCOME_BOUND) -> dict[str, Any]:
    """D's one event for the transfer, which must come within ``bound`` seconds."""
    started = time.monotonic()
    events = pair.d.events(1, timeout=bound)
    seconds = time.monotonic() - started
    assert events, f"D reported no outcome within {bound:.0f}s"
    (event,) = events
    assert event["role"] == "receive"
    pair.note("d", f"{event['outcome']} {seconds:.1f}s")
    return dict(event)


def send_outcome(pair: FaultPair, refused: list[str], bound: float = OUTCOME_BOUND) -> str:
    """P's outcome for a transfer whose KV it reported ready: the refusal of ``ready``, or its
    one send event, which must come within ``bound`` seconds."""
    if refused:
        pair.note("p", "ready refused")
        return f"refused: {refused[0]}"
    started = time.monotonic()
    events = pair.p.events(1, timeout=bound)
    seconds = time.monotonic() - started
    assert events, f"P reported no outcome within {bound:.0f}s"
    (event,) = events
    assert event["role"] == "send"
    pair.note("p", f"{event['outcome']} {seconds:.1f}s")
    return str(event["outcome"])


def assert_fenced(pair: FaultPair, request_id: str, seconds: float = FENCE_WATCH) -> None:
    """No byte of D's cache changes for ``seconds`` after ``request_id``'s failure event."""
    deadline = time.monotonic() + seconds
    while True:
        changed = pair.d.changed_since_failure(request_id)
        pair.row["canary"] = f"{changed} B changed in {seconds:.0f}s" if changed else "unchanged"
        assert changed == 0, (
            f"{changed} bytes landed in D's cache after D reported receive {request_id} failed"
        )
        if time.monotonic() >= deadline:
            return
        time.sleep(0.1)


def assert_nothing_left_on_p(pair: FaultPair, bound: float = OUTCOME_BOUND) -> None:
    left = wait_for(lambda: pair.p.pending() == 0, bound)
    pair.row["p_entries_left"] = 0 if left else pair.p.pending()
    assert left, (
        f"P still holds {pair.p.pending()} rendezvous entries {bound:.0f}s after the transfer "
        "could no longer happen"
    )


def assert_not_delivered(outcome: str) -> None:
    assert outcome != "done", "P reports a transfer delivered that D reported failed"


# ---- partitions and pauses -------------------------------------------------------------------


# How the partition falls, as (seconds after the previous stage, direction to black-hole).
PARTITIONS: dict[str, list[tuple[float, Direction]]] = {
    # P's bytes are lost, D's arrive, and so does D's close once D gives up on P.
    "p_to_d": [(0.0, "p_to_d")],
    # Both sides fall silent at once: which gives up first is a matter of heartbeat phase.
    "both": [(0.0, "both")],
    # P's bytes are lost first, D's a second later: D gives up on P a second before P can
    # notice anything, and P never hears D's close.
    "p_to_d-then-d_to_p": [(0.0, "p_to_d"), (1.0, "d_to_p")],
}


@pytest.mark.parametrize(
    "partition",
    [
        "p_to_d",
        "both",
        "p_to_d-then-d_to_p",
    ],
)
@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_partition_after_registration_lands_nothing_after_d_fails(
    transport: str, partition: str
) -> None:
    with fault_pair(transport, relay=True) as pair:
        assert pair.relay is not None
        request = one_request(10, "part")
        pair.d.expect(pair.source, [request])
        wait_until_registered(pair)
        for delay, direction in PARTITIONS[partition]:
            time.sleep(delay)
            pair.relay.blackhole(direction)

        # P may be alive behind the partition, and nothing tells D otherwise: past P's horizon D
        # says the receive is quarantined, and keeps the blocks.
        notice = receive_outcome(pair)
        assert notice["outcome"] == "quarantined", notice
        assert pair.relay.swallowed("p_to_d") > 0, "the partition swallowed none of P's bytes"
        # Healed, D reaches P again and asks: P confirms nothing of it is in flight.
        pair.relay.heal()
        received = receive_outcome(pair)
        assert received["outcome"] == "failed", received
        assert received["code"] == "peer_lost", received
        assert "confirmed" in received["reason"], received

        refused = pair.p.ready([request])  # P's KV becomes ready after D gave up
        assert_fenced(pair, request.request_id)
        assert_not_delivered(send_outcome(pair, refused))
        assert_nothing_left_on_p(pair)


@pytest.mark.parametrize("transport", NIXL_TRANSPORTS)
def test_p_paused_past_the_peer_timeout_lands_nothing_after_d_fails(transport: str) -> None:
    with fault_pair(transport) as pair:
        request = one_request(11, "stop")
        pair.d.expect(pair.source, [request])
        wait_until_registered(pair)
        with paused(pair.p):
            # A stopped P keeps no horizon: D holds the blocks, quarantined, and keeps asking.
            notice = receive_outcome(pair)
            assert notice["outcome"] == "quarantined", notice
        refused = pair.p.ready([request])  # the first thing P does once it runs again
        received = receive_outcome(pair)  # once P answers D's renewed cancel
        assert received["outcome"] == "failed", received
        assert "lost P" in received["reason"], received
        assert_fenced(pair, request.request_id)
        assert_not_delivered(send_outcome(pair, refused))
        assert_nothing_left_on_p(pair)


# Longer than the endpoint's writer-stall threshold (10 s, or the peer timeout if longer).
WHOLE_PAUSE = 11.5


def test_p_stopped_as_a_whole_past_the_stall_threshold_comes_back_healthy() -> None:
    """A paused VM or a SIGSTOP stops every thread of P at once: on resuming, P's writer has not
    run for longer than the stall threshold, but neither has anything else, so P is not judged
    stuck. It is healthy again without a restart and serves the next transfer."""
    nixl_or_skip()
    with fault_pair("nixl") as pair:
        (first,) = make_requests(random.Random(26), 1, "whole")
        with ProcessPause(pair.p.pid, WHOLE_PAUSE) as pause:
            assert wait_for(lambda: pause.ended is not None, WHOLE_PAUSE + 5.0)
        pair.row["fault"] = f"P stopped {WHOLE_PAUSE:.1f}s"
        health = pair.p.health()
        assert health is None, f"P unhealthy after a whole-process pause: {health}"
        pair.d.expect(pair.source, [first])
        wait_until_registered(pair)
        assert pair.p.ready([first]) == []
        received = receive_outcome(pair)
        assert received["outcome"] == "done", received
        pair.verify([first])
        assert pair.p.health() is None


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_partition_while_p_writes_delivers_whole_or_lands_nothing_after_d_fails(
    transport: str,
) -> None:
    """P's KV becomes ready inside the partition, while its lease on D is still fresh: either
    the WRITE lands whole before D reports anything (its DONE travels on NIXL, not the cut side
    channel), or D fails and nothing lands after."""
    with fault_pair(transport, relay=True) as pair:
        assert pair.relay is not None
        request = one_request(17, "pw")
        pair.d.expect(pair.source, [request])
        wait_until_registered(pair)
        pair.relay.blackhole("both")
        refused = pair.p.ready([request])
        received = receive_outcome(pair)
        if received["outcome"] == "quarantined":
            # D cannot know whether P's WRITE is still coming: it holds the blocks until the
            # partition heals and P answers.
            pair.relay.heal()
            received = receive_outcome(pair)
        if received["outcome"] == "done":
            pair.verify([request])
        else:
            assert received["outcome"] == "failed", received
            assert_fenced(pair, request.request_id)
        send_outcome(pair, refused)
        assert_nothing_left_on_p(pair)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_side_channel_cut_then_a_reconnect_serves_new_transfers(transport: str) -> None:
    """The connection is reset under a waiting transfer; D reconnects and asks P, which confirms
    nothing is in flight, so D reports it without waiting for P's horizon, and nothing lands
    after; D's next request uses the new connection (the same agent on P) and is delivered byte
    for byte."""
    with fault_pair(transport, relay=True) as pair:
        assert pair.relay is not None
        first, second = make_requests(random.Random(18), 2, "rc")
        pair.d.expect(pair.source, [first])
        wait_until_registered(pair)
        pair.relay.cut()
        received = receive_outcome(pair)
        assert received["outcome"] == "failed", received
        assert "confirmed" in received["reason"], received
        assert_fenced(pair, first.request_id, seconds=1.0)
        assert_nothing_left_on_p(pair)
        refused = pair.p.ready([first])
        send_outcome(pair, refused)
        pair.d.expect(pair.source, [second])
        wait_until_registered(pair)
        assert pair.p.ready([second]) == []
        again = receive_outcome(pair)
        assert again["outcome"] == "done", again
        pair.verify([second])


class StrandedRequestError(AssertionError):
    """D kept a lost connection as its way to P: a request to that P was refused."""


def test_a_connection_lost_right_after_its_handshake_leaves_later_requests_served() -> None:
    """D connects to P (through a relay) for a request, and the connection is reset right after
    its handshake. Two of D's threads then report to its writer: the connecting thread that the
    connection is up, the connection's own thread that it is lost. Whichever comes first, D must
    not keep the lost connection as its way to P: a later request to that P is served.

    The unlucky order is made certain: D's connecting thread (its writer starts one for the
    connect) is held as it spawns the
    connection's thread (the handshake is over then), the relay resets the connection, and the
    connecting thread goes on only once the connection's thread has reported the loss and
    ended (:class:`SpawnedThreadRunsFirst`)."""
    with fault_pair("nixl", relay=True) as pair:
        assert pair.relay is not None
        first, later = make_requests(random.Random(25), 2, "race")
        # D's writer starts a connecting thread for the connect, which spawns the connection's.
        race = SpawnedThreadRunsFirst(
            pair.d.pid, D_WRITER, then=pair.relay.cut, seconds=10.0, by_its_child=True
        )
        try:
            pair.d.expect(pair.source, [first], ttl=2.0)
            race.result(timeout=20.0)
        finally:
            race.end()
        pair.row["fault"] = "connection reset after its handshake, lost before connected"
        # Nothing was ready for ``first``: it ends without its KV, and nothing lands.
        received = receive_outcome(pair, bound=2.0 + OUTCOME_BOUND)
        assert received["outcome"] in ("failed", "cancelled"), received
        assert_fenced(pair, first.request_id, seconds=1.0)

        assert pair.p.ready([later]) == []
        pair.d.expect(pair.source, [later])
        again = receive_outcome(pair)
        if again["outcome"] != "done":
            raise StrandedRequestError(
                f"a request after the lost connection was not served: {again}"
            )
        pair.verify([later])
        assert_nothing_left_on_p(pair)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_d_cancels_and_p_acknowledges_before_anything_is_written(transport: str) -> None:
    """A client disconnect on D: D's blocks are handed back only on P's acknowledgement, and
    P's KV arriving later is refused at once (P frees it)."""
    with fault_pair(transport) as pair:
        request = one_request(19, "dc")
        pair.d.expect(pair.source, [request])
        wait_until_registered(pair)
        pair.d.cancel(request.request_id)
        received = receive_outcome(pair)
        assert received["outcome"] == "cancelled", received
        refused = pair.p.ready([request])
        assert refused, "P accepted KV for a transfer D cancelled"
        assert_fenced(pair, request.request_id, seconds=2.0)
        assert_nothing_left_on_p(pair)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_lease_expiry_ends_each_half_on_its_own(transport: str) -> None:
    """P's KV that no D registers for, and a D registration P's KV never comes for, each end at
    their own deadline: P frees its blocks, D fails the request."""
    with fault_pair(transport) as pair:
        unclaimed, unready = make_requests(random.Random(20), 2, "lx")
        assert pair.p.ready([unclaimed], ttl=1.0) == []
        assert send_outcome(pair, [], bound=1.0 + 2.0) == "cancelled"
        pair.d.expect(pair.source, [unready], ttl=1.0)
        received = receive_outcome(pair, bound=1.0 + 3.0)
        assert received["outcome"] == "failed", received
        assert_fenced(pair, unready.request_id, seconds=1.0)
        assert_nothing_left_on_p(pair)


@pytest.mark.parametrize("transport", NIXL_TRANSPORTS)
def test_d_paused_is_a_slow_reader_that_p_lets_go(transport: str) -> None:
    """D stops reading (SIGSTOP) while registered: P loses it (silence, or a write that blocks)
    and purges its registration; once D runs again it reports the receive only after P's
    horizon, and nothing lands after."""
    with fault_pair(transport) as pair:
        request = one_request(21, "dp")
        pair.d.expect(pair.source, [request])
        wait_until_registered(pair)
        with paused(pair.d):
            assert_nothing_left_on_p(pair, bound=PEER_TIMEOUT + 3.0)
            refused = pair.p.ready([request])
        received = receive_outcome(pair)
        assert received["outcome"] == "failed", received
        assert_fenced(pair, request.request_id)
        assert_not_delivered(send_outcome(pair, refused))


# ---- a WRITE in flight when P stops ----------------------------------------------------------
#
# Issue 16: P's process stopped (SIGSTOP), or its writer thread alone (ptrace), while a large
# WRITE is under way, for pauses shorter and longer than P's horizon. NIXL cannot revoke a posted
# WRITE and its release does not stop UCX, so the bytes land whenever whoever moves them runs
# again: P's own process with cma (the default transports on one host), D's UCX progress with
# tcp. The fence's terms (what these cases check):
#
# * D's events for the request: at most one ``quarantined`` notice (D has no proof that P's
#   bytes can no longer land: it keeps the blocks and waits), then at most one final event
#   (done, failed or cancelled). The canary starts at a final failed or cancelled event and
#   watches D's whole cache until ``FENCE_WATCH`` after both it and the fault's end; a final
#   done must have P's bytes, whole.
# * D's first event comes within D's bound (peer timeout + P's horizon) + 1 s of the fault's
#   start and, once the fault ended, its final one within that bound again; P's send event
#   within P's bound (write timeout + its 1 s margin) + 1 s of P running again.
#
# 2 vCPUs copy 256 MiB over cma in about 0.1 s, as 16,384 runs (blocks scattered over both
# caches, each its own run: P copies in its post, and a stop falls between two copies, never
# inside one); over tcp, 128 MiB is far beyond the kernel's socket buffers, so most of it waits
# in P's UCX when P stops, and what is left trickles in for seconds once it is abandoned.
WRITE_MIB = {"nixl": 256, "nixl-tcp": 128}
WRITE_BLOCK_TOKENS = 256  # 16 KiB per layer and K/V
WRITE_SEED = 26
# D's cache sampled every this many bytes: a probe for a WRITE's first bytes cheap enough to
# poll while P copies.
PROBE_STRIDE = 4096
# P's bound on its own outcome: a write is abandoned after its timeout, plus P's horizon's 1 s
# margin.
P_BOUND = WRITE_TIMEOUT + 1.0
# The pauses of the whole process: shorter than P's horizon (D has lost P, but P runs again
# before D's wait for it is over), and longer: until D has reported (its wait for P is over, or
# it says it holds the blocks), and this long after.
PROCESS_PAUSES = {"shorter": 4.5}
RESUME_AFTER_D = 1.0
# The stalls of P's writer thread alone: shorter and longer than P's horizon. D does not lose P
# (its heartbeats go on), so even the longer one stays inside D's bound.
THREAD_STALLS = {"shorter": 3.0, "longer": HORIZON + 1.5}
# Over tcp, how long D's writer is held as P's runs again (see WriterStall).
D_HOLD = 0.5


class WritePair:
    """A P and a D on NIXL, each in its own process, whose caches hold one large WRITE
    (``request``), with UCX's connection between them already made
    (a one-block transfer went first, so that the WRITE's bytes move as it is posted), and this
    case's line of the report."""

    def __init__(self, transport: str) -> None:
        env = TRANSPORTS[transport]
        assert env is not None, "a WRITE pair runs on NIXL"
        self.transport = transport
        self.row: dict[str, Any] = {"case": case_name()}
        one = CacheShape(layers=4, num_blocks=1, block_tokens=WRITE_BLOCK_TOKENS)
        blocks = (WRITE_MIB[transport] << 20) // (
            2 * one.layers * one.block_tokens * one.token_bytes
        )
        shape = dataclasses.replace(one, num_blocks=blocks + 1)  # block 0 for the warm-up
        self.p: Any = RemoteWorker(env, role="p", shape=shape, seed=WRITE_SEED, transport="nixl",
                                   secret=SECRET, options=OPTIONS)  # fmt: skip
        self.d: Any = None
        try:
            self.d = RemoteWorker(env, role="d", shape=shape, seed=None, transport="nixl",
                                  secret=SECRET, options=OPTIONS)  # fmt: skip
            self.horizon: float = self.p.write_horizon()
            # Over cma, each block its own run (see above); over tcp, one run per layer and K/V,
            # so that P's post of the WRITE is over at once and a stop finds it under way.
            rng = random.Random(24)
            p_blocks, d_blocks = (
                rng.sample(range(1, blocks + 1), blocks)
                if transport == "nixl"
                else range(1, blocks + 1)
                for _ in "pd"
            )
            tokens = blocks * WRITE_BLOCK_TOKENS
            self.request = Request("cmpl-big-0", tokens, tuple(p_blocks), tuple(d_blocks),
                                   transfer_id="xfer-big")  # fmt: skip
            self.bytes = 2 * shape.layers * tokens * shape.token_bytes
            self.regions = shape.regions
            self._warm_up(Request("cmpl-warm-0", WRITE_BLOCK_TOKENS, (0,), (0,),
                                  transfer_id="xfer-warm"))  # fmt: skip
            # What the warm-up landed, as each probe counts it.
            self.before = {stride: int(self.d.landed(stride)) for stride in (1, PROBE_STRIDE)}
        except BaseException:
            self.close()
            raise

    def _warm_up(self, request: Request) -> None:
        self.d.expect(self.p.address(), [request])
        assert wait_for(lambda: self.p.pending() == 1, 10.0), "D's registration never reached P"
        assert self.p.ready([request]) == []
        (received,) = self.d.events(1, timeout=10.0)
        (sent,) = self.p.events(1, timeout=10.0)
        assert received["outcome"] == sent["outcome"] == "done", (received, sent)

    def landed(self, stride: int = 1) -> int:
        """Bytes of the large WRITE in D's cache so far (``stride``: a sampled estimate)."""
        return int(self.d.landed(stride)) - self.before[stride]

    def delivered_whole(self) -> bool:
        blocks = list(self.request.p_blocks), list(self.request.d_blocks)
        return bool(self.p.blocks_digest(blocks[0]) == self.d.blocks_digest(blocks[1]))

    def close(self) -> None:
        REPORT.append(self.row)
        try:
            if self.d is not None:
                self.d.close()
        finally:
            self.p.close()


@contextmanager
def write_pair(transport: str) -> Iterator[WritePair]:
    pair = WritePair(transport)
    try:
        yield pair
    finally:
        pair.close()


def stop_mid_write(
    pair: WritePair, what: str, stop: Callable[[], Fault], *, streamed: bool = False
) -> Fault:
    """Posts P's WRITE and ``stop()``s P (``what``: its process or its writer thread) while
    the WRITE is under way; fails, naming what it saw, unless some but not all of it had landed
    in D by then. Over tcp D's own writer (which lands the bytes) is held until P is stopped, so
    that the WRITE cannot finish first; over cma P is stopped as soon as D's cache shows its
    first bytes. ``streamed``: layer-wise push, the WRITE under way is that of the first half of
    the layers, and P's KV became ready meanwhile (its WRITE of the rest waits for it)."""
    pair.d.expect(pair.p.address(), [pair.request])
    assert wait_for(lambda: pair.p.pending() == 1, 10.0), "D's registration never reached P"

    def post() -> None:
        if streamed:
            half = pair.regions // 2
            assert pair.p.layers_ready([pair.request], 0, half) == []
        assert pair.p.ready([pair.request]) == []

    if pair.transport == "nixl-tcp":
        with ThreadStall(pair.d.pid, D_WRITER, seconds=5.0):
            post()
            assert wait_for(lambda: unread_tcp_bytes(pair.d.pid) >= 32 << 10, 5.0), (
                "P's WRITE never filled D's socket: was it posted?"
            )
            fault = stop()
    else:
        post()
        assert wait_for(lambda: pair.landed(PROBE_STRIDE) > 0, 10.0, interval=0.0), (
            "P's WRITE landed nothing in 10 s"
        )
        fault = stop()
    try:
        # D's UCX lands what the kernel already holds; then nothing more comes while P is stopped.
        sizes = [pair.landed()]
        while len(sizes) < 3 or sizes[-1] != sizes[-2]:
            assert len(sizes) < 30, f"D's cache kept changing while P was stopped: {sizes}"
            time.sleep(0.1)
            sizes.append(pair.landed())
        landed = sizes[-1]
        pair.row["fault"] = f"{what}, {landed / MIB:.1f} of {pair.bytes / MIB:.0f} MiB in"
        assert 0 < landed < 0.99 * pair.bytes, (
            f"P stopped with {landed} of its WRITE's {pair.bytes} bytes landed in D: the case "
            "needs a WRITE in flight (some but not all of it landed)"
        )
    except BaseException:
        fault.end()
        raise
    return fault


class WriterStall(Fault):
    """P's writer thread alone stalled for ``seconds`` (its heartbeats go on). Over UCX tcp D's
    writer, which is what lands P's bytes there, is also held from just before P's runs again
    until ``D_HOLD`` after: P's first look at its WRITE then finds it still under way, as with a
    D slow to read, rather than racing D's reads to finish it in one go."""

    def __init__(self, pair: WritePair, seconds: float) -> None:
        self._d_pid = pair.d.pid if pair.transport == "nixl-tcp" else None
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        # Let go by end(), or by itself should end() never come.
        self._p = ThreadStall(pair.p.pid, P_WRITER, seconds + D_HOLD + 5.0)
        self.started = self._p.started
        self._timer = threading.Timer(seconds, self.end)
        self._timer.daemon = True
        self._timer.start()

    def end(self) -> None:
        with self._lock:
            if self.ended is not None:
                return
            held = None
            try:
                if self._d_pid is not None:
                    held = ThreadStall(self._d_pid, D_WRITER, D_HOLD + 1.0)
            except (LookupError, OSError, TimeoutError) as error:
                self.error = error  # raised on leaving the ``with`` block: the timer's is lost
            finally:
                self.ended = time.monotonic()
                self._p.end()
            if held is not None:
                time.sleep(D_HOLD)
                held.end()
        self._timer.cancel()

    def __exit__(self, *args: object) -> None:
        self.end()
        if self.error is not None and args[0] is None:
            raise AssertionError(f"could not hold D's writer as P's ran again: {self.error}")


def write_bounds(pair: WritePair) -> Bounds:
    return Bounds(d=PEER_TIMEOUT + pair.horizon + 1.0, p=P_BOUND + 1.0, watch=FENCE_WATCH)


def assert_fenced_through(pair: WritePair, fault: Fault, end_after_d: float | None) -> None:
    """The fence and the bounds through ``fault``, P's stop (see the section's head); it ends
    ``end_after_d`` after D's first event, else by itself."""
    fenced_through(
        Outcomes(pair.p, pair.d, fault, stops_p=True),
        pair.request.request_id,
        write_bounds(pair),
        pair.row,
        pair.delivered_whole,
        end_fault_after_d=end_after_d,
    )
    if pair.transport == "nixl-tcp":
        assert pair.p.stats()["late_posts"] == 0, (
            "P was stopped inside its post of the WRITE, not with the WRITE under way"
        )


def stall_param(transport: str, pause: str) -> Any:
    return pytest.param(transport, pause, id=f"{transport}-{pause}")


def process_stop(pair: WritePair, pause: str, where: str = "") -> tuple[float, float | None, str]:
    """How long P's process stops, ``shorter`` than its write horizon or ``longer`` (until
    :data:`RESUME_AFTER_D` after D's first event); how long after D's first event the case
    ends (None: at once); and the case's label (``where`` after what stopped)."""
    if pause == "shorter":
        seconds = PROCESS_PAUSES[pause]
        return seconds, None, f"P stopped {seconds:.1f}s{where}"
    seconds = write_bounds(pair).d + RESUME_AFTER_D
    label = f"P stopped{where} until {RESUME_AFTER_D:.0f}s after D's first event"
    return seconds, RESUME_AFTER_D, label


@pytest.mark.parametrize(
    ("transport", "pause"),
    [
        stall_param("nixl", "shorter"),
        stall_param("nixl", "longer"),
        stall_param("nixl-tcp", "shorter"),
        stall_param("nixl-tcp", "longer"),
    ],
)
def test_p_stopped_mid_write_lands_nothing_after_ds_final_failure(
    transport: str, pause: str
) -> None:
    """P's whole process stopped with its WRITE partly landed, then running again."""
    nixl_or_skip()
    with write_pair(transport) as pair:
        seconds, end_after_d, what = process_stop(pair, pause)
        with stop_mid_write(pair, what, lambda: ProcessPause(pair.p.pid, seconds)) as fault:
            assert_fenced_through(pair, fault, end_after_d)


@pytest.mark.parametrize(
    ("transport", "pause"),
    [
        stall_param("nixl", "shorter"),
        stall_param("nixl", "longer"),
        stall_param("nixl-tcp", "shorter"),
        stall_param("nixl-tcp", "longer"),
    ],
)
def test_ps_writer_stalled_mid_write_lands_nothing_after_ds_final_failure(
    transport: str, pause: str
) -> None:
    """P's writer thread alone stopped with its WRITE partly landed (P's heartbeats go on), then
    running again."""
    nixl_or_skip()
    with write_pair(transport) as pair:
        seconds = THREAD_STALLS[pause]
        what = f"P's writer stalled {seconds:.1f}s"
        with stop_mid_write(pair, what, lambda: WriterStall(pair, seconds)) as fault:
            assert_fenced_through(pair, fault, end_after_d=None)


@pytest.mark.parametrize(
    ("transport", "pause"),
    [stall_param("nixl", "shorter"), stall_param("nixl-tcp", "longer")],
)
def test_p_stopped_mid_stream_lands_nothing_after_ds_final_failure(
    transport: str, pause: str
) -> None:
    """Layer-wise push: P's whole process stopped while the WRITE of its first layers is
    partly landed (P's KV ready meanwhile), then running again: the same fence and bounds."""
    nixl_or_skip()
    with write_pair(transport) as pair:
        seconds, end_after_d, what = process_stop(pair, pause, " mid-stream")
        stop = lambda: ProcessPause(pair.p.pid, seconds)  # noqa: E731
        with stop_mid_write(pair, what, stop, streamed=True) as fault:
            assert_fenced_through(pair, fault, end_after_d)


def test_p_stopped_mid_write_for_good_leaves_d_quarantined_not_failed() -> None:
    """P stops with its WRITE partly landed and never runs again: D cannot know the WRITE will
    not go on, so within its bound it reports the receive quarantined (keeping the blocks) and
    no final failure while P is stopped. (P is killed at the end, still stopped: D cannot tell
    a dead P from a stopped one either.)"""
    nixl_or_skip()
    with write_pair("nixl-tcp") as pair:
        d_bound = write_bounds(pair).d
        watch = d_bound + 3.0
        what = "P stopped for good"
        with stop_mid_write(pair, what, lambda: ProcessPause(pair.p.pid, watch + 5.0)) as fault:
            outcomes = Outcomes(pair.p, pair.d, fault, stops_p=True)
            outcomes.until(lambda: False, lambda: fault.started + watch)
            pair.row["d"] = ", then ".join(str(seen) for seen in outcomes.received) or "nothing"
            pair.row["p"] = "stopped for good"
            pair.p.kill()
        kinds = [seen.outcome for seen in outcomes.received]
        assert kinds, f"D reported nothing within {d_bound:.0f}s of losing P"
        if outcomes.final is not None and outcomes.final.outcome != "done":
            raise FenceBrokenError(
                f"D reported the receive {outcomes.final} after P stopped mid-WRITE, with P still "
                "stopped: a final failure before P's fate is known hands back blocks its WRITE "
                "may still land in"
            )
        assert kinds == ["quarantined"], f"D's events while P was stopped mid-WRITE: {kinds}"
        assert outcomes.received[0].at <= d_bound, (
            f"D's notice came {outcomes.received[0].at:.1f}s after P stopped (bound {d_bound:.0f}s)"
        )


# ---- duplicate registration ------------------------------------------------------------------


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_duplicate_registration_at_the_same_epoch_still_delivers(transport: str) -> None:
    with fault_pair(transport) as pair:
        request = one_request(12, "dup")
        pair.d.expect(pair.source, [request])
        wait_until_registered(pair)
        pair.d.expect(pair.source, [request])  # the same key at the same epoch, again
        # Nothing on either side shows the duplicate's arrival; give it time to reach P before
        # P's KV is ready, so that P's table sees it while it holds the original.
        time.sleep(0.5)
        assert pair.p.ready([request]) == []

        received = receive_outcome(pair)
        assert received["outcome"] == "done", received
        assert pair.d.events(1, timeout=1.0) == [], "D reported the transfer twice"
        assert send_outcome(pair, []) == "done"
        pair.verify([request])
        assert_nothing_left_on_p(pair)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_a_foreign_registration_and_cancel_leave_the_owners_transfer_alone(
    transport: str,
) -> None:
    """Another D (holding the secret) registers the owner's transfer at a higher epoch and then
    cancels it: both are refused, the owner's KV lands whole, and the intruder gets none."""
    with fault_pair(transport) as pair:
        (owner_request,) = make_requests(random.Random(22), 1, "own")
        intruder = (
            Worker("x", P_SHAPE, None, "loopback", SECRET, OPTIONS)
            if TRANSPORTS[transport] is None
            else RemoteWorker(
                TRANSPORTS[transport], role="x", shape=P_SHAPE, seed=None, transport="nixl",
                secret=SECRET, options=OPTIONS,
            )
        )  # fmt: skip
        try:
            pair.d.expect(pair.source, [owner_request])
            wait_until_registered(pair)
            intruder.endpoint_expect(
                owner_request.request_id + "-x",
                pair.source,
                list(owner_request.d_blocks),
                owner_request.tokens,
                owner_request.transfer_id,
                9,
            )
            (refused,) = intruder.events(1, timeout=OUTCOME_BOUND, snapshot=False)
            assert refused["outcome"] == "failed", refused
            assert "another peer" in refused["reason"], refused
            intruder.cancel(owner_request.request_id + "-x")
            assert pair.p.ready([owner_request]) == []
            received = receive_outcome(pair)
            assert received["outcome"] == "done", received
            pair.verify([owner_request])
            assert intruder.cache_digest() == intruder_digest_of_nothing(), "the intruder got KV"
        finally:
            intruder.close()


def intruder_digest_of_nothing() -> str:
    """The digest of an untouched (sentinel-filled) cache of ``P_SHAPE``."""
    return Worker("y", P_SHAPE, None, "loopback").cache_digest_and_close()


# ---- crashes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", NIXL_TRANSPORTS)
def test_p_killed_before_registration_fails_d_and_lands_nothing(transport: str) -> None:
    with fault_pair(transport) as pair:
        request = one_request(13, "pk")
        pair.p.kill()
        pair.d.expect(pair.source, [request])
        received = receive_outcome(pair)
        assert received["outcome"] == "failed", received
        assert "cannot reach P" in received["reason"], received
        assert_fenced(pair, request.request_id, seconds=1.0)
        pair.verify([])


@pytest.mark.parametrize("transport", NIXL_TRANSPORTS)
def test_p_killed_after_the_match_delivers_all_or_lands_nothing_after_d_fails(
    transport: str,
) -> None:
    with fault_pair(transport) as pair:
        request = one_request(14, "pm")
        pair.d.expect(pair.source, [request])
        wait_until_registered(pair)
        assert pair.p.ready([request]) == []  # matched: P's write is queued or posted
        pair.p.kill()
        received = receive_outcome(pair)
        if received["outcome"] == "done":
            pair.verify([request])
        else:
            assert received["outcome"] == "failed", received
            assert "lost P" in received["reason"], received
            assert_fenced(pair, request.request_id)


@pytest.mark.parametrize("transport", NIXL_TRANSPORTS)
def test_p_killed_mid_stream_fails_d_once_and_lands_nothing_after(transport: str) -> None:
    """Layer-wise push: P dies after some of a request's layers landed in D, before its KV
    was ready: D's receive fails once, within its bound, and nothing lands after."""
    with fault_pair(transport) as pair:
        request = one_request(17, "ps")
        pair.d.expect(pair.source, [request])
        wait_until_registered(pair)
        regions = P_SHAPE.regions
        assert pair.p.layers_ready([request], 0, regions // 2) == []
        assert wait_for(lambda: pair.d.landed() > 0, 10.0), "no layer landed in D"
        pair.p.kill()
        received = receive_outcome(pair)
        assert received["outcome"] == "failed", received
        assert "lost P" in received["reason"], received
        assert_fenced(pair, request.request_id)
        assert pair.d.events(1, timeout=0.5) == [], "D reported the receive again"


@pytest.mark.parametrize("transport", NIXL_TRANSPORTS)
def test_d_killed_after_registering_leaves_no_entry_on_p(transport: str) -> None:
    with fault_pair(transport) as pair:
        request = one_request(15, "dk")
        pair.d.expect(pair.source, [request], 30.0)  # a ttl well past the bound below
        wait_until_registered(pair)
        pair.d.kill()
        assert_nothing_left_on_p(pair, bound=PEER_TIMEOUT + 3.0)


@pytest.mark.parametrize("transport", NIXL_TRANSPORTS)
def test_p_ready_after_d_was_killed_fails_the_send_and_leaves_no_entry(transport: str) -> None:
    with fault_pair(transport) as pair:
        request = one_request(16, "dr")
        pair.d.expect(pair.source, [request])
        wait_until_registered(pair)
        pair.d.kill()
        outcome = send_outcome(pair, pair.p.ready([request]))
        assert outcome != "done", "P reports a write into a dead D delivered"
        assert_nothing_left_on_p(pair)


# ---- hostile bytes on P's port ---------------------------------------------------------------


class Transfers:
    """Legitimate transfers from D, one at a time, into blocks disjoint from all the others."""

    def __init__(self, pair: FaultPair, count: int) -> None:
        self.pair = pair
        self.unused = make_requests(random.Random(17), count, "h")
        self.delivered: list[Request] = []

    def one(self) -> None:
        assert self.unused, "the test ran out of disjoint requests"
        request = self.unused.pop()
        self.pair.d.expect(self.pair.source, [request])
        assert self.pair.p.ready([request]) == []
        received = receive_outcome(self.pair, bound=10.0)
        assert received["outcome"] == "done", received
        assert send_outcome(self.pair, [], bound=10.0) == "done"
        self.delivered.append(request)

    def during(self, attack: Callable[[], T], at_most: int = 3) -> T:
        """Runs ``attack`` on a thread while transferring (up to ``at_most`` transfers); returns
        what it returned."""
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="attack") as pool:
            running = pool.submit(attack)
            for _ in range(at_most):
                if running.done():
                    break
                self.one()
            return running.result(timeout=60.0)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_hostile_bytes_on_ps_port_leave_transfers_and_ps_memory_alone(transport: str) -> None:
    with fault_pair(transport) as pair:
        transfers = Transfers(pair, 16)
        transfers.one()  # D's side channel to P is up before the hostile traffic starts
        address = pair.p.address()
        with PeakRss(pair.p.pid) as rss:
            answer = transfers.during(lambda: garbage(address, 64 << 10))
            assert answer.closed, "P kept a connection open that sent garbage as its first frame"

            with silent_prefixes(address, 32, 16 * MIB) as held:
                transfers.one()
                assert wait_for(lambda: held.closed_by_peer() == 32, CONNECT_TIMEOUT + 3.0), (
                    f"P closed {held.closed_by_peer()} of 32 connections that never sent a hello"
                )

            answer = transfers.during(lambda: oversized(address))
            assert answer.closed, "P kept a connection open after an oversized length prefix"
            codes = [reply.get("code") for reply in answer.replies(SECRET)]
            assert codes == ["oversized"], codes

            answer = transfers.during(lambda: slowloris(address, CONNECT_TIMEOUT + 3.0))
            assert answer.closed, "P kept a connection open that dripped its hello byte by byte"
        pair.note("p_rss", f"+{rss.growth / MIB:.0f} MiB")
        assert rss.growth < 64 * MIB, f"P's resident memory grew by {rss.growth / MIB:.0f} MiB"
        transfers.one()  # and D's connection still serves
        pair.verify(transfers.delivered)
        assert_nothing_left_on_p(pair)


# ---- the tooling itself ----------------------------------------------------------------------


@contextmanager
def echo_server() -> Iterator[str]:
    """A 127.0.0.1 server that echoes every connection until the peer closes (threads, bounded)."""
    listener = socket.create_server((LOOPBACK, 0))
    listener.settimeout(0.05)
    stop = threading.Event()

    def echo(connection: socket.socket) -> None:
        with connection:
            connection.settimeout(0.05)
            while not stop.is_set():
                try:
                    data = connection.recv(1 << 16)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not data:
                    return
                connection.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=echo, args=(connection,), daemon=True).start()

    acceptor = threading.Thread(target=accept, name="echo-accept", daemon=True)
    acceptor.start()
    try:
        yield f"{LOOPBACK}:{listener.getsockname()[1]}"
    finally:
        stop.set()
        acceptor.join(timeout=2.0)
        listener.close()


def exchange(sock: socket.socket, payload: bytes, wait: float = 2.0) -> bytes:
    """Sends ``payload`` and returns what comes back within ``wait`` seconds (until the
    connection ends, which a reset does too)."""
    received = b""
    deadline = time.monotonic() + wait
    with suppress(ConnectionError):
        sock.sendall(payload)
        sock.settimeout(0.05)
        while len(received) < len(payload) and time.monotonic() < deadline:
            with suppress(TimeoutError):
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                received += chunk
    return received


def test_relay_passes_blackholes_cuts_and_heals() -> None:
    with echo_server() as target, Relay(target) as relay:
        host, port = loopback_address(relay.address)
        with socket.create_connection((host, port), timeout=5.0) as first:
            assert exchange(first, b"hello") == b"hello"
            assert wait_for(lambda: relay.passed("d_to_p") == relay.passed("p_to_d") == 5, 2.0)

            relay.blackhole("p_to_d")  # the echo is swallowed; the connection stays open
            assert exchange(first, b"lost", wait=0.5) == b""
            assert wait_for(lambda: relay.swallowed("p_to_d") == 4, 2.0)
            assert relay.connections() == 1

            relay.heal()  # the connection lost bytes: it is reset, new ones pass
            assert wait_for(lambda: relay.connections() == 0, 2.0)
        with socket.create_connection((host, port), timeout=5.0) as second:
            assert exchange(second, b"again") == b"again"
            relay.cut()
            assert exchange(second, b"gone", wait=0.5) == b""
        assert wait_for(lambda: relay.connections() == 0, 2.0)
