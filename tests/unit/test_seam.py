"""The typed seam between the native core and Python: the enums, the timeline, the endpoint's
options, block ids as buffers, and what the product exports."""

from __future__ import annotations

import array
import importlib
import pickle
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import kvpush
from kvpush._native import lab
from tests.support.layouts import make_layout

ENUMS = (kvpush.Role, kvpush.Outcome, kvpush.Reason, kvpush.AbortOutcome)


@pytest.mark.parametrize("enum", ENUMS, ids=lambda enum: enum.__name__)
def test_each_member_is_its_code_for_equality_hashing_and_str(enum: Any) -> None:
    members = enum.members()
    assert len({member.value for member in members}) == len(members), "codes are unique"
    for member in members:
        code = member.value
        assert code == code.lower()
        assert code.isidentifier()
        assert member.name == code.upper()
        assert getattr(enum, member.name) is member
        assert enum.from_code(code) is member
        assert enum(code) == member
        assert member == code
        assert code == member
        assert (member != code) is False
        assert hash(member) == hash(code)
        assert {code: 1}[member] == 1
        assert {member: 1}[code] == 1
        assert str(member) == code
        assert f"{member}" == code
        assert repr(member) == f"{enum.__name__}.{member.name}"
        assert pickle.loads(pickle.dumps(member)) is member
        others = [other for other in members if other is not member]
        assert all(member != other for other in others)
        assert member != 1
        assert member != code.upper()
    with pytest.raises(ValueError, match="not a"):
        enum.from_code("no such code")
    with pytest.raises(ValueError, match="not a"):
        enum("no such code")


def test_the_reason_codes_are_the_documented_ones() -> None:
    """Metric labels and alerts are keyed by these: a change is a breaking one."""
    assert [reason.value for reason in kvpush.Reason.members()] == [
        "aborted",
        "cancelled",
        "expired",
        "refused",
        "lease_lapsed",
        "incompatible",
        "write_error",
        "peer_lost",
        "unreachable",
        "quarantined",
        "closed",
        "writer_died",
    ]


def loopback(**settings: Any) -> kvpush.Endpoint:
    return kvpush.Endpoint("seam", make_layout(16, 8), memory=[], transport="loopback", **settings)


def test_an_expired_transfer_crosses_as_typed_members_and_a_typed_timeline() -> None:
    with loopback() as endpoint:
        endpoint.ready("req-seam", [[0, 1]], 32, ttl=0.0)
        (event,) = endpoint.wait(10.0)
    assert event.role is kvpush.Role.SEND
    assert event.outcome is kvpush.Outcome.CANCELLED
    assert event.code is kvpush.Reason.EXPIRED
    assert isinstance(event.timeline, kvpush.Timeline)
    timeline = event.timeline
    assert timeline.ready is not None
    assert timeline.matched is None
    assert timeline.posted is None
    # Also a read-only mapping of the steps taken.
    assert "ready" in timeline
    assert "posted" not in timeline
    assert timeline["ready"] == timeline.ready == timeline.get("ready")
    assert timeline.get("posted", -1.0) == -1.0
    assert dict(timeline.items()) == {"ready": timeline.ready}
    assert list(timeline) == timeline.keys() == ["ready"]
    assert len(timeline) == 1
    with pytest.raises(KeyError):
        timeline["posted"]
    assert kvpush.Timeline(ready=timeline.ready) == timeline, "made for test doubles too"
    assert kvpush.Timeline() != timeline


def test_abort_answers_with_a_member() -> None:
    with loopback() as endpoint:
        assert endpoint.abort("never-ready") is kvpush.AbortOutcome.UNKNOWN
        endpoint.ready("req-abort", [[0]], 16)
        assert endpoint.abort("req-abort") is kvpush.AbortOutcome.RELEASED


def test_a_forward_s_streams_are_read_once_from_any_object_with_their_attributes() -> None:
    from kvpush._native import LayerStreams
    from kvpush.vllm._layers import Stream

    # numpy's stubs give ndarray the buffer protocol only from Python 3.12 on: typed as Any.
    ids: Any = np.array([5, 6], dtype=np.int32)
    streams = LayerStreams(
        [
            Stream("req-a", ((3, 4), (7,)), 20, None, (0, 16)),  # tuples, as vLLM's metadata
            Stream("req-b", [ids], 32, "xfer-b", None),
        ]
    )
    assert (len(streams), streams.request_ids) == (2, ["req-a", "req-b"])
    assert streams.blocks() == [[[3, 4], [7]], [[5, 6]]]
    assert streams.without({"req-a", "req-unknown"}).request_ids == ["req-b"]
    assert streams.request_ids == ["req-a", "req-b"], "without leaves the streams as they were"
    assert not LayerStreams()
    assert not streams.without({"req-a", "req-b"})
    with pytest.raises(ValueError, match="first_tokens has 1 entries but blocks has 2 groups"):
        LayerStreams([Stream("req-c", [[1], [2]], 16, None, [0])])
    with pytest.raises(AttributeError, match="request_id"):
        LayerStreams([object()])  # type: ignore[list-item]
    with loopback() as endpoint:
        # No D registered: nothing to write, and nothing refused.
        endpoint.streams_ready(streams, 0, 2)
        endpoint.streams_ready(LayerStreams(), 0, 2)


def test_the_calls_an_engine_step_makes_keep_the_gil() -> None:
    # Released for the microseconds such a call takes, the GIL goes to any other Python thread
    # that wants it (vLLM's input and output threads, under load), and the engine thread then
    # waits up to the interpreter's switch interval to get it back. These calls never wait, so
    # they keep it: a thread that wants the GIL runs only where a call gave it up. (Catching a
    # call that gives it up is a race the other thread wins now and then: against calls that
    # released it, 3,000 of them let it in on 8 runs of 10.)
    from kvpush._native import LayerStreams
    from kvpush.vllm._layers import Stream

    spins = 0
    running = True

    def spin() -> None:
        nonlocal spins
        while running:
            spins += 1
            time.sleep(0)  # gives the GIL back at once: it wants it, it does not hog it

    interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)  # no forced switch: only a call that gives the GIL up lets it run
    spinner = threading.Thread(target=spin, daemon=True)
    try:
        with loopback() as endpoint:
            spinner.start()
            streams = LayerStreams([Stream("req-s", [[2, 3]], 32, None, None)])
            before = spins
            for i in range(500):
                endpoint.expect(f"req-d{i}", "127.0.0.1:9", [[0, 1]], 32)
                endpoint.cancel(f"req-d{i}")
                endpoint.ready(f"req-p{i}", [[0, 1]], 32)
                endpoint.abort(f"req-p{i}")
                endpoint.layers_ready(f"req-l{i}", [[2, 3]], 32, 0, 1)
                endpoint.streams_ready(streams, 0, 1)
            held = spins - before
            # A wait gives the GIL up and the other thread runs. It returns at once while the
            # calls' events are queued, and the other thread may miss so short a release, so
            # wait until it ran (or ten seconds went by).
            deadline = time.monotonic() + 10.0
            while spins == before + held and time.monotonic() < deadline:
                endpoint.wait(0.05)
            released = spins - before - held
    finally:
        running = False
        sys.setswitchinterval(interval)
        spinner.join(10.0)
    assert held == 0, f"the other thread ran {held} times during the calls"
    assert released > 0, "the check sees a call that gives the GIL up"


def test_options_are_checked_when_made_and_replace_checks_again() -> None:
    options = kvpush.EndpointOptions(transport="loopback", peer_timeout=2.0, secret=b"s3cret")
    assert options.transport == "loopback"
    assert options.peer_timeout == 2.0
    assert options.has_secret
    assert "s3cret" not in repr(options)
    changed = options.replace(pp_rank=1, pp_size=2)
    assert (changed.pp_rank, changed.pp_size, changed.peer_timeout) == (1, 2, 2.0)
    assert changed.has_secret, "replace keeps what it does not change"
    assert options.pp_size == 1, "options are immutable"
    assert options.busy_poll == 0.0002
    assert options.replace(busy_poll=0.02).busy_poll == 0.02
    for bad, match in [
        ({"transport": "tcp"}, "transport"),
        ({"peer_timeout": -1.0}, "peer_timeout"),
        ({"write_timeout": float("nan")}, "write_timeout"),
        ({"pp_rank": 2, "pp_size": 2}, "pp_rank"),
        ({"bind": "not an address"}, "bind"),
        ({"max_handshakes": 0}, "max_handshakes"),
        ({"max_connections": 0}, "max_connections"),
        ({"busy_poll": 0.0}, "busy_poll"),
        ({"busy_poll": 1.0}, "busy_poll"),
    ]:
        with pytest.raises(ValueError, match=match):
            kvpush.EndpointOptions(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pp_rank"):
        options.replace(pp_rank=5)


def test_an_endpoint_takes_options_or_their_keywords_or_both() -> None:
    options = kvpush.EndpointOptions(transport="loopback", agent_name="seam-agent")
    starts: list[Callable[[], kvpush.Endpoint]] = [
        lambda: kvpush.Endpoint("seam", make_layout(16, 8), memory=[], options=options),
        lambda: loopback(agent_name="seam-agent"),
        lambda: kvpush.Endpoint(
            "seam",
            make_layout(16, 8),
            memory=[],
            options=kvpush.EndpointOptions(transport="nixl"),
            transport="loopback",
            agent_name="seam-agent",
        ),
    ]
    for start in starts:
        with start() as endpoint:
            assert isinstance(endpoint, kvpush.Endpoint)
            assert endpoint.memory_space == ("dram", 0)


def test_the_native_endpoint_never_looks_for_nixl_itself() -> None:
    """Finding NIXL's library is Python's (``kvpush.Endpoint``); the native class is told."""
    with pytest.raises(ValueError, match="nixl_library"):
        kvpush._native.Endpoint(
            "seam", make_layout(16, 8), memory=[], options=kvpush.EndpointOptions()
        )


@pytest.mark.parametrize(
    "as_buffer",
    [
        lambda ids: np.array(ids, dtype=np.int64),
        lambda ids: np.array(ids, dtype=np.int32),
        lambda ids: np.array(ids, dtype=np.uint32),
        lambda ids: np.array(ids, dtype=np.uint64),
        lambda ids: np.array(ids, dtype=np.int16),
        lambda ids: array.array("i", ids),
        lambda ids: memoryview(array.array("q", ids)),
        lambda ids: np.repeat(np.array(ids, dtype=np.int64), 2)[::2],  # strided
        lambda ids: tuple(ids),
        lambda ids: range(ids[0], ids[0] + 1) if len(ids) == 1 else list(ids),
    ],
)
def test_block_ids_given_as_buffers_plan_what_lists_plan(
    as_buffer: Callable[[list[int]], Any],
) -> None:
    rng = random.Random(7)
    planner = lab.Planner(make_layout(16, 64), make_layout(16, 64))
    for _ in range(5):
        count = rng.randint(1, 12)
        src, dst = rng.sample(range(64), count), rng.sample(range(64), count)
        expected = planner.plan("req", 16 * count, [src], [dst]).runs()
        assert planner.plan("req", 16 * count, as_buffer(src), as_buffer(dst)).runs() == expected
        assert (
            planner.plan("req", 16 * count, [as_buffer(src)], [as_buffer(dst)]).runs() == expected
        )


def test_a_two_dimensional_array_is_one_group_per_row() -> None:
    layout = make_layout(16, 64)
    planner = lab.Planner(layout, layout)
    # numpy's stubs give ndarray the buffer protocol only from Python 3.12 on: typed as Any.
    rows: Any = np.array([[3, 4, 5]], dtype=np.int64)
    assert (
        planner.plan("req", 48, rows, rows).runs()
        == planner.plan("req", 48, [[3, 4, 5]], [[3, 4, 5]]).runs()
    )


@pytest.mark.parametrize(
    ("ids", "error", "match"),
    [
        (np.array([1, -1], dtype=np.int64), ValueError, "out of range"),
        (np.array([2**32], dtype=np.uint64), ValueError, "out of range"),
        (np.array([1.0, 2.0]), TypeError, "integers"),
        ("0123", TypeError, "string"),
        (b"\x00\x01", TypeError, "string"),
    ],
)
def test_block_ids_that_are_not_ids_are_refused(ids: object, error: type, match: str) -> None:
    layout = make_layout(16, 64)
    with pytest.raises(error, match=match):
        lab.Planner(layout, layout).plan("req", 32, ids, [0, 1])  # type: ignore[arg-type]


def test_the_product_exports_only_the_product() -> None:
    assert len(kvpush.__all__) <= 16
    for name in kvpush.__all__:
        assert hasattr(kvpush, name), name
    # The lab's and the tests' bindings live apart, importable by their own path.
    assert importlib.import_module("kvpush._native.lab") is lab
    for name in ("RendezvousTable", "Planner", "Encoder", "Decoder", "frame_length"):
        assert name not in kvpush.__all__
        assert hasattr(lab, name)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("kvpush.outcomes")
