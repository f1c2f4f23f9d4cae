"""The two-process peer of kvpush's tests and benchmarks: a P or D worker in its own process.

:class:`RemoteWorker` runs a worker class in a spawned process and drives it over a pipe, one
command (a public method of the worker) at a time, every wait bounded; the tests' transfers, the
fault tests, the data-path benchmark (:mod:`kvpush_lab.bench.worker`) and ``scripts/gpu-check``
all go through it.

:class:`Worker` is the tests' worker: a paged KV cache (:mod:`kvpush_lab.cache`) and its kvpush
endpoint, driven through the same commands whether it runs in this process (loopback transport)
or in its own (NIXL over UCX on loopback). The benchmark's worker is this one with options (its
fill, names and heartbeats) and a plain NIXL agent added."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

import kvpush
from kvpush_lab.cache import SENTINEL_WORD, CacheShape, PagedCache, Request, expected_destination

#: The tests' endpoints: heartbeats every 0.2 s and a peer lost after 2 s of silence, so that a
#: fault is seen in seconds (``Worker.fast_peer_loss``; the benchmark keeps the endpoint's own).
FAST_PEER_LOSS = {"heartbeat_interval": 0.2, "peer_timeout": 2.0}


def event_dict(event: kvpush.TransferEvent) -> dict[str, Any]:
    """The event as plain data (codes, not members): it crosses processes and goes into JSON."""
    return {
        "role": event.role.value,
        "request_id": event.request_id,
        "key": event.key,
        "outcome": event.outcome.value,
        "reason": event.reason,
        "code": event.code.value if event.code is not None else None,
        "bytes": event.bytes,
        "runs": event.runs,
        "streamed_bytes": event.streamed_bytes,
        "timeline": dict(event.timeline),
    }


@dataclass
class Worker:
    """One worker: its cache and its endpoint. Methods are the commands the tests send.

    ``seed`` fills the cache with P's bytes, else every word is ``fill`` (the sentinel). The
    endpoint is ``engine`` (``<role>-engine``) of ``compatibility``, with the tests' heartbeats
    unless ``fast_peer_loss`` is false; ``options`` (Endpoint keyword arguments: ``write_timeout``,
    ``agent_name``, ...) replace those defaults."""

    role: str
    shape: CacheShape
    seed: int | None
    transport: str
    secret: bytes | None = None
    options: dict[str, Any] = field(default_factory=dict)
    fill: int = SENTINEL_WORD
    engine: str | None = None
    compatibility: str = "test-model"
    fast_peer_loss: bool = True
    cache: PagedCache = field(init=False)
    endpoint: kvpush.Endpoint = field(init=False)
    # D's whole cache as it was when each receive failed or was cancelled (see ``events``).
    at_failure: dict[str, np.ndarray] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.cache = PagedCache(self.shape, self.seed, self.fill)
        options: dict[str, Any] = {
            **(FAST_PEER_LOSS if self.fast_peer_loss else {}),
            "agent_name": f"{self.role}-{id(self):x}",
            **self.options,
        }
        self.endpoint = kvpush.Endpoint(
            self.engine or f"{self.role}-engine",
            self.cache.layout(),
            memory=self.cache.memory(),
            transport=self.transport,
            secret=self.secret,
            compatibility=self.compatibility,
            **options,
        )

    @property
    def pid(self) -> int:
        """The process the worker's endpoint runs in."""
        return os.getpid()

    def address(self) -> str:
        return self.endpoint.address

    def ready(self, requests: list[Request], ttl: float = 30.0) -> list[str]:
        """Reports each request's KV ready; returns the errors of refused ones."""
        errors = []
        for r in requests:
            try:
                self.endpoint.ready(
                    r.request_id, [list(r.p_blocks)], r.tokens, transfer_id=r.transfer_id, ttl=ttl
                )
            except kvpush.exceptions.KvPushError as error:
                errors.append(f"{error.code}: {error}")
        return errors

    def layers_ready(self, requests: list[Request], start: int, end: int) -> list[str]:
        """Layer-wise push: regions ``start..end`` of each request's KV are final; returns the
        errors of refused ones."""
        errors = []
        for r in requests:
            try:
                self.endpoint.layers_ready(
                    r.request_id, [list(r.p_blocks)], r.tokens, start, end,
                    transfer_id=r.transfer_id,
                )  # fmt: skip
            except kvpush.exceptions.KvPushError as error:
                errors.append(f"{error.code}: {error}")
        return errors

    def expect(
        self, source: str, requests: list[Request], ttl: float = 30.0, request_suffix: str = ""
    ) -> None:
        for r in requests:
            self.endpoint.expect(
                r.request_id + request_suffix,
                source,
                [list(r.d_blocks)],
                r.tokens,
                transfer_id=r.transfer_id,
                first_tokens=[r.d_first],
                ttl=ttl,
            )

    def abort(self, request: Request) -> kvpush.AbortOutcome:
        return self.endpoint.abort(request.request_id, request.transfer_id)

    def cancel(self, request_id: str) -> None:
        self.endpoint.cancel(request_id)

    def endpoint_expect(
        self,
        request_id: str,
        source: str,
        blocks: list[int],
        tokens: int,
        transfer_id: str | None,
        epoch: int,
    ) -> None:
        """One registration as given (any epoch and transfer id): plays an intruding D."""
        self.endpoint.expect(
            request_id, source, [blocks], tokens, transfer_id=transfer_id, epoch=epoch
        )

    def cache_digest_and_close(self) -> str:
        digest = self.cache_digest()
        self.close()
        return digest

    def events(self, count: int, timeout: float, *, snapshot: bool = True) -> list[dict[str, Any]]:
        """Waits (bounded) until ``count`` events arrived; returns all that did.

        A receive that failed or was cancelled (a final event: D hands its blocks back) snapshots
        the whole cache as it takes the event, so that :meth:`changed_since_failure` can tell
        whether any byte landed after it (unless ``snapshot`` is false: soaks, which take
        thousands of such events). A ``quarantined`` notice is no such event: D keeps the
        blocks, and P's bytes may still land in them. Each event's ``at`` is when the endpoint
        reported it (its ``completed`` time, else when it was taken), on the host's monotonic
        clock (``time.monotonic()`` in any process)."""
        deadline = time.monotonic() + timeout
        out: list[dict[str, Any]] = []
        while len(out) < count and time.monotonic() < deadline:
            for e in self.endpoint.wait(0.05):
                # The endpoint's clock (``timeline``) starts here on the host's monotonic clock.
                origin = time.monotonic() - self.endpoint.clock()
                if snapshot and e.role == "receive" and e.outcome in ("failed", "cancelled"):
                    self.at_failure[e.request_id] = self.cache_copy()
                event = event_dict(e)
                completed = e.timeline.get("completed")
                event["at"] = origin + completed if completed is not None else time.monotonic()
                out.append(event)
        return out

    def done(self, request_id: str, timeout: float) -> dict[str, Any]:
        """Waits (bounded) for ``request_id``'s event, which must be done (RuntimeError if it is
        not, TimeoutError if none came); events of other requests taken meanwhile are dropped."""
        deadline = time.monotonic() + timeout
        while True:
            for event in self.endpoint.wait(0.05):
                if event.request_id != request_id:
                    continue
                if event.outcome != "done":
                    raise RuntimeError(
                        f"kvpush transfer {request_id} on {self.role}: {event.outcome} "
                        f"({event.reason})"
                    )
                return event_dict(event)
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvpush transfer {request_id}: no event in {timeout:.0f} s")

    def cache_digest(self) -> str:
        """sha256 of the whole cache's bytes: a canary that any write changes."""
        return self.cache.digest()

    def cache_copy(self) -> np.ndarray:
        """The whole cache's bytes, copied."""
        return self.cache.copy()

    def changed_since_failure(self, request_id: str) -> int:
        """Bytes of the whole cache that differ from its snapshot at ``request_id``'s failure
        event (taken by :meth:`events`; KeyError if the receive did not fail)."""
        return self.cache.changed_since(self.at_failure[request_id])

    def landed(self, stride: int = 1) -> int:
        """Bytes of the cache unlike the sentinel an empty cache holds: what P's WRITEs landed so
        far (P's bytes that equal the sentinel, 1 in 256, are not counted). ``stride`` samples
        every stride-th byte and scales the count: a probe cheap enough to poll mid-WRITE."""
        return self.cache.landed(stride)

    def blocks_digest(self, blocks: list[int]) -> str:
        """sha256 of ``blocks``, in the order given, in every layer and K/V: the same on P and D
        when D's blocks hold P's whole (caches of one block size), whatever their size."""
        return self.cache.blocks_digest(blocks)

    def verify(self, p_shape: CacheShape, p_seed: int, requests: list[Request]) -> dict[str, int]:
        """Compares D's whole cache with the per-token copy of ``requests``."""
        expected = expected_destination(p_shape, p_seed, self.shape, requests)
        actual = self.cache.array.view(np.uint8)
        wrong = actual != expected.view(np.uint8)
        return {"bytes": int(actual.size), "wrong": int(wrong.sum())}

    def stats(self) -> dict[str, int]:
        return self.endpoint.stats()

    def write_horizon(self) -> float:
        return self.endpoint.write_horizon

    def health(self) -> str | None:
        """None while the endpoint is healthy, else why not."""
        return self.endpoint.health()

    def pending(self) -> int:
        return self.endpoint.pending

    def close(self) -> None:
        self.endpoint.close()


#: A worker process whose environment names a network namespace (``ip netns`` name) enters it
#: before anything opens a socket: P and D then run as two hosts (tests/two_process/test_netns.py).
NETNS_ENV = "KVPUSH_TEST_NETNS"


def enter_netns(name: str) -> None:
    """Moves this process (its calling thread, before any other starts) into netns ``name``, as
    ``ip netns exec`` does: the network namespace, and a private /sys that shows its devices
    (UCX finds network devices there)."""
    import ctypes
    import os

    clone_newnet, clone_newns = 0x40000000, 0x00020000
    ms_rec, ms_slave, mnt_detach = 0x4000, 0x80000, 2
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what} for network namespace {name}: {os.strerror(errno)}")

    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        check(libc.setns(fd, clone_newnet), "setns")
    finally:
        os.close(fd)
    check(libc.unshare(clone_newns), "unshare(CLONE_NEWNS)")
    check(libc.mount(None, b"/", None, ms_rec | ms_slave, None), "mount --make-rslave /")
    check(libc.umount2(b"/sys", mnt_detach), "umount /sys")
    check(libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None), "mount sysfs")


def _answer(connection: Connection, status: str, value: Any) -> bool:
    """Sends one reply; False when the driving process has gone (it gave up or was killed)."""
    try:
        connection.send((status, value))
    except OSError:
        return False
    return True


def _serve(
    connection: Connection, kwargs: dict[str, Any], env: dict[str, str], worker_class: type
) -> None:
    """A worker process: runs the commands from the pipe until "close" or a closed pipe.

    The start-up reply is the worker's ``hello()`` where it has one (what its peer needs to
    connect), else its ``address()``. A command is a public method of the worker."""
    # Before the worker exists: UCX reads its environment when the endpoint's context is made.
    os.environ.update(env)
    try:
        if env.get(NETNS_ENV):
            enter_netns(env[NETNS_ENV])
        worker = worker_class(**kwargs)
        hello = worker.hello() if hasattr(worker, "hello") else worker.address()
    except BaseException:
        _answer(connection, "error", traceback.format_exc())
        return
    if not _answer(connection, "ok", hello):
        worker.close()
        return
    while True:
        try:
            name, args, kwargs = connection.recv()
        except (EOFError, OSError):
            worker.close()
            return
        try:
            if name.startswith("_"):
                raise ValueError(f"{name!r} is not a command of {worker_class.__name__}")
            status, value = "ok", getattr(worker, name)(*args, **kwargs)
        except BaseException:
            status, value = "error", traceback.format_exc()
        answered = _answer(connection, status, value)
        if name == "close":
            return
        if not answered:
            worker.close()
            return


class PeerError(RuntimeError):
    """A worker process failed a command, exited, or did not answer in time."""


class RemoteWorker:
    """A worker in its own process (spawned: nothing inherited), driven over a pipe; every wait
    bounded. The worker is a :class:`Worker` or another ``worker_class`` defined at a module's
    top level, built from ``kwargs`` in the child after ``env`` is applied; each of its public
    methods is a command. ``peer.ready(...)`` sends one and waits (``command_wait`` seconds at
    most) for its answer; :meth:`post` and :meth:`reply` split the two, so that both sides of a
    transfer can run at once. ``wait=None`` leaves the start-up reply (:attr:`hello`) to
    :meth:`started`."""

    def __init__(
        self,
        env: dict[str, str] | None = None,
        worker_class: Any = Worker,
        *,
        name: str = "worker",
        wait: float | None = 60.0,
        command_wait: float = 60.0,
        **kwargs: Any,
    ) -> None:
        self.name = name
        self.command_wait = command_wait
        context = mp.get_context("spawn")
        self._connection, child = context.Pipe()
        self._process = context.Process(
            target=_serve,
            args=(child, kwargs, env or {}, worker_class),
            name=f"kvpush-{name}",
            daemon=True,
        )
        self._process.start()
        child.close()  # so a dead worker reads as EOF here, not as silence
        self._hello: Any = None
        self._started = False
        if wait is not None:
            self.started(wait)

    def started(self, wait: float = 60.0) -> Any:
        """Waits (bounded) for the worker to start; returns its :attr:`hello`."""
        if not self._started:
            self._hello = self.reply(wait, "start-up")
            self._started = True
        return self._hello

    @property
    def hello(self) -> Any:
        """The worker's start-up reply: its ``hello()``, or its ``address()``."""
        return self.started()

    def address(self) -> str:
        return str(self.hello)

    @property
    def pid(self) -> int:
        """The worker process, for signals and ``/proc`` (it is started by ``__init__``)."""
        pid = self._process.pid
        assert pid is not None, "the worker process was never started"
        return pid

    def post(self, command: str, /, *args: Any, **kwargs: Any) -> None:
        """Sends ``command`` without waiting for its answer (:meth:`reply` takes it)."""
        self._connection.send((command, args, kwargs))

    def reply(self, wait: float = 60.0, doing: str = "a command") -> Any:
        """The answer to the oldest command not yet answered; :class:`PeerError` if the worker
        failed it, exited, or did not answer within ``wait`` seconds."""
        if not self._connection.poll(wait):
            raise PeerError(
                f"{self.name} did not finish {doing} within {wait:.0f} s (stuck?); giving up"
            )
        try:
            status, value = self._connection.recv()
        except EOFError:
            self._process.join(timeout=5.0)
            raise PeerError(
                f"{self.name} exited (code {self._process.exitcode}) during {doing}"
            ) from None
        if status == "error":
            raise PeerError(f"{self.name} failed during {doing}:\n{value}")
        return value

    def call(self, command: str, wait: float, doing: str, /, *args: Any, **kwargs: Any) -> Any:
        """Sends ``command`` and waits (at most ``wait`` seconds) for its answer."""
        self.post(command, *args, **kwargs)
        return self.reply(wait, doing)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            return self.call(name, self.command_wait, name, *args, **kwargs)

        return call

    def kill(self) -> None:
        """Ends the process abruptly, as a crash would."""
        self._process.kill()
        self._process.join(timeout=10.0)

    def close(self, wait: float = 15.0) -> None:
        """Closes the worker (its own ``close``), then joins it, killed if it will not end.
        Answers still owed for commands given up on are read and dropped."""
        try:
            if self._process.is_alive():
                self.post("close")
                deadline = time.monotonic() + wait
                while self._process.is_alive() and time.monotonic() < deadline:
                    if self._connection.poll(0.1):
                        self._connection.recv()
        except (EOFError, OSError):
            pass
        finally:
            self._connection.close()
            self._process.join(timeout=10.0)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(timeout=5.0)
