"""A real network partition: P and D as two hosts (network namespaces joined by a veth pair),
NIXL over UCX's TCP transport between them, and the link cut while D waits for its KV.

The property is the fault matrix's (tests/test_faults.py): no byte lands in D's cache after D
reported the receive failed, here also after the link comes back, when whatever the kernel
still held for the dead connection may be retransmitted. Needs root and iproute2 (CI runs as
root); where namespaces cannot be made the tests skip and say so, and the relay-based partitions
of tests/test_faults.py cover the property on loopback.
"""

from __future__ import annotations

import os
import random
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvpush_lab.peer import NETNS_ENV, CacheShape, RemoteWorker
from tests.conftest import nixl_or_skip
from tests.faults import wait_for
from tests.test_transfer import P_SEED, make_requests

SECRET = b"shared-secret-of-the-netns-pair"
PEER_TIMEOUT = 2.0
OPTIONS = {"heartbeat_interval": 0.2, "peer_timeout": PEER_TIMEOUT, "write_timeout": 2.0}
# TCP gives up on a connection after this many retransmissions (0.2 + 0.4 + 0.8 + 1.6 s = 3 s
# from TCP's minimum timeout): P's write horizon includes that span, since bytes the kernel
# holds for a cut link are delivered when it comes back, until TCP gives up.
TCP_RETRIES = 3
TCP_SPAN = 3.0
HORIZON = PEER_TIMEOUT + 2.0 + TCP_SPAN + 1.0  # lease + write timeout + TCP's span + margin
OUTCOME_BOUND = PEER_TIMEOUT + HORIZON + 1.0  # D notices the silence, waits out the horizon, +1
WATCH = 5.0  # how long D's cache is watched once the link is healed after D's failure
P_SHAPE = CacheShape(layers=4, num_blocks=256, block_tokens=16)
D_SHAPE = CacheShape(layers=4, num_blocks=128, block_tokens=32)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


def tc(*args: str) -> None:
    try:
        subprocess.run(["tc", *args], check=True, capture_output=True, text=True, timeout=10)
    except FileNotFoundError:
        pytest.skip("tc (iproute2) is not installed: the throttled-link case needs it")


@dataclass
class Hosts:
    """Two network namespaces joined by a veth pair: P at ``p_ip`` on ``p_dev``, D likewise."""

    p_ns: str
    d_ns: str
    p_dev: str
    d_dev: str
    p_ip: str
    d_ip: str

    def link(self, up: bool) -> None:
        """Cuts (or restores) the wire: P's end of the veth goes down (or up)."""
        ip("-n", self.p_ns, "link", "set", self.p_dev, "up" if up else "down")

    def drop_from_p(self, on: bool) -> None:
        """Drops every packet P sends to D (a blackhole route in P's namespace) while D's still
        reach P: one direction cut, both sockets open, nothing told."""
        verb = "add" if on else "del"
        ip("-n", self.p_ns, "route", verb, "blackhole", f"{self.d_ip}/32")

    def throttle(self, rate: str) -> None:
        """Slows what P sends (a token bucket on its end) so that a WRITE takes seconds."""
        tc(
            "-n",
            self.p_ns,
            "qdisc",
            "add",
            "dev",
            self.p_dev,
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            "32kbit",
            "latency",
            "400ms",
        )


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root; tests/test_faults.py's relay covers this")
    n = os.getpid() % 10_000
    net = f"10.213.{n % 250}"
    made = Hosts(f"kvpush-p{n}", f"kvpush-d{n}", f"kvp{n}p", f"kvp{n}d", f"{net}.1", f"{net}.2")
    try:
        ip("netns", "add", made.p_ns)
        ip("netns", "add", made.d_ns)
        ip("link", "add", made.p_dev, "type", "veth", "peer", "name", made.d_dev)
        for ns, dev, addr in (
            (made.p_ns, made.p_dev, made.p_ip),
            (made.d_ns, made.d_dev, made.d_ip),
        ):
            ip("link", "set", dev, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
            for sysctl in ("tcp_retries2", "tcp_orphan_retries"):
                ip(
                    "netns",
                    "exec",
                    ns,
                    "sh",
                    "-c",
                    f"echo {TCP_RETRIES} > /proc/sys/net/ipv4/{sysctl}",
                )
    except (OSError, subprocess.SubprocessError) as error:
        for ns in (made.p_ns, made.d_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        detail = getattr(error, "stderr", "") or error
        pytest.skip(
            f"cannot make network namespaces here ({detail}); tests/test_faults.py's "
            "relay-based partitions cover the property"
        )
    try:
        yield made
    finally:
        for ns in (made.p_ns, made.d_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


class HostPair:
    """P and D workers, each in its own namespace, NIXL over UCX/TCP on the veth."""

    def __init__(self, hosts: Hosts) -> None:
        nixl_or_skip()

        def worker(role: str, ns: str, dev: str, addr: str, seed: int | None) -> Any:
            return RemoteWorker(
                {NETNS_ENV: ns, "UCX_TLS": "tcp", "UCX_NET_DEVICES": dev},
                role=role,
                shape=P_SHAPE if role == "p" else D_SHAPE,
                seed=seed,
                transport="nixl",
                secret=SECRET,
                options={**OPTIONS, "bind": f"{addr}:0"},
            )

        self.p: Any = worker("p", hosts.p_ns, hosts.p_dev, hosts.p_ip, P_SEED)
        self.d: Any = worker("d", hosts.d_ns, hosts.d_dev, hosts.d_ip, None)

    def close(self) -> None:
        self.d.close()
        self.p.close()


@pytest.fixture
def pair(hosts: Hosts) -> Iterator[HostPair]:
    made = HostPair(hosts)
    try:
        yield made
    finally:
        made.close()


def test_a_transfer_crosses_the_link(pair: HostPair) -> None:
    """The baseline: two hosts, a real link, the KV arrives byte for byte; P's advertised
    horizon includes TCP's retransmission span on that link."""
    assert pair.p.write_horizon() == pytest.approx(HORIZON)
    (request,) = make_requests(random.Random(1), 1, "ok")
    pair.d.expect(pair.p.address(), [request])
    assert wait_for(lambda: pair.p.pending() == 1, 10.0)
    assert pair.p.ready([request]) == []
    (event,) = pair.d.events(1, timeout=10.0)
    assert event["outcome"] == "done", event
    result = pair.d.verify(P_SHAPE, P_SEED, [request])
    assert result["wrong"] == 0


@pytest.mark.parametrize("cut", ["link-down-before-write", "link-down-mid-write", "p-to-d-dropped"])
def test_a_cut_link_lands_nothing_after_d_fails_even_once_healed(
    hosts: Hosts, pair: HostPair, cut: str
) -> None:
    (request,) = make_requests(random.Random(2), 1, "cut")
    pair.d.expect(pair.p.address(), [request])
    assert wait_for(lambda: pair.p.pending() == 1, 10.0), "D's registration never reached P"
    if cut == "link-down-before-write":
        hosts.link(up=False)
        assert pair.p.ready([request]) == []  # P's lease is still fresh: it tries to write
    elif cut == "link-down-mid-write":
        hosts.throttle("1mbit")  # the WRITE now takes seconds
        assert pair.p.ready([request]) == []
        time.sleep(0.5)
        hosts.link(up=False)
    else:
        hosts.drop_from_p(on=True)  # P's packets vanish; D's still reach P
        assert pair.p.ready([request]) == []
    started = time.monotonic()
    events = pair.d.events(1, timeout=OUTCOME_BOUND + 5.0)
    waited = time.monotonic() - started
    assert events, f"D reported nothing within {OUTCOME_BOUND + 5.0:.0f}s"
    (event,) = events
    assert waited <= OUTCOME_BOUND, f"D's outcome took {waited:.1f}s (bound {OUTCOME_BOUND:.0f}s)"

    def heal() -> None:
        # Anything the kernel or UCX still held for the old connection may now move.
        if cut == "p-to-d-dropped":
            hosts.drop_from_p(on=False)
        else:
            hosts.link(up=True)

    healed = False
    if event["outcome"] == "quarantined":
        # P is alive behind the cut with its WRITE posted: D cannot know the bytes stopped, so it
        # holds the blocks until the link heals and P's WRITE finishes or P answers its cancel.
        heal()
        healed = True
        events = pair.d.events(1, timeout=OUTCOME_BOUND + 5.0)
        assert events, "D never settled the quarantined receive once the link healed"
        (event,) = events
    if event["outcome"] == "done":
        # The WRITE got through (before the cut, or once healed): it must be whole.
        assert pair.d.verify(P_SHAPE, P_SEED, [request])["wrong"] == 0
        return
    assert event["outcome"] == "failed", event
    if not healed:
        heal()
    deadline = time.monotonic() + WATCH
    while time.monotonic() < deadline:
        changed = pair.d.changed_since_failure(event["request_id"])
        assert changed == 0, f"{changed} bytes landed in D after it failed the receive ({cut})"
        time.sleep(0.2)
    # P has its own outcome (over TCP a WRITE can be done for P, whose bytes D never got), and
    # holds nothing for the transfer any more.
    assert pair.p.events(1, timeout=OUTCOME_BOUND), "P reported no outcome"
    assert wait_for(lambda: pair.p.pending() == 0, OUTCOME_BOUND), "P kept the entry"
