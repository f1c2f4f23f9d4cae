"""Fault injection for the P/D transfer tests: a relay that partitions or cuts the side channel,
SIGSTOP/SIGCONT of a worker process and its resident memory, and hostile clients of a
side-channel port.

Everything here is bounded in time and in count, runs on threads that stop by themselves, and
only ever talks to 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import random
import select
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import psutil

import kvpush
from kvpush_lab.peer import RemoteWorker

LOOPBACK = "127.0.0.1"
Direction = Literal["p_to_d", "d_to_p", "both"]
DIRECTIONS: tuple[str, str] = ("p_to_d", "d_to_p")
MAX_FRAME_BYTES = 16 << 20
# How often every thread here looks at its stop flag.
TICK = 0.05
# A relayed write that the receiver does not take within this cuts the connection.
SEND_TIMEOUT = 5.0
# Longest any hostile client keeps its connections, whatever the caller asked.
MAX_HOLD = 60.0


def loopback_address(address: str) -> tuple[str, int]:
    """``host:port`` as a socket address; refuses anything but 127.0.0.1."""
    host, _, port = address.rpartition(":")
    if host != LOOPBACK:
        raise ValueError(f"fault injection only targets {LOOPBACK}, not {address!r}")
    return host, int(port)


def wait_for(condition: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Polls ``condition`` until it holds (True) or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def _reset(sock: socket.socket) -> None:
    """Closes ``sock`` with an RST rather than a FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


# ---- the relay -------------------------------------------------------------------------------


class _Link:
    """One relayed connection: D's socket to the relay and the relay's socket to P."""

    def __init__(self, d_side: socket.socket, p_side: socket.socket) -> None:
        self.sockets = {"d_to_p": (d_side, p_side), "p_to_d": (p_side, d_side)}
        self.d_side, self.p_side = d_side, p_side
        self.threads: list[threading.Thread] = []
        self.closed = threading.Event()
        # Bytes or an end of stream were swallowed: the two streams no longer agree.
        self.lost = False
        self.pumps_left = 2
        self.lock = threading.Lock()

    def close(self, *, reset: bool) -> None:
        with self.lock:
            if self.closed.is_set():
                return
            self.closed.set()
        for sock in (self.d_side, self.p_side):
            if reset:
                _reset(sock)
            else:
                sock.close()


class Relay:
    """A TCP relay on 127.0.0.1 in front of P's side channel: tell D ``relay.address`` as P's
    ``source`` and every connection D opens is relayed to ``target``.

    ``blackhole(direction)`` swallows the bytes going that way while every socket stays open: a
    partition that TCP does not notice. A close (FIN or reset) is passed on only in a direction
    that is not black-holed: one that is drops it like any byte, so the side behind it learns of
    the other's end only by its own timeouts. ``cut()`` resets every relayed connection;
    ``heal()`` passes traffic again and resets the connections that lost bytes (their frames
    cannot be resynchronised), so peers reconnect. New connections are accepted throughout, up
    to ``max_connections`` at once.
    """

    def __init__(self, target: str, *, max_connections: int = 16) -> None:
        self._target = loopback_address(target)
        self._max_connections = max_connections
        self._listener = socket.create_server((LOOPBACK, 0))
        self._listener.settimeout(TICK)
        self.address = f"{LOOPBACK}:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._blackholed: set[str] = set()
        self._passed = dict.fromkeys(DIRECTIONS, 0)
        self._swallowed = dict.fromkeys(DIRECTIONS, 0)
        self._links: list[_Link] = []
        self.accepted = 0
        self._stopping = threading.Event()
        self._accepter = threading.Thread(
            target=self._accept, name=f"relay-accept-{self.address}", daemon=True
        )
        self._accepter.start()

    # ---- controls --------------------------------------------------------------------------

    def blackhole(self, direction: Direction) -> None:
        """Swallows what goes ``direction`` from now on (added to what already is)."""
        with self._lock:
            self._blackholed |= set(DIRECTIONS) if direction == "both" else {direction}

    def heal(self) -> None:
        """Passes every direction again; resets the connections that lost bytes."""
        with self._lock:
            self._blackholed.clear()
            lost = [link for link in self._links if link.lost]
        for link in lost:
            link.close(reset=True)

    def cut(self) -> None:
        """Resets every relayed connection (new ones are still accepted)."""
        with self._lock:
            links = list(self._links)
        for link in links:
            link.close(reset=True)

    # ---- what went through -----------------------------------------------------------------

    def passed(self, direction: str) -> int:
        """Bytes relayed ``direction`` ("p_to_d" or "d_to_p")."""
        with self._lock:
            return self._passed[direction]

    def swallowed(self, direction: str) -> int:
        """Bytes black-holed going ``direction``."""
        with self._lock:
            return self._swallowed[direction]

    def connections(self) -> int:
        """Relayed connections open now."""
        with self._lock:
            return sum(not link.closed.is_set() for link in self._links)

    # ---- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Stops accepting, resets every connection and joins every thread. Idempotent."""
        self._stopping.set()
        self._listener.close()
        self.cut()
        self._accepter.join(timeout=2.0)
        with self._lock:
            threads = [t for link in self._links for t in link.threads]
        for thread in threads:
            thread.join(timeout=SEND_TIMEOUT + 1.0)

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *args: object) -> None:
        self.close()

    # ---- threads ---------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                d_side, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # the listener was closed
            with self._lock:
                self._links = [link for link in self._links if not link.closed.is_set()]
                full = len(self._links) >= self._max_connections
            if full:
                _reset(d_side)
                continue
            try:
                p_side = socket.create_connection(self._target, timeout=SEND_TIMEOUT)
            except OSError:
                _reset(d_side)  # P is not there: D sees the refusal as a reset
                continue
            self._start(d_side, p_side)

    def _start(self, d_side: socket.socket, p_side: socket.socket) -> None:
        for sock in (d_side, p_side):
            sock.settimeout(SEND_TIMEOUT)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        link = _Link(d_side, p_side)
        for direction in DIRECTIONS:
            link.threads.append(
                threading.Thread(
                    target=self._pump,
                    args=(link, direction),
                    name=f"relay-{direction}-{self.address}",
                    daemon=True,
                )
            )
        with self._lock:
            self._links.append(link)
            self.accepted += 1
        for thread in link.threads:
            thread.start()

    def _pump(self, link: _Link, direction: str) -> None:
        source, sink = link.sockets[direction]
        try:
            self._relay(link, direction, source, sink)
        finally:
            with link.lock:
                link.pumps_left -= 1
                both_done = link.pumps_left == 0
            if both_done:
                link.close(reset=False)

    def _relay(
        self, link: _Link, direction: str, source: socket.socket, sink: socket.socket
    ) -> None:
        while not (self._stopping.is_set() or link.closed.is_set()):
            data: bytes | None
            try:
                readable, _, _ = select.select([source], [], [], TICK)
                if not readable:
                    continue
                data = source.recv(1 << 16)
            except ConnectionResetError:
                data = None
            except (OSError, ValueError):
                data = b""  # closed under us by cut() or close()
            with self._lock:
                blackholed = direction in self._blackholed
                if blackholed and data:
                    self._swallowed[direction] += len(data)
            if blackholed:
                link.lost = True
                if data:
                    continue
                # The end of the stream is swallowed too, and with it this direction: both
                # sockets stay open, as a partition leaves them.
                self._hold(link)
                return
            if data is None:
                link.close(reset=True)
                return
            if not data:
                with contextlib.suppress(OSError):
                    sink.shutdown(socket.SHUT_WR)
                return
            try:
                sink.sendall(data)
            except OSError:
                link.close(reset=True)
                return
            with self._lock:
                self._passed[direction] += len(data)

    def _hold(self, link: _Link) -> None:
        """Keeps a black-holed link open until it is healed, cut or the relay closes."""
        while not (self._stopping.is_set() or link.closed.is_set()):
            time.sleep(TICK)


# ---- process control -------------------------------------------------------------------------


def pause(worker: RemoteWorker, timeout: float = 5.0) -> None:
    """Stops the worker's process (SIGSTOP) and waits until the kernel says it is stopped."""
    os.kill(worker.pid, signal.SIGSTOP)
    stopped = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    process = psutil.Process(worker.pid)
    if not wait_for(lambda: process.status() in stopped, timeout, interval=0.01):
        raise TimeoutError(f"worker process {worker.pid} did not stop within {timeout}s")


def resume(worker: RemoteWorker) -> None:
    """Lets a paused worker's process run again (SIGCONT)."""
    os.kill(worker.pid, signal.SIGCONT)


@contextlib.contextmanager
def paused(worker: RemoteWorker) -> Iterator[None]:
    """The worker's process is stopped inside the block and resumed on leaving it, however."""
    pause(worker)
    try:
        yield
    finally:
        resume(worker)


def rss_bytes(pid: int) -> int:
    """The resident memory of process ``pid``."""
    rss: int = psutil.Process(pid).memory_info().rss
    return rss


class PeakRss:
    """Samples a process's resident memory on a thread while the block runs; ``peak`` and
    ``baseline`` (taken on entry) in bytes."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.pid = pid
        self.interval = interval
        self.baseline = rss_bytes(pid)
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name=f"rss-{pid}", daemon=True)

    @property
    def growth(self) -> int:
        return self.peak - self.baseline

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(OSError, ValueError):
                self.peak = max(self.peak, rss_bytes(self.pid))

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *args: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)


# ---- hostile clients -------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """What a side-channel port did with one hostile connection."""

    # Everything it sent back before it closed the connection or the client gave up.
    received: bytes
    # It closed (or reset) the connection before the client gave up.
    closed: bool
    # From the client's first byte until the close, or until the client gave up.
    seconds: float

    def replies(self, secret: bytes | None) -> list[dict[str, Any]]:
        """The messages ``received`` holds, decoded (``{"kind": "error", "code": ...}``)."""
        decoder = kvpush.Decoder(secret)
        out, rest = [], self.received
        while len(rest) >= 4:
            length = 4 + struct.unpack(">I", rest[:4])[0]
            if len(rest) < length:
                break
            out.append(decoder.decode(rest[:length])["message"])
            rest = rest[length:]
        return out


def _connect(address: str) -> socket.socket:
    sock = socket.create_connection(loopback_address(address), timeout=5.0)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _drain(sock: socket.socket, started: float, wait: float, received: bytearray) -> Answer:
    """Reads until the peer closes or ``wait`` has passed since ``started``."""
    while (left := started + wait - time.monotonic()) > 0:
        readable, _, _ = select.select([sock], [], [], min(left, TICK))
        if not readable:
            continue
        try:
            data = sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            return Answer(bytes(received), True, time.monotonic() - started)
        received += data
    return Answer(bytes(received), False, time.monotonic() - started)


def _send_then_drain(address: str, payload: bytes, wait: float) -> Answer:
    with contextlib.closing(_connect(address)) as sock:
        started = time.monotonic()
        received = bytearray()
        # Closed while we were still sending: what it answered first may still be readable.
        with contextlib.suppress(OSError):
            sock.sendall(payload)
        return _drain(sock, started, min(wait, MAX_HOLD), received)


def garbage(address: str, n_bytes: int, *, seed: int = 0, wait: float = 10.0) -> Answer:
    """Sends ``n_bytes`` random bytes (at most 16 MiB) as a first "frame"; waits for the close."""
    if not 0 < n_bytes <= MAX_FRAME_BYTES:
        raise ValueError(f"n_bytes must be 1..{MAX_FRAME_BYTES}")
    return _send_then_drain(address, random.Random(seed).randbytes(n_bytes), wait)


def oversized(address: str, *, wait: float = 10.0) -> Answer:
    """Sends a length prefix one byte above the 16 MiB frame limit; waits for the close."""
    return _send_then_drain(address, struct.pack(">I", MAX_FRAME_BYTES + 1), wait)


def slowloris(address: str, seconds: float, *, interval: float = 0.1) -> Answer:
    """Drips a frame (prefix included) one byte every ``interval`` for at most ``seconds``,
    or until the port closes the connection."""
    frame = struct.pack(">I", 4096) + bytes(4096)
    seconds = min(seconds, MAX_HOLD)
    with contextlib.closing(_connect(address)) as sock:
        started = time.monotonic()
        received = bytearray()
        for byte in frame:
            if time.monotonic() - started >= seconds:
                break
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                return Answer(bytes(received), True, time.monotonic() - started)
            answer = _drain(sock, time.monotonic(), interval, received)
            if answer.closed:
                return Answer(answer.received, True, time.monotonic() - started)
        return Answer(bytes(received), False, time.monotonic() - started)


class SilentPrefixes:
    """Connections that each sent a length prefix announcing ``announced_len`` bytes and then
    nothing more. Closed by ``close()``, on leaving the ``with`` block, or after ``hold``
    seconds at the latest."""

    def __init__(
        self, address: str, connections: int, announced_len: int, hold: float = MAX_HOLD
    ) -> None:
        if not 0 < connections <= 256:
            raise ValueError("connections must be 1..256")
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        try:
            for _ in range(connections):
                sock = _connect(address)
                self._sockets.append(sock)
                sock.sendall(struct.pack(">I", announced_len))
        except BaseException:
            self.close()
            raise
        self._timer = threading.Timer(min(hold, MAX_HOLD), self.close)
        self._timer.daemon = True
        self._timer.start()

    def closed_by_peer(self) -> int:
        """How many of the connections the port has closed (or reset) so far."""
        closed = 0
        with self._lock:
            for sock in self._sockets:
                try:
                    readable, _, _ = select.select([sock], [], [], 0)
                    # Readable with no data is the end of stream; any answer is read past.
                    while readable and sock.recv(1 << 16, socket.MSG_DONTWAIT):
                        readable, _, _ = select.select([sock], [], [], 0)
                    closed += bool(readable)
                except BlockingIOError:
                    pass
                except (OSError, ValueError):
                    closed += 1
        return closed

    def close(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            sock.close()
        with contextlib.suppress(AttributeError):
            self._timer.cancel()

    def __enter__(self) -> SilentPrefixes:
        return self

    def __exit__(self, *args: object) -> None:
        self.close()


def silent_prefixes(
    address: str, connections: int, announced_len: int, hold: float = MAX_HOLD
) -> SilentPrefixes:
    """Opens ``connections`` connections that each announce an ``announced_len``-byte frame and
    stay silent; the handle closes them."""
    return SilentPrefixes(address, connections, announced_len, hold)
