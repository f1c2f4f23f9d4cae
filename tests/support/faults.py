"""Fault injection for the P/D transfer tests: a relay that partitions or cuts the side channel,
SIGSTOP/SIGCONT of a worker process and its resident memory, one thread of a worker stopped
while the others run (ptrace), and hostile clients of a side-channel port.

Everything here is bounded in time and in count, runs on threads that stop by themselves, and
only ever talks to 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import ctypes
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
from typing import Any, Literal, TypeVar

import psutil

from kvpush._native import lab
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
    _stop_process(worker.pid, timeout)


def _stop_process(pid: int, timeout: float) -> None:
    os.kill(pid, signal.SIGSTOP)
    stopped = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    process = psutil.Process(pid)
    if not wait_for(lambda: process.status() in stopped, timeout, interval=0.01):
        raise TimeoutError(f"worker process {pid} did not stop within {timeout}s")


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


F = TypeVar("F", bound="Fault")
# Longest any fault here holds (a process or a thread stopped), whatever the caller asked.
MAX_STOP = 30.0


class Fault:
    """A fault that holds from now (a process or a thread stopped, a link cut) until it ends
    after ``seconds`` by itself, or earlier by :meth:`end` (also on leaving the ``with`` block):
    bounded whatever the test does. ``started`` is when it took hold (the kernel confirmed the
    stop), ``ended`` when its end began (None until then), both ``time.monotonic()``."""

    started: float
    ended: float | None = None

    def end(self) -> None:
        raise NotImplementedError

    def __enter__(self: F) -> F:
        return self

    def __exit__(self, *args: object) -> None:
        self.end()


class TimedFault(Fault):
    """A :class:`Fault` that holds from :meth:`_hold` (the subclass's ``__init__`` calls it once
    the fault took hold) until a timer thread ends it after ``seconds``, or :meth:`end` does
    first; :meth:`_heal` undoes it, once."""

    def _hold(self, seconds: float) -> None:
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self._timer = threading.Timer(seconds, self.end)
        self._timer.daemon = True
        self._timer.start()

    def _heal(self) -> None:
        raise NotImplementedError

    def end(self) -> None:
        with self._lock:
            if self.ended is None:
                self.ended = time.monotonic()
                self._heal()
        self._timer.cancel()


class ProcessPause(TimedFault):
    """Process ``pid`` stopped (SIGSTOP) as a whole: every thread, as a VM pause or a debugger
    would; SIGCONT from a timer thread after ``seconds``."""

    def __init__(self, pid: int, seconds: float) -> None:
        if not 0 < seconds <= MAX_STOP:
            raise ValueError(f"a pause lasts 0..{MAX_STOP}s, not {seconds}")
        self.pid = pid
        _stop_process(pid, timeout=5.0)
        self._hold(seconds)

    def _heal(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)


# ---- one thread of a process (ptrace) --------------------------------------------------------
#
# A thread is stopped with ptrace(2) while its process's other threads run on: PTRACE_SEIZE
# attaches without stopping, PTRACE_INTERRUPT stops the thread wherever it is, PTRACE_DETACH lets
# it go. The kernel ties a tracee to the thread that attached it, so each stop below runs on a
# tracer thread of its own; and should that thread (or this process) end first, the kernel lets
# the tracee go. Needs root, or a tracer allowed by Yama's ptrace_scope.

# Requests, options, events and waitpid's __WALL (linux/ptrace.h, linux/wait.h).
PTRACE_CONT = 7
PTRACE_DETACH = 17
PTRACE_SYSCALL = 24
PTRACE_GETEVENTMSG = 0x4201
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_O_TRACECLONE = 0x8
PTRACE_EVENT_CLONE = 3
WALL = 0x40000000
# The kernel keeps this many characters of a thread's name (``/proc/PID/task/TID/comm``).
THREAD_NAME_CHARS = 15

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.restype = ctypes.c_long
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]


def _ptrace(request: int, tid: int, data: int = 0) -> None:
    ctypes.set_errno(0)
    if _libc.ptrace(request, tid, None, data or None) == -1 and (errno := ctypes.get_errno()):
        raise OSError(errno, f"ptrace({request:#x}) of thread {tid}: {os.strerror(errno)}")


def _event_message(tid: int) -> int:
    """PTRACE_GETEVENTMSG: for a clone event, the new thread's id."""
    message = ctypes.c_ulong()
    _ptrace(PTRACE_GETEVENTMSG, tid, ctypes.addressof(message))
    return message.value


def _wait_stopped(tid: int, deadline: float) -> int:
    """Waits (until ``deadline``) for traced thread ``tid`` to stop; its wait status."""
    while True:
        waited, status = os.waitpid(tid, WALL | os.WNOHANG)
        if waited == tid:
            if not os.WIFSTOPPED(status):
                raise ProcessLookupError(f"thread {tid} ended while it was traced")
            return status
        if time.monotonic() >= deadline:
            raise TimeoutError(f"thread {tid} did not stop in time")
        time.sleep(0.001)


def _signal_of(status: int) -> int:
    """The signal a stop withheld from the thread (0 for ptrace's own stops): handed back when the
    thread goes on, so that stopping it changes nothing else."""
    is_ptrace_stop = status >> 16 != 0 or os.WSTOPSIG(status) == signal.SIGTRAP
    return 0 if is_ptrace_stop else os.WSTOPSIG(status)


def _let_go(tid: int, withheld: int = 0) -> None:
    """Detaches from ``tid``, stopping it first if it runs (PTRACE_DETACH needs a stopped
    tracee); a thread that is gone needs nothing."""
    try:
        _ptrace(PTRACE_DETACH, tid, withheld)
        return
    except OSError:
        pass
    with contextlib.suppress(OSError, TimeoutError, ProcessLookupError, ChildProcessError):
        _ptrace(PTRACE_INTERRUPT, tid)
        withheld = _signal_of(_wait_stopped(tid, time.monotonic() + 1.0))
        _ptrace(PTRACE_DETACH, tid, withheld)


#: What reading a thread's ``/proc`` file raises once the thread ended: no such file, or, when
#: it ends between the open and the read, ESRCH.
THREAD_GONE = (FileNotFoundError, ProcessLookupError)


def thread_names(pid: int) -> dict[int, str]:
    """Process ``pid``'s threads and their names (as the kernel keeps them: 15 characters)."""
    names = {}
    for entry in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{entry}/comm", encoding="utf-8") as comm:
                names[int(entry)] = comm.read().strip()
        except THREAD_GONE:
            continue  # the thread ended meanwhile
    return names


def thread_named(pid: int, name: str, wait: float = 10.0) -> int:
    """Process ``pid``'s one thread named ``name`` (compared as far as the kernel keeps names),
    waiting up to ``wait`` seconds for it: a thread takes its name when it first runs, which a
    starved machine can put off for seconds after its spawn. LookupError, naming the threads
    there are, when there is still none or more than one."""
    deadline = time.monotonic() + wait
    while True:
        names = thread_names(pid)
        found = [tid for tid, comm in names.items() if comm == name[:THREAD_NAME_CHARS]]
        if len(found) == 1:
            return found[0]
        if time.monotonic() >= deadline:
            raise LookupError(
                f"process {pid} has {len(found)} threads named {name!r} after {wait:.0f}s: "
                f"{sorted(names.values())}"
            )
        time.sleep(0.01)


def thread_state(pid: int, tid: int) -> str:
    """The thread's state letter from ``/proc`` (``t``: stopped by its tracer), or "" if gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat", encoding="utf-8") as stat:
            return stat.read().rpartition(")")[2].split()[0]
    except THREAD_GONE:
        return ""


def _waits_on_a_lock(pid: int, tid: int) -> bool:
    """Whether the thread sleeps in a futex (a mutex, a condition variable), or is gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/wchan", encoding="utf-8") as wchan:
            return "futex" in wchan.read()
    except THREAD_GONE:
        return True


class _Tracer(Fault):
    """A :class:`Fault` whose every ptrace call runs on one thread of its own (``_trace``)."""

    def __init__(self, what: str) -> None:
        self._stopped = threading.Event()
        self._resume = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"ptrace-{what}", daemon=True)

    def _start(self, timeout: float) -> None:
        """Starts the tracer thread; returns once the stop is in place (or raises why not)."""
        self._thread.start()
        if not self._stopped.wait(timeout) and self._error is None:
            self.end()
            raise TimeoutError(f"{self._thread.name} did not stop its thread in {timeout:.0f}s")
        if self._error is not None:
            self.end()
            raise self._error

    def _run(self) -> None:
        try:
            self._trace()
        except BaseException as error:
            self._error = error
            self._stopped.set()
        finally:
            self.ended = self.ended or time.monotonic()
            self._done.set()

    def _trace(self) -> None:
        raise NotImplementedError

    def end(self) -> None:
        self._resume.set()
        if self._thread.is_alive():
            self._thread.join(timeout=MAX_STOP + 5.0)


class ThreadStall(_Tracer):
    """Thread ``name`` of process ``pid`` stopped while the process's other threads run on (its
    heartbeats, its side channel): a writer thread stuck in a transport call, or descheduled for
    seconds. Let go after ``seconds`` or at :meth:`end`."""

    def __init__(self, pid: int, name: str, seconds: float) -> None:
        if not 0 < seconds <= MAX_STOP:
            raise ValueError(f"a stall lasts 0..{MAX_STOP}s, not {seconds}")
        super().__init__(name)
        self.pid = pid
        self.tid = thread_named(pid, name)
        self.seconds = seconds
        self._start(timeout=5.0)

    def _trace(self) -> None:
        _ptrace(PTRACE_SEIZE, self.tid)
        withheld = 0
        try:
            _ptrace(PTRACE_INTERRUPT, self.tid)
            withheld = _signal_of(_wait_stopped(self.tid, time.monotonic() + 5.0))
            self.started = time.monotonic()
            self._stopped.set()
            self._resume.wait(self.seconds)
        finally:
            self.ended = time.monotonic()
            _let_go(self.tid, withheld)


class SpawnedThreadRunsFirst(_Tracer):
    """Makes one interleaving of two threads certain: thread ``name`` of process ``pid`` is held
    at its next spawn of a thread; ``then()`` runs (on the tracer thread); the new thread runs
    until it ends, while the spawner advances one system call at a time, only as far as it must
    for the new thread to get on (a lock the spawner holds across the spawn is released with a
    futex call); then the spawner goes on. Whatever the new thread does before it ends, it does
    before the spawner's next step after the spawn. ``spawned`` is the new thread's id.

    With ``by_its_child``, the spawner is instead the thread ``name`` spawns next (a worker it
    starts for the job, such as D's writer starting a connect): that child is followed from its
    birth, and it is its own spawn that is held.

    Waits at most ``seconds`` for the spawn; fails (:meth:`result`) if the new thread does not
    end within a few seconds of being let go."""

    STEP_WAIT = 0.5
    MAX_STEPS = 16

    def __init__(
        self,
        pid: int,
        name: str,
        then: Callable[[], None],
        seconds: float,
        *,
        by_its_child: bool = False,
    ) -> None:
        if not 0 < seconds <= MAX_STOP:
            raise ValueError(f"the wait for a spawn lasts 0..{MAX_STOP}s, not {seconds}")
        super().__init__(f"spawn-{name}")
        self.pid = pid
        self.tid = thread_named(pid, name)
        self.by_its_child = by_its_child
        self.seconds = seconds
        self.spawned: int | None = None
        self._then = then
        self._seized = threading.Event()
        self._thread.start()
        # Returns once the spawner is watched, so that a spawn the caller sets off next is seen
        # (a tracer thread slow to start on a loaded host would miss it); or once that failed
        # (``result`` says why). The spawner is only watched until it spawns: nothing is stopped.
        if not wait_for(lambda: self._seized.is_set() or self._done.is_set(), 5.0, 0.001):
            self.end()
            raise TimeoutError(f"{self._thread.name} did not start watching thread {self.tid}")
        self.started = time.monotonic()

    def _gone(self, tid: int) -> bool:
        return not thread_state(self.pid, tid)

    def _await_spawn(self, tid: int, deadline: float) -> int:
        """Lets traced thread ``tid`` run until it spawns a thread (held there); the new one's id
        (traced too, from its birth: the clone option is inherited)."""
        while True:
            status = _wait_stopped(tid, deadline)
            if status >> 8 == signal.SIGTRAP | PTRACE_EVENT_CLONE << 8:
                return _event_message(tid)
            # Any other stop before the spawn (a signal, a new tracee's first stop): the thread
            # goes on as it would.
            _ptrace(PTRACE_CONT, tid, _signal_of(status))

    def _trace(self) -> None:
        _ptrace(PTRACE_SEIZE, self.tid, PTRACE_O_TRACECLONE)
        self._seized.set()
        withheld = 0
        try:
            deadline = time.monotonic() + self.seconds
            if self.by_its_child:
                child = self._await_spawn(self.tid, deadline)
                # The named thread goes on untraced; its child, traced since its birth, is the
                # spawner now.
                _let_go(self.tid)
                self.tid = child
            spawned = self.spawned = self._await_spawn(self.tid, deadline)
            try:
                _wait_stopped(spawned, time.monotonic() + 5.0)
                self._stopped.set()
                self._then()
            finally:
                _let_go(spawned)
            if not wait_for(lambda: _waits_on_a_lock(self.pid, spawned), 5.0):
                raise TimeoutError(f"thread {spawned} neither ended nor waited on a lock")
            for _ in range(self.MAX_STEPS):
                if wait_for(lambda: self._gone(spawned), self.STEP_WAIT, interval=0.01):
                    return
                _ptrace(PTRACE_SYSCALL, self.tid, withheld)
                withheld = _signal_of(_wait_stopped(self.tid, time.monotonic() + 5.0))
            raise TimeoutError(
                f"thread {spawned} did not end within {self.MAX_STEPS} system calls of its spawner"
            )
        finally:
            _let_go(self.tid, withheld)
            self.ended = time.monotonic()

    def result(self, timeout: float) -> int:
        """Waits (bounded) until the spawner went on; the new thread's id, or why it failed."""
        if not self._done.wait(timeout):
            self.end()
            raise TimeoutError(f"no spawn by thread {self.tid} was seen through in {timeout:.0f}s")
        if self._error is not None:
            raise self._error
        assert self.spawned is not None
        return self.spawned


def rss_bytes(pid: int) -> int:
    """The resident memory of process ``pid``."""
    rss: int = psutil.Process(pid).memory_info().rss
    return rss


def unread_tcp_bytes(pid: int) -> int:
    """Bytes the kernel received for process ``pid``'s TCP sockets that the process has not read
    yet (their receive queues in ``/proc/PID/net/tcp``, the process's own network namespace)."""
    sockets = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                sockets.add(target[len("socket:[") : -1])
    unread = 0
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}", encoding="ascii") as rows:
            next(rows)  # the header
            for row in rows:
                fields = row.split()  # ... tx_queue:rx_queue (5th) ... inode (10th)
                if fields[9] in sockets:
                    unread += int(fields[4].partition(":")[2], 16)
    return unread


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
        decoder = lab.Decoder(secret)
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


# ---- the fence through a fault -----------------------------------------------------------------
#
# One transfer under one fault: both sides' events taken as they come and timed from the fault,
# D's whole cache watched from its final failure, then the verdict (the section "a WRITE in
# flight when P stops" of tests/two_process/test_faults.py states the terms).


class FenceBrokenError(AssertionError):
    """The fence itself failed, not the case's set-up nor a bound: bytes landed in D's cache
    after D's final failure, or D reported a final failure while P's WRITE could still land."""


@dataclass(frozen=True)
class Bounds:
    """What a case allows, in seconds, the 1 s of slack included. ``d``: from the fault's start
    to D's first event, and from its end to D's final one; ``p``: from when P runs again to its
    send event; ``watch``: how long D's cache is watched after both D's final failure and the
    fault's end."""

    d: float
    p: float
    watch: float


@dataclass
class Seen:
    """An event, and when its endpoint reported it (the worker's ``at``): seconds after the
    fault started (P's send event: after P ran again)."""

    event: dict[str, Any]
    at: float

    @property
    def outcome(self) -> str:
        return str(self.event["outcome"])

    def __str__(self) -> str:
        return f"{self.outcome} {self.at:.1f}s"


class Outcomes:
    """Both sides' events for one transfer under ``fault``, taken as they come (D's worker
    snapshots its cache at a final failure as it takes the event). ``stops_p``: the fault stops
    P (its process or its writer), which then runs again at the fault's end, and its events are
    taken only from then on (a stopped process would not answer); else P runs throughout."""

    def __init__(self, p: Any, d: Any, fault: Fault, *, stops_p: bool) -> None:
        self.p, self.d, self.fault, self.stops_p = p, d, fault, stops_p
        self.received: list[Seen] = []
        self.sent: Seen | None = None

    def since_fault(self) -> float:
        return time.monotonic() - self.fault.started

    def ended_at(self) -> float:
        """When the fault ended, or (while it lasts) the latest it can."""
        return self.fault.ended or self.fault.started + MAX_STOP

    def p_runs_since(self) -> float | None:
        """Since when P runs (None while the fault stops it)."""
        return self.fault.ended if self.stops_p else self.fault.started

    @property
    def final(self) -> Seen | None:
        """D's final event (done, failed or cancelled), if it came."""
        return next((seen for seen in self.received if seen.outcome != "quarantined"), None)

    def take(self) -> None:
        """One round (at most 0.1 s): D's events, then P's."""
        for event in self.d.events(1, timeout=0.05):
            self.received.append(Seen(event, event["at"] - self.fault.started))
        running = self.p_runs_since()
        if running is not None and self.sent is None:
            for event in self.p.events(1, timeout=0.05):
                self.sent = Seen(event, event["at"] - running)

    def until(self, done: Callable[[], bool], deadline: Callable[[], float]) -> bool:
        """Takes events until ``done()`` (True) or ``deadline()`` (a monotonic time) passes."""
        while not done():
            if time.monotonic() >= deadline():
                return False
            self.take()
        return True


def fenced_through(
    outcomes: Outcomes,
    request_id: str,
    bounds: Bounds,
    row: dict[str, Any],
    delivered_whole: Callable[[], bool],
    *,
    end_fault_after_d: float | None = None,
) -> None:
    """The fence and the bounds for transfer ``request_id`` under ``outcomes.fault``, the
    canary asserted first; fills the case's report ``row`` (columns d, p, canary) as it goes.
    ``end_fault_after_d``: the fault ends this long after D's first event (else by itself).

    D's events: at most one ``quarantined`` notice, then one final event. A final failure (or
    cancel) starts the canary: no byte of D's whole cache changes until ``bounds.watch`` after
    both it and the fault's end. A final done must have P's bytes (``delivered_whole``), and a
    final failure must not be done on P."""
    started = outcomes.fault.started
    came = outcomes.until(lambda: bool(outcomes.received), lambda: started + bounds.d)
    assert came, f"D reported nothing within {bounds.d:.0f}s of the fault"
    if end_fault_after_d is not None:
        end = started + outcomes.received[0].at + end_fault_after_d
        outcomes.until(lambda: False, lambda: end)
        outcomes.fault.end()
    outcomes.until(lambda: outcomes.final is not None, lambda: outcomes.ended_at() + bounds.d)
    row["d"] = ", then ".join(str(seen) for seen in outcomes.received)
    final = outcomes.final
    assert final is not None, (
        f"D's receive stayed {outcomes.received[0].outcome} past {bounds.d:.0f}s after the "
        "fault ended"
    )
    landed = _watch_canary(outcomes, request_id, final, bounds.watch, row)

    def p_deadline() -> float:
        return (outcomes.p_runs_since() or outcomes.ended_at()) + bounds.p

    outcomes.until(lambda: outcomes.sent is not None, p_deadline)
    sent = outcomes.sent
    row["p"] = f"{sent} after it ran again" if sent and outcomes.stops_p else str(sent)
    ended = outcomes.ended_at() - started
    if landed:
        raise FenceBrokenError(
            f"bytes landed in D's cache after D reported receive {request_id} {final.outcome} "
            f"{final.at:.1f}s after the fault (which ended at {ended:.1f}s): {landed}"
        )
    assert sent is not None, f"P reported no outcome within {bounds.p:.0f}s of running again"
    kinds = [seen.outcome for seen in outcomes.received]
    assert kinds in ([final.outcome], ["quarantined", final.outcome]), (
        f"D's events for one receive: {kinds} (at most one notice, then one final event)"
    )
    first = outcomes.received[0]
    assert first.at <= bounds.d, (
        f"D's first event came {first.at:.1f}s after the fault (bound {bounds.d:.0f}s)"
    )
    assert final.at <= ended + bounds.d, (
        f"D's final event came {final.at:.1f}s after the fault, which ended at {ended:.1f}s "
        f"(bound {bounds.d:.0f}s after)"
    )
    if final.outcome == "done":
        assert delivered_whole(), "D reported the receive done without P's bytes, whole"
    else:
        assert final.outcome in ("failed", "cancelled"), final.event
        assert sent.outcome != "done", "P reports a transfer delivered that D reported failed"
    assert wait_for(lambda: outcomes.p.pending() == 0, bounds.d), "P kept the transfer's entry"
    assert outcomes.d.events(1, timeout=0.5) == [], "D reported the receive again"


def _watch_canary(
    outcomes: Outcomes, request_id: str, final: Seen, watch: float, row: dict[str, Any]
) -> str:
    """After a final failure ``final``: watches D's cache against its snapshot at that event
    until ``watch`` after both the event and the fault's end (P may write until it runs again,
    and then until its write is over), taking both sides' events meanwhile. "" when no byte
    changed, else how many did and when."""
    if final.outcome == "done":
        return ""
    first_seen, changed = 0.0, 0

    def watched() -> bool:
        ended = outcomes.fault.ended
        return (
            ended is not None
            and time.monotonic() >= max(outcomes.fault.started + final.at, ended) + watch
        )

    while not watched():
        outcomes.take()
        now = outcomes.d.changed_since_failure(request_id)
        if now and not changed:
            first_seen = outcomes.since_fault()  # as the test saw it: as late as its polling
        changed = max(changed, now)
    row["canary"] = f"{changed:,} B changed, from {first_seen:.1f}s" if changed else "unchanged"
    return f"{changed:,} bytes, the first seen {first_seen:.1f}s after the fault" if changed else ""
