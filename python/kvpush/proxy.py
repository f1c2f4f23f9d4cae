"""``kvpush proxy``: an OpenAI-compatible router for disaggregated prefill (P) / decode (D).

Owns the push router contract (vLLM's push demo proxy, reference §2.2), which kvpush's connector
reads: every request goes out as two legs *at once*, with one ``X-Request-Id`` and one
``transfer_id``:

* the **P leg** is the client's body with ``max_tokens=1`` (and ``max_completion_tokens=1``
  when present), ``stream=false`` and ``kv_transfer_params={"do_remote_decode": true,
  "do_remote_prefill": false, "transfer_id": T}``; its answer is drained and discarded;
* the **D leg** is the client's body (streaming as the client asked) with
  ``kv_transfer_params`` naming P's coordinates (engine id, side channel host and port, TP,
  PP), the request id and ``T``; its answer goes to the client as it comes.

A leg that fails aborts the other at once: its upstream connection is closed, which vLLM takes
for the client going away and aborts the request, so neither side works, or holds KV for its
lease, for a request that is already lost. P failing before D's answer has begun is a 502
naming the prefill leg. D's answer begins with its first body byte (a D waiting for P's KV
cannot send one before the KV is there); from then on D wins and P's failure is only logged.
A D that cannot be reached is a 502 naming D; a D error is passed back as D sent it (P is
aborted either way). A client that hangs up while the legs run aborts both: one watcher thread
polls the clients of the requests in flight, so a non-streaming client's hang-up is noticed
before D has decoded the whole answer, not when the proxy next writes.

Everything a client can make the proxy hold is bounded: a request body is read only as its
framing says and never past :data:`MAX_BODY_BYTES` (413 when larger, 400 when malformed, 411
without a length); at most ``max_connections`` clients are served at once (one over the cap
gets a prompt 503 with ``Retry-After`` and no thread); every socket has a bounded timeout
(:class:`Timeouts`).

P and D instances are chosen round-robin, independently. Standard library only (kvpush has no
runtime dependencies): :class:`http.server.ThreadingHTTPServer` for clients (a named thread per
connection, up to the cap), one :class:`http.client.HTTPConnection` per leg, a thread for P's
leg.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import enum
import http.client
import json
import logging
import select
import signal
import socket
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Generic, TypeVar, cast

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_CONNECTIONS",
    "PrefillInstance",
    "ProxyServer",
    "Timeouts",
    "add_arguments",
    "decode_body",
    "main",
    "parse_prefill",
    "prefill_body",
    "run",
]

logger = logging.getLogger("kvpush.proxy")

JSON = dict[str, Any]
_T = TypeVar("_T")

ERROR_TYPE = "kvpush_proxy_error"
MAX_BODY_BYTES = 64 << 20
"""The largest request body accepted, whatever its framing (Content-Length or chunked)."""
MAX_CONNECTIONS = 1024
"""Default cap on concurrent client connections (each holds a thread, and one more for P)."""
_RELAY_BYTES = 64 << 10
# A chunked body's size lines, extensions and trailers: each line, and all of them together.
_MAX_CHUNK_LINE_BYTES = 1024
_MAX_CHUNK_FRAMING_BYTES = 1 << 20
_HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")
# A client turned away at the cap is told when to come back, and its connection is closed only
# once it has read the 503 (or after this long), so that closing does not reset the answer away.
_RETRY_AFTER_S = 1
_TURNED_AWAY_LINGER_S = 2.0
_MAX_TURNED_AWAY_LINGERING = 64
# Per-connection headers (RFC 9110 §7.6.1) and those BaseHTTPRequestHandler writes itself.
_NOT_RELAYED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "content-length",
        "server",
        "date",
    }
)
# Client headers the legs need too (vLLM's --api-key).
_FORWARDED = ("Authorization",)


# --- configuration ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Upstream:
    """One P or D server's HTTP address, parsed once."""

    url: str
    scheme: str
    host: str
    port: int
    base_path: str

    @classmethod
    def parse(cls, url: str) -> _Upstream:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r}: expected an http:// or https:// URL with a host")
        try:
            port = parts.port
        except ValueError as error:
            raise ValueError(f"{url!r}: {error}") from None
        default = 443 if parts.scheme == "https" else 80
        return cls(url, parts.scheme, parts.hostname, port or default, parts.path.rstrip("/"))

    def connection(self, timeout_s: float) -> http.client.HTTPConnection:
        if self.scheme == "https":
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout_s)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)


@dataclass(frozen=True)
class PrefillInstance:
    """One P server and the coordinates D's connector needs to reach P (all known up front).

    ``engine_id`` is the ``engine_id`` in P's ``--kv-transfer-config``; ``side_channel_host``
    and ``side_channel_port`` are P's ``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT``; ``tp`` and
    ``pp`` are P's tensor- and pipeline-parallel sizes (D waits for ``pp`` stages' writes).
    """

    url: str
    engine_id: str
    side_channel_host: str
    side_channel_port: int
    tp: int = 1
    pp: int = 1
    _upstream: _Upstream = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.engine_id:
            raise ValueError(f"prefill {self.url}: engine_id is empty")
        if not self.side_channel_host:
            raise ValueError(f"prefill {self.url}: side channel host is empty")
        if not 0 < self.side_channel_port < 65536:
            raise ValueError(f"prefill {self.url}: side channel port {self.side_channel_port}")
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"prefill {self.url}: tp={self.tp} pp={self.pp} must be >= 1")
        object.__setattr__(self, "_upstream", _Upstream.parse(self.url))


def parse_prefill(spec: str) -> PrefillInstance:
    """``URL,engine_id=ID,side_channel=HOST:PORT[,tp=N][,pp=N]`` (the ``--prefill`` syntax)."""
    url, *options = (part.strip() for part in spec.split(","))
    values: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in ("engine_id", "side_channel", "tp", "pp"):
            raise ValueError(
                f"--prefill {spec!r}: unknown option {option!r} "
                "(expected engine_id=, side_channel=, tp=, pp=)"
            )
        values[key] = value
    for required in ("engine_id", "side_channel"):
        if required not in values:
            raise ValueError(f"--prefill {spec!r}: {required}= is required")
    host, sep, port = values["side_channel"].rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--prefill {spec!r}: side_channel must be HOST:PORT")
    try:
        tp, pp = int(values.get("tp", "1")), int(values.get("pp", "1"))
    except ValueError:
        raise ValueError(f"--prefill {spec!r}: tp and pp must be integers") from None
    return PrefillInstance(url, values["engine_id"], host.strip("[]"), int(port), tp=tp, pp=pp)


@dataclass(frozen=True)
class Timeouts:
    """Bounds, in seconds, on every socket the proxy uses.

    ``prefill_s`` is how long P may take to answer (its whole prompt's prefill); ``decode_s``
    bounds each wait on D: for its first byte (a non-streaming D answers only when done) and
    between two streamed chunks. ``client_s`` bounds reads from and writes to the client
    (including an idle keep-alive connection).
    """

    connect_s: float = 5.0
    prefill_s: float = 600.0
    decode_s: float = 600.0
    client_s: float = 600.0


# --- the legs' bodies ------------------------------------------------------------------------


def prefill_body(body: JSON, transfer_id: str) -> JSON:
    """P's leg: one token, not streamed; P pushes the prompt's KV to whichever D registers."""
    leg = dict(body)
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg["stream"] = False
    # vLLM refuses stream_options without stream, and min_tokens above max_tokens.
    leg.pop("stream_options", None)
    leg.pop("min_tokens", None)
    leg["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": transfer_id,
    }
    return leg


def decode_body(body: JSON, prefill: PrefillInstance, request_id: str, transfer_id: str) -> JSON:
    """D's leg: the client's request, plus where P is and which transfer to wait for."""
    leg = dict(body)
    leg["kv_transfer_params"] = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": prefill.engine_id,
        "remote_host": prefill.side_channel_host,
        "remote_port": prefill.side_channel_port,
        "tp_size": prefill.tp,
        "pp_size": prefill.pp,
        "remote_request_id": request_id,
        "transfer_id": transfer_id,
    }
    return leg


# --- one leg's connection --------------------------------------------------------------------


class _LegAbortedError(OSError):
    """The leg was aborted (by the other leg's failure, the client hanging up, or the proxy
    stopping)."""


class _Leg:
    """One upstream HTTP exchange that another thread may abort at any point.

    ``abort`` shuts the socket down, which wakes a thread blocked sending to or reading from
    it, and which the upstream sees as the client going away (vLLM then aborts the request).
    """

    def __init__(self, upstream: _Upstream, timeouts: Timeouts, read_timeout_s: float) -> None:
        self.upstream = upstream
        self._read_timeout_s = read_timeout_s
        self._conn = upstream.connection(timeouts.connect_s)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._aborted = False

    def exchange(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> http.client.HTTPResponse:
        """Connect (bounded by ``connect_s``), send, and wait for the response's head."""
        self._conn.connect()
        sock = self._conn.sock
        assert sock is not None  # connect() sets it or raises
        sock.settimeout(self._read_timeout_s)
        with self._lock:
            if self._aborted:
                raise _LegAbortedError(f"{self.upstream.url}: aborted")
            self._sock = sock
        self._conn.request(method, self.upstream.base_path + path, body=body, headers=headers)
        return self._conn.getresponse()

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    @property
    def aborted(self) -> bool:
        with self._lock:
            return self._aborted

    def close(self) -> None:
        self._conn.close()


def _failure(error: BaseException, timeout_s: float) -> str:
    if isinstance(error, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    return f"{type(error).__name__}: {error}"


def _error_detail(payload: bytes) -> str:
    """The ``message`` of an OpenAI-style error body, else its start."""
    text = payload.decode("utf-8", "replace")
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        error = json.loads(text)["error"]
        text = str(error["message"] if isinstance(error, dict) else error)
    text = " ".join(text.split())
    return text[:300] + ("…" if len(text) > 300 else "")


# --- one request -----------------------------------------------------------------------------


class _Cause(enum.Enum):
    """What ended a request before D's answer was complete; the first one to happen decides."""

    PREFILL = "prefill leg failed"
    DECODE = "decode leg failed"
    CLIENT = "client hung up"
    STOPPING = "proxy stopping"


class _Exchange:
    """One client request's two legs, and the single decision of what ends it.

    The first of these, under one lock, decides what the client gets: D's answer begins (its
    first body byte), P's leg fails, D's leg fails, the client hangs up, the proxy stops. A
    failure that comes first aborts the legs still running, so that no leg goes on for a
    request that is lost; P's failure after D's answer began is only logged. The log line is
    written when both legs have finished.
    """

    def __init__(
        self, method: str, path: str, prefill: PrefillInstance, decode: _Leg, timeouts: Timeouts
    ) -> None:
        self.request_id = str(uuid.uuid4())
        self.transfer_id = str(uuid.uuid4())
        self.method, self.path = method, path
        self.prefill = prefill
        self.prefill_leg = _Leg(prefill._upstream, timeouts, timeouts.prefill_s)
        self.prefill_timeout_s = timeouts.prefill_s
        self.decode_leg = decode
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._decode_answered = False
        self._first_failure: _Cause | None = None
        self._legs_open = 2
        self.prefill_error: str | None = None
        self.prefill_status: int | None = None
        self.prefill_s = 0.0
        self.decode_status: int | None = None
        self.decode_first_s: float | None = None
        self.decode_error: str | None = None
        self.client_status: int | None = None
        self.client_note = ""

    def prefill_finished(self, status: int | None, error: str | None) -> None:
        with self._lock:
            self.prefill_status, self.prefill_error = status, error
            self.prefill_s = time.monotonic() - self.started
            fails_first = (
                error is not None and not self._decode_answered and self._first_failure is None
            )
            if fails_first:
                self._first_failure = _Cause.PREFILL
        if fails_first:
            self.decode_leg.abort()
        self._leg_done()

    def decode_head(self, status: int) -> None:
        with self._lock:
            self.decode_status = status
            self.decode_first_s = time.monotonic() - self.started

    def decode_answered(self) -> _Cause | None:
        """D's answer began: None if D answers the client, else the failure that came first."""
        with self._lock:
            if self._first_failure is None:
                self._decode_answered = True
            return self._first_failure

    def fail(self, cause: _Cause) -> _Cause:
        """``cause`` ends the request unless an earlier failure did; returns the one that did.

        The first failure aborts P's leg (D failing means nobody takes P's KV), and D's leg
        unless D's own failure is the cause (its error answer is still to be relayed).
        """
        with self._lock:
            first = self._first_failure is None
            if first:
                self._first_failure = cause
            decided = cast(_Cause, self._first_failure)
        if first:
            self.prefill_leg.abort()
            if cause is not _Cause.DECODE:
                self.decode_leg.abort()
        return decided

    def client_hung_up(self) -> None:
        self.fail(_Cause.CLIENT)

    def abort(self) -> None:
        self.fail(_Cause.STOPPING)

    def decode_finished(self, client_status: int | None, note: str = "") -> None:
        self.client_status, self.client_note = client_status, note
        self._leg_done()

    def _leg_done(self) -> None:
        with self._lock:
            self._legs_open -= 1
            last = self._legs_open == 0
        if last:
            self._log()

    def _log(self) -> None:
        total = time.monotonic() - self.started
        p = f"prefill {self.prefill.url} {self.prefill_status or '-'} {self.prefill_s:.3f} s" + (
            f" FAILED {self.prefill_error}" if self.prefill_error else ""
        )
        first = "-" if self.decode_first_s is None else f"{self.decode_first_s:.3f} s"
        d = f"decode {self.decode_leg.upstream.url} {self.decode_status or '-'} first byte {first}"
        if self.decode_error:
            d += f" FAILED {self.decode_error}"
        failed = (
            self._first_failure is not None
            or self.prefill_error
            or self.decode_error
            or (self.client_status or 0) >= 400
        )
        logger.log(
            logging.WARNING if failed else logging.INFO,
            "request %s transfer %s %s %s -> %s%s | %s | %s | %.3f s",
            self.request_id,
            self.transfer_id,
            self.method,
            self.path,
            self.client_status or "-",
            f" ({self.client_note})" if self.client_note else "",
            p,
            d,
            total,
        )


def _run_prefill(exchange: _Exchange, body: bytes, headers: dict[str, str]) -> None:
    """P's leg, on its own thread: send, drain, discard; report only whether it failed."""
    leg = exchange.prefill_leg
    status: int | None = None
    error: str | None = None
    try:
        response = leg.exchange("POST", exchange.path, body, headers)
        status = response.status
        payload = response.read()
        if status >= 400:
            error = f"HTTP {status} {response.reason}: {_error_detail(payload)}"
    except (OSError, http.client.HTTPException) as exc:
        error = "aborted" if leg.aborted else _failure(exc, exchange.prefill_timeout_s)
    finally:
        leg.close()
    exchange.prefill_finished(status, error)


# --- the HTTP front ---------------------------------------------------------------------------


class _RoundRobin(Generic[_T]):
    def __init__(self, items: Sequence[_T]) -> None:
        self._items = list(items)
        self._next = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def next(self) -> _T:
        with self._lock:
            item = self._items[self._next % len(self._items)]
            self._next += 1
            return item


class _HangupWatch:
    """One named thread that notices clients hanging up while their requests' legs run.

    Without it a hang-up shows only when the proxy next writes to the client: for a
    non-streaming request, once D has decoded the whole answer, and all that while D decodes
    and P holds the KV for nobody. The thread polls the client sockets of the requests in
    flight; one that turns readable and reads EOF (or a reset) has hung up, and its exchange is
    aborted. It only ever peeks, so the handler's next read is untouched. A client that sends
    more while it waits (pipelining) is no longer watched; its hang-up shows at the next write.
    A client that half-closes (shuts down its sending side) counts as hanging up, as it does
    for nginx.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: dict[_Exchange, socket.socket] = {}
        self._closed = False
        # Wakes the poll when a client is added or the watch closes.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(target=self._run, name="kvpush-proxy-hangups", daemon=True)
        self._thread.start()

    def watch(self, exchange: _Exchange, client: socket.socket) -> None:
        with self._lock:
            self._watched[exchange] = client
        self._wake()

    def unwatch(self, exchange: _Exchange) -> None:
        """Stop watching; the caller closes ``client`` only after this returns."""
        with self._lock:
            self._watched.pop(exchange, None)

    def close(self, timeout_s: float) -> None:
        """Idempotent: stop and join the thread (bounded by ``timeout_s``)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._wake_r.close()
            self._wake_w.close()

    def _wake(self) -> None:
        # BlockingIOError: a wake is pending already.
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                watched = list(self._watched.items())
            # Rebuilt each round from the watched set: an fd that was unwatched (and perhaps
            # reused since) is at most seen once, and ignored by _check.
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            clients: dict[int, tuple[_Exchange, socket.socket]] = {}
            for exchange, client in watched:
                fd = client.fileno()
                if fd >= 0:
                    poller.register(fd, select.POLLIN)
                    clients[fd] = (exchange, client)
            for fd, _events in poller.poll():
                if fd in clients:
                    self._check(*clients[fd])
                else:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)

    def _check(self, exchange: _Exchange, client: socket.socket) -> None:
        with self._lock:
            # Still watched means still open: handlers unwatch before their socket closes.
            if self._watched.get(exchange) is not client:
                return
            try:
                # Readable, and nothing else reads it meanwhile: this returns at once.
                hung_up = client.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                hung_up = True
            del self._watched[exchange]
        if hung_up:
            exchange.client_hung_up()


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        prefill: Sequence[PrefillInstance],
        decode: Sequence[_Upstream],
        timeouts: Timeouts,
        max_connections: int,
    ) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.prefill = _RoundRobin(prefill)
        self.decode = _RoundRobin(decode)
        self.timeouts = timeouts
        self.max_connections = max_connections
        self._active: set[_Exchange] = set()
        self._active_lock = threading.Lock()
        self._connections = 0
        self._connections_served = 0
        self._at_cap_logged = False
        self._turned_away: collections.deque[tuple[float, socket.socket]] = collections.deque()
        super().__init__(address, _Handler)
        self.hangups = _HangupWatch()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up is ordinary; anything else is logged with its traceback."""
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionResetError, BrokenPipeError)):
            logger.debug("client %s hung up: %s", client_address, error)
            return
        super().handle_error(request, client_address)

    # ---- the connection cap ----

    def process_request(self, request: Any, client_address: Any) -> None:
        """Each connection on its own named thread, at most ``max_connections`` at once.

        Runs on the accepting thread. A connection over the cap is answered 503 from here and
        gets no thread, so a flood of clients costs sockets for a moment, never threads.
        """
        with self._active_lock:
            admitted = self._connections < self.max_connections
            if admitted:
                self._connections += 1
                self._connections_served += 1
                serial = self._connections_served
            first_at_cap = not admitted and not self._at_cap_logged
            if first_at_cap:
                self._at_cap_logged = True
        if not admitted:
            if first_at_cap:
                logger.warning(
                    "kvpush proxy: %d client connections open (--max-connections); "
                    "turning new ones away with 503 until one closes",
                    self.max_connections,
                )
            self._turn_away(request, client_address)
            return
        thread = threading.Thread(
            target=self.process_request_thread,
            args=(request, client_address),
            name=f"kvpush-proxy-{self.server_address[1]}-conn-{serial}",
            daemon=True,
        )
        try:
            thread.start()
        except BaseException:
            self._release_connection()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release_connection()

    def _release_connection(self) -> None:
        with self._active_lock:
            self._connections -= 1
            self._at_cap_logged = False

    def _turn_away(self, request: socket.socket, client_address: Any) -> None:
        body = json.dumps(
            {
                "error": {
                    "message": (
                        f"the proxy is serving its limit of {self.max_connections} client "
                        f"connections; retry after {_RETRY_AFTER_S} s, or raise the proxy's "
                        "--max-connections"
                    ),
                    "type": ERROR_TYPE,
                }
            }
        ).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n"
            f"Retry-After: {_RETRY_AFTER_S}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        logger.debug("client %s turned away: connection cap reached", client_address)
        # The accepting thread must never block: a fresh socket's send buffer takes the answer
        # whole, and what does not fit is dropped.
        request.setblocking(False)
        with contextlib.suppress(OSError):
            request.send(head + body)
            request.shutdown(socket.SHUT_WR)
        self._turned_away.append((time.monotonic() + _TURNED_AWAY_LINGER_S, request))
        while len(self._turned_away) > _MAX_TURNED_AWAY_LINGERING:
            self._turned_away.popleft()[1].close()

    def service_actions(self) -> None:
        """Between accepts (at least every poll interval): close turned-away connections.

        Each is closed once its client has read the 503 and hung up, or after a short linger;
        what it sent meanwhile is read and dropped, since closing a socket with unread input
        resets the connection and can discard the 503 before the client reads it.
        """
        now = time.monotonic()
        for _ in range(len(self._turned_away)):
            deadline, sock = self._turned_away.popleft()
            if self._drained_to_eof(sock) or now >= deadline:
                sock.close()
            else:
                self._turned_away.append((deadline, sock))

    @staticmethod
    def _drained_to_eof(sock: socket.socket) -> bool:
        for _ in range(16):
            try:
                if not sock.recv(_RELAY_BYTES):
                    return True
            except BlockingIOError:
                return False
            except OSError:
                return True
        return False

    def server_close(self) -> None:
        super().server_close()
        self.hangups.close(timeout_s=1.0)
        while self._turned_away:
            self._turned_away.popleft()[1].close()

    # ---- requests in flight ----

    def track(self, exchange: _Exchange, active: bool) -> None:
        with self._active_lock:
            if active:
                self._active.add(exchange)
            else:
                self._active.discard(exchange)

    def abort_all(self) -> None:
        with self._active_lock:
            active = list(self._active)
        for exchange in active:
            exchange.abort()


class _RefusedBodyError(Exception):
    """A request body the proxy will not read (or read further): answered ``status``."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "kvpush-proxy"
    server: _HTTPServer

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.timeouts.client_s)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)

    # ---- routes ----

    def do_GET(self) -> None:
        # A GET's body is never read, so what follows it must not be taken for a request.
        if self.headers.get("Content-Length", "0").strip() != "0" or self.headers.get(
            "Transfer-Encoding"
        ):
            self.close_connection = True
        route = urllib.parse.urlsplit(self.path).path
        if route == "/health":
            self._send_json(
                HTTPStatus.OK,
                {
                    "status": "ok",
                    "prefill_instances": len(self.server.prefill),
                    "decode_instances": len(self.server.decode),
                },
            )
        elif route == "/v1/models":
            self._forward_to_decode("GET", None)
        else:
            self._send_error(HTTPStatus.NOT_FOUND, f"no route GET {route}", leg=None)

    def do_POST(self) -> None:
        route = urllib.parse.urlsplit(self.path).path
        body = self._read_body()
        if body is None:
            return
        if route not in ("/v1/completions", "/v1/chat/completions"):
            self._send_error(HTTPStatus.NOT_FOUND, f"no route POST {route}", leg=None)
            return
        try:
            request = json.loads(body)
        except ValueError as error:
            self._send_error(HTTPStatus.BAD_REQUEST, f"body is not JSON: {error}", leg=None)
            return
        if not isinstance(request, dict):
            self._send_error(HTTPStatus.BAD_REQUEST, "body must be a JSON object", leg=None)
            return
        self._disaggregate(request)

    # ---- the two legs ----

    def _disaggregate(self, request: JSON) -> None:
        timeouts = self.server.timeouts
        prefill = self.server.prefill.next()
        decode_leg = _Leg(self.server.decode.next(), timeouts, timeouts.decode_s)
        exchange = _Exchange("POST", self.path, prefill, decode_leg, timeouts)
        headers = self._leg_headers(exchange.request_id)
        p_body = json.dumps(prefill_body(request, exchange.transfer_id)).encode()
        d_body = json.dumps(
            decode_body(request, prefill, exchange.request_id, exchange.transfer_id)
        ).encode()
        prefill_thread = threading.Thread(
            target=_run_prefill,
            args=(exchange, p_body, headers),
            name=f"kvpush-proxy-prefill-{exchange.request_id[:8]}",
            daemon=True,
        )
        self.server.track(exchange, True)
        try:
            prefill_thread.start()
            self.server.hangups.watch(exchange, self.connection)
            try:
                self._decode(exchange, d_body, headers)
            finally:
                # D's answer is complete or lost: a client hanging up now changes nothing.
                self.server.hangups.unwatch(exchange)
                # P's leg has ended or been aborted by now, or ends within its own timeouts;
                # waiting for it bounds what one connection holds to two threads.
                prefill_thread.join()
        finally:
            self.server.track(exchange, False)

    def _decode(self, exchange: _Exchange, body: bytes, headers: dict[str, str]) -> None:
        leg = exchange.decode_leg
        try:
            try:
                response = leg.exchange("POST", exchange.path, body, headers)
            except (OSError, http.client.HTTPException) as error:
                self._decode_failed(exchange, error)
                return
            exchange.decode_head(response.status)
            first = b""
            if response.status >= 400:
                # D refused or failed the request, so nobody will take P's KV: P is aborted now
                # rather than left to prefill and hold the KV for its lease.
                cause = exchange.fail(_Cause.DECODE)
                if cause is not _Cause.DECODE:
                    self._lost_to(exchange, cause)
                    return
                exchange.decode_error = f"HTTP {response.status} {response.reason}"
            else:
                try:
                    first = response.read1(_RELAY_BYTES)
                except (OSError, http.client.HTTPException) as error:
                    self._decode_failed(exchange, error)
                    return
                lost = exchange.decode_answered()
                if lost is not None:
                    self._lost_to(exchange, lost)
                    return
            sent, cut, detail = self._relay(response, leg, exchange.request_id, first)
            if cut is _Cause.CLIENT:
                exchange.client_hung_up()
                exchange.decode_finished(sent, "client hung up; both legs closed")
            elif cut is _Cause.DECODE:
                # Either D's body broke off (P is aborted now), or a hang-up or the proxy
                # stopping aborted D's leg under the relay.
                cause = exchange.fail(_Cause.DECODE)
                if cause is _Cause.DECODE:
                    exchange.decode_error = detail
                    exchange.decode_finished(sent, "decode body broke off; prefill closed")
                else:
                    exchange.decode_finished(sent, f"{cause.value}; both legs closed")
            else:
                exchange.decode_finished(sent)
        finally:
            leg.close()

    def _decode_failed(self, exchange: _Exchange, error: BaseException) -> None:
        """D's leg broke before its answer began: a 502 (504 on a timeout) naming D, unless
        another failure came first and broke it."""
        cause = exchange.fail(_Cause.DECODE)
        if cause is not _Cause.DECODE:
            self._lost_to(exchange, cause)
            return
        leg, rid = exchange.decode_leg, exchange.request_id
        status = (
            HTTPStatus.GATEWAY_TIMEOUT
            if isinstance(error, TimeoutError)
            else HTTPStatus.BAD_GATEWAY
        )
        exchange.decode_error = _failure(error, self.server.timeouts.decode_s)
        self._send_error(
            status,
            f"request {rid}: decode leg failed: {exchange.decode_error} from {leg.upstream.url}",
            leg="decode",
            request_id=rid,
        )
        exchange.decode_finished(status)

    def _lost_to(self, exchange: _Exchange, cause: _Cause) -> None:
        """What the client gets when ``cause`` (not D's own failure) ended the request first."""
        rid = exchange.request_id
        if cause is _Cause.PREFILL:
            self._send_error(
                HTTPStatus.BAD_GATEWAY,
                f"request {rid}: prefill leg failed: {exchange.prefill_error} "
                f"from {exchange.prefill.url}",
                leg="prefill",
                request_id=rid,
            )
            exchange.decode_finished(HTTPStatus.BAD_GATEWAY, "prefill failed first; decode closed")
        elif cause is _Cause.STOPPING:
            self.close_connection = True
            self._send_error(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"request {rid}: the proxy is stopping; retry once it is back or on another one",
                leg=None,
                request_id=rid,
            )
            exchange.decode_finished(HTTPStatus.SERVICE_UNAVAILABLE, "proxy stopping")
        else:
            self.close_connection = True
            exchange.decode_finished(None, "client hung up; both legs closed")

    def _forward_to_decode(self, method: str, body: bytes | None) -> None:
        timeouts = self.server.timeouts
        leg = _Leg(self.server.decode.next(), timeouts, timeouts.decode_s)
        try:
            response = leg.exchange(method, self.path, body, self._forwarded_headers())
        except (OSError, http.client.HTTPException) as error:
            self._send_error(
                HTTPStatus.BAD_GATEWAY,
                f"{method} {self.path} failed: {_failure(error, timeouts.decode_s)} "
                f"from {leg.upstream.url}",
                leg="decode",
            )
            leg.close()
            return
        try:
            self._relay(response, leg, None)
        finally:
            leg.close()

    def _forwarded_headers(self) -> dict[str, str]:
        return {name: value for name in _FORWARDED if (value := self.headers.get(name))}

    def _leg_headers(self, request_id: str) -> dict[str, str]:
        return {
            "Content-Type": "application/json",
            "X-Request-Id": request_id,
            **self._forwarded_headers(),
        }

    # ---- relaying D's answer ----

    def _relay(
        self,
        response: http.client.HTTPResponse,
        leg: _Leg,
        request_id: str | None,
        first: bytes = b"",
    ) -> tuple[int, _Cause | None, str]:
        """D's status, headers and body to the client, each piece as soon as it arrives.

        ``first`` is the start of the body, when already read. Returns the status sent and
        what cut the relay short, if anything, with a detail: ``_Cause.CLIENT`` when writing to
        the client failed (D's connection is then closed so vLLM aborts the request), or
        ``_Cause.DECODE`` when D's body broke off (the client's connection is then closed
        without the final chunk, so it sees the cut).
        """
        length = response.getheader("Content-Length")
        chunked_in = response.chunked
        fixed = length is not None and not chunked_in
        chunked_out = not fixed and self.request_version == "HTTP/1.1"
        try:
            self.send_response(response.status, response.reason)
            for name, value in response.getheaders():
                if name.lower() not in _NOT_RELAYED:
                    self.send_header(name, value)
            if request_id is not None:
                self.send_header("X-Request-Id", request_id)
            if fixed:
                self.send_header("Content-Length", str(length))
            elif chunked_out:
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.close_connection = True
                self.send_header("Connection", "close")
            self.end_headers()
        except OSError:
            leg.abort()
            self.close_connection = True
            return response.status, _Cause.CLIENT, ""
        data = first
        while True:
            try:
                if data and chunked_out:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                elif data:
                    self.wfile.write(data)
            except OSError:
                leg.abort()
                self.close_connection = True
                return response.status, _Cause.CLIENT, ""
            try:
                data = response.read1(_RELAY_BYTES)
            except (OSError, http.client.HTTPException) as error:
                self.close_connection = True
                detail = _failure(error, self.server.timeouts.decode_s)
                return response.status, _Cause.DECODE, f"decode body broke off: {detail}"
            if not data:
                try:
                    if chunked_out:
                        self.wfile.write(b"0\r\n\r\n")
                except OSError:
                    self.close_connection = True
                    return response.status, _Cause.CLIENT, ""
                return response.status, None, ""

    # ---- client side ----

    def _read_body(self) -> bytes | None:
        """The request body, read only as its framing says and never past MAX_BODY_BYTES.

        One Content-Length (digits only), or chunked as the only transfer coding; a request
        with neither has no body (RFC 9112 §6.3), so a POST without either is a 411, not a
        read to EOF. Each refusal closes the connection: the rest of the body stays unread and
        must not be taken for the next request. None after answering an error.
        """
        try:
            return self._read_framed_body()
        except TimeoutError:
            refusal = _RefusedBodyError(
                HTTPStatus.REQUEST_TIMEOUT,
                f"not received within {self.server.timeouts.client_s:g} s",
            )
        except _RefusedBodyError as error:
            refusal = error
        self.close_connection = True
        self._send_error(refusal.status, f"request body: {refusal}", leg=None)
        return None

    def _read_framed_body(self) -> bytes:
        codings = [
            coding.strip().lower()
            for value in self.headers.get_all("Transfer-Encoding", [])
            for coding in value.split(",")
            if coding.strip()
        ]
        # "Content-Length: 42, 42" and repeated equal headers are one length (RFC 9110 §8.6).
        lengths = {
            length.strip()
            for value in self.headers.get_all("Content-Length", [])
            for length in value.split(",")
        }
        if codings:
            named = ", ".join(codings)
            if lengths:
                raise _RefusedBodyError(
                    HTTPStatus.BAD_REQUEST,
                    "both Transfer-Encoding and Content-Length; send only one",
                )
            if codings[-1] != "chunked":
                raise _RefusedBodyError(
                    HTTPStatus.BAD_REQUEST,
                    f"Transfer-Encoding {named} does not end with chunked, so its length is "
                    "unknown; send Content-Length or chunked",
                )
            if len(codings) > 1:
                raise _RefusedBodyError(
                    HTTPStatus.NOT_IMPLEMENTED,
                    f"Transfer-Encoding {named}: only chunked is supported",
                )
            return self._read_chunked()
        if not lengths:
            raise _RefusedBodyError(
                HTTPStatus.LENGTH_REQUIRED,
                "no Content-Length and not chunked; send one of them",
            )
        if len(lengths) > 1:
            raise _RefusedBodyError(
                HTTPStatus.BAD_REQUEST, f"conflicting Content-Length values {sorted(lengths)}"
            )
        (text,) = lengths
        if not (text.isascii() and text.isdigit()):
            raise _RefusedBodyError(
                HTTPStatus.BAD_REQUEST, f"Content-Length {text[:32]!r} is not a byte count"
            )
        digits = text.lstrip("0") or "0"
        if len(digits) > len(str(MAX_BODY_BYTES)) or int(digits) > MAX_BODY_BYTES:
            raise _RefusedBodyError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"{digits[:32]} bytes is over the limit of {MAX_BODY_BYTES} bytes",
            )
        length = int(digits)
        data = self.rfile.read(length)
        if len(data) < length:
            raise _RefusedBodyError(
                HTTPStatus.BAD_REQUEST, f"ended after {len(data)} of its {length} bytes"
            )
        return data

    def _read_chunked(self) -> bytes:
        parts: list[bytes] = []
        total = 0
        framing = 0  # size lines, extensions, CRLFs and trailers: bounded too
        while True:
            line = self.rfile.readline(_MAX_CHUNK_LINE_BYTES + 1)
            framing += len(line)
            if not line.endswith(b"\n"):
                raise _RefusedBodyError(
                    HTTPStatus.BAD_REQUEST,
                    f"chunk size line cut off or over {_MAX_CHUNK_LINE_BYTES} bytes",
                )
            # chunk-size [BWS ";" chunk-ext] CRLF, the size in hex digits alone: no sign, no
            # 0x, no "_" (all of which int(..., 16) would take).
            size_field = line.split(b";", 1)[0].rstrip(b"\r\n").rstrip(b" \t")
            if not size_field or not _HEX_DIGITS.issuperset(size_field):
                raise _RefusedBodyError(
                    HTTPStatus.BAD_REQUEST,
                    f"invalid chunk size {size_field[:32]!r} (expected hex digits)",
                )
            size = int(size_field, 16)
            if size > MAX_BODY_BYTES - total:
                raise _RefusedBodyError(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    f"chunked body over the limit of {MAX_BODY_BYTES} bytes",
                )
            if size == 0:
                return self._read_trailers(b"".join(parts), framing)
            data = self.rfile.read(size)
            if len(data) < size:
                raise _RefusedBodyError(
                    HTTPStatus.BAD_REQUEST,
                    f"ended inside a chunk, after {len(data)} of its {size} bytes",
                )
            parts.append(data)
            total += size
            end = self.rfile.readline(2)
            framing += len(end)
            if end not in (b"\r\n", b"\n"):
                raise _RefusedBodyError(
                    HTTPStatus.BAD_REQUEST, f"a chunk is longer than its size ({size} bytes)"
                )
            if framing > _MAX_CHUNK_FRAMING_BYTES:
                raise _RefusedBodyError(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    f"chunked framing over {_MAX_CHUNK_FRAMING_BYTES} bytes; "
                    "send fewer, larger chunks",
                )

    def _read_trailers(self, body: bytes, framing: int) -> bytes:
        """Skip the trailer fields, up to the blank line that ends a chunked body."""
        while True:
            line = self.rfile.readline(_MAX_CHUNK_LINE_BYTES + 1)
            framing += len(line)
            if not line.endswith(b"\n"):
                raise _RefusedBodyError(
                    HTTPStatus.BAD_REQUEST,
                    f"trailer line cut off or over {_MAX_CHUNK_LINE_BYTES} bytes",
                )
            if line in (b"\r\n", b"\n"):
                return body
            if framing > _MAX_CHUNK_FRAMING_BYTES:
                raise _RefusedBodyError(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    f"chunked framing and trailers over {_MAX_CHUNK_FRAMING_BYTES} bytes",
                )

    def _send_json(self, status: int, payload: JSON, request_id: str | None = None) -> None:
        data = json.dumps(payload).encode()
        with contextlib.suppress(OSError):
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if request_id is not None:
                self.send_header("X-Request-Id", request_id)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

    def _send_error(
        self, status: int, message: str, *, leg: str | None, request_id: str | None = None
    ) -> None:
        error: JSON = {"message": message, "type": ERROR_TYPE}
        if leg is not None:
            error["leg"] = leg
        if request_id is not None:
            error["request_id"] = request_id
        self._send_json(status, {"error": error}, request_id)


# --- the server ------------------------------------------------------------------------------


class ProxyServer:
    """The router, in process: ``start()`` serves on a named background thread, ``address``
    is where it listens (``port=0`` picks a free port), ``stop()`` (idempotent) stops
    accepting, aborts the requests in flight and joins the thread.

    ``max_connections`` caps the client connections served at once (each holds a thread, and
    one more while its P leg runs); a connection over it is answered 503 with ``Retry-After``
    at once and closed, so a flood of clients cannot make the proxy start threads without
    bound.
    """

    def __init__(
        self,
        prefill: Sequence[PrefillInstance],
        decode: Sequence[str],
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        timeouts: Timeouts | None = None,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        if not prefill:
            raise ValueError("the proxy needs at least one prefill instance")
        if not decode:
            raise ValueError("the proxy needs at least one decode instance")
        if max_connections < 1:
            raise ValueError(f"max_connections={max_connections}: the proxy needs at least 1")
        self.prefill = list(prefill)
        self.decode = [_Upstream.parse(url) for url in decode]
        self.timeouts = timeouts or Timeouts()
        self._httpd = _HTTPServer(
            (host, port), self.prefill, self.decode, self.timeouts, max_connections
        )
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopped = False

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._httpd.server_address[:2]
        return cast(str, host), port

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def start(self) -> None:
        with self._lock:
            if self._stopped:
                raise RuntimeError("kvpush proxy: stopped; make a new ProxyServer")
            if self._thread is not None:
                return
            self._thread = threading.Thread(
                target=self._httpd.serve_forever,
                kwargs={"poll_interval": 0.1},
                name="kvpush-proxy-serve",
                daemon=True,
            )
            self._thread.start()
        logger.info(
            "kvpush proxy on %s: prefill %s, decode %s, at most %d client connections",
            self.url,
            ", ".join(f"{p.url} ({p.engine_id})" for p in self.prefill),
            ", ".join(d.url for d in self.decode),
            self._httpd.max_connections,
        )

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            thread = self._thread
        if thread is not None:
            self._httpd.shutdown()
            thread.join(timeout_s)
        self._httpd.abort_all()
        self._httpd.server_close()

    def __enter__(self) -> ProxyServer:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


# --- command line ----------------------------------------------------------------------------


def _prefill_arg(spec: str) -> PrefillInstance:
    try:
        return parse_prefill(spec)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _decode_arg(url: str) -> str:
    try:
        _Upstream.parse(url)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--decode {error}") from None
    return url


def _max_connections_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--max-connections {text!r}: expected an integer >= 1")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The proxy's options (shared by ``kvpush proxy`` and :func:`main`)."""
    defaults = Timeouts()
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument(
        "--prefill",
        type=_prefill_arg,
        action="append",
        required=True,
        metavar="URL,engine_id=ID,side_channel=HOST:PORT[,tp=N][,pp=N]",
        help="a prefill server and its kvpush coordinates (repeatable)",
    )
    parser.add_argument(
        "--decode",
        type=_decode_arg,
        action="append",
        required=True,
        metavar="URL",
        help="a decode server (repeatable)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=defaults.connect_s,
        help=f"seconds to connect to P or D (default {defaults.connect_s:g})",
    )
    parser.add_argument(
        "--prefill-timeout",
        type=float,
        default=defaults.prefill_s,
        help=f"seconds P may take to answer (default {defaults.prefill_s:g})",
    )
    parser.add_argument(
        "--decode-timeout",
        type=float,
        default=defaults.decode_s,
        help=(
            "seconds to wait for D's first byte and between streamed chunks "
            f"(default {defaults.decode_s:g})"
        ),
    )
    parser.add_argument(
        "--client-timeout",
        type=float,
        default=defaults.client_s,
        help=f"seconds a client may stall or idle (default {defaults.client_s:g})",
    )
    parser.add_argument(
        "--max-connections",
        type=_max_connections_arg,
        default=MAX_CONNECTIONS,
        metavar="N",
        help=(
            "client connections served at once; one more is answered 503 with Retry-After "
            f"(default {MAX_CONNECTIONS}; each holds a thread and, with its legs, up to three "
            "file descriptors, so keep the open-files limit above 3N)"
        ),
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (default INFO: one line per request)",
    )


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM."""
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    timeouts = Timeouts(
        connect_s=args.connect_timeout,
        prefill_s=args.prefill_timeout,
        decode_s=args.decode_timeout,
        client_s=args.client_timeout,
    )
    try:
        server = ProxyServer(
            args.prefill,
            args.decode,
            host=args.host,
            port=args.port,
            timeouts=timeouts,
            max_connections=args.max_connections,
        )
    except OSError as error:
        logger.error("kvpush proxy: cannot listen on %s:%s: %s", args.host, args.port, error)
        return 1
    done = threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: done.set())
    server.start()
    try:
        done.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvpush proxy",
        description="OpenAI-compatible router for disaggregated prefill/decode with kvpush.",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
