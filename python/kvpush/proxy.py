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

When P's leg fails before D has started answering, the client gets a 502 naming the prefill leg
and D's connection is closed (so vLLM aborts D's request); when D answers first it wins and P's
failure is only logged. A D that cannot be reached is a 502 naming D; a D error is passed back
as D sent it. A client that hangs up mid-stream makes the proxy close D's connection.

P and D instances are chosen round-robin, independently. Standard library only (kvpush has no
runtime dependencies): :class:`http.server.ThreadingHTTPServer` for clients, one
:class:`http.client.HTTPConnection` per leg, a thread for P's leg; every socket has a bounded
timeout (:class:`Timeouts`).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import logging
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
_RELAY_BYTES = 64 << 10
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
    """The leg was aborted (by the other leg's failure, or the proxy stopping)."""


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


class _Exchange:
    """One client request's two legs, and the single decision of which one answers first.

    Whichever of "D's response head arrived" and "P's leg failed" takes the lock first decides
    what the client gets; the log line is written when both legs have finished.
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
        self._legs_open = 2
        self.prefill_error: str | None = None
        self.prefill_status: int | None = None
        self.prefill_s = 0.0
        self.decode_status: int | None = None
        self.decode_first_s: float | None = None
        self.decode_error: str | None = None
        self.client_status: int | None = None
        self.client_note = ""

    def abort(self) -> None:
        self.prefill_leg.abort()
        self.decode_leg.abort()

    def prefill_finished(self, status: int | None, error: str | None) -> None:
        with self._lock:
            self.prefill_status, self.prefill_error = status, error
            self.prefill_s = time.monotonic() - self.started
            fail_decode = error is not None and not self._decode_answered
        if fail_decode:
            self.decode_leg.abort()
        self._leg_done()

    def decode_answered(self, status: int) -> bool:
        """D's response head arrived: True if D answers the client, False if P failed first."""
        with self._lock:
            self.decode_status = status
            self.decode_first_s = time.monotonic() - self.started
            if self.prefill_error is not None:
                return False
            self._decode_answered = True
            return True

    def prefill_failed_first(self) -> str | None:
        with self._lock:
            return None if self._decode_answered else self.prefill_error

    def decode_finished(self, client_status: int, note: str = "") -> None:
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
        failed = self.prefill_error or self.decode_error or (self.client_status or 0) >= 400
        logger.log(
            logging.WARNING if failed else logging.INFO,
            "request %s transfer %s %s %s -> %s%s | %s | %s | %.3f s",
            self.request_id,
            self.transfer_id,
            self.method,
            self.path,
            self.client_status,
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


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        prefill: Sequence[PrefillInstance],
        decode: Sequence[_Upstream],
        timeouts: Timeouts,
    ) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.prefill = _RoundRobin(prefill)
        self.decode = _RoundRobin(decode)
        self.timeouts = timeouts
        self._active: set[_Exchange] = set()
        self._active_lock = threading.Lock()
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up is ordinary; anything else is logged with its traceback."""
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionResetError, BrokenPipeError)):
            logger.debug("client %s hung up: %s", client_address, error)
            return
        super().handle_error(request, client_address)

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
        self.server.track(exchange, True)
        try:
            threading.Thread(
                target=_run_prefill,
                args=(exchange, p_body, headers),
                name=f"kvpush-proxy-prefill-{exchange.request_id[:8]}",
                daemon=True,
            ).start()
            self._decode(exchange, d_body, headers)
        finally:
            self.server.track(exchange, False)

    def _decode(self, exchange: _Exchange, body: bytes, headers: dict[str, str]) -> None:
        leg = exchange.decode_leg
        rid = exchange.request_id
        try:
            try:
                response = leg.exchange("POST", exchange.path, body, headers)
            except (OSError, http.client.HTTPException) as error:
                prefill_error = exchange.prefill_failed_first()
                if prefill_error is not None:
                    self._prefill_failed(exchange, prefill_error)
                    return
                status = (
                    HTTPStatus.GATEWAY_TIMEOUT
                    if isinstance(error, TimeoutError)
                    else HTTPStatus.BAD_GATEWAY
                )
                exchange.decode_error = _failure(error, self.server.timeouts.decode_s)
                self._send_error(
                    status,
                    f"request {rid}: decode leg failed: {exchange.decode_error} "
                    f"from {leg.upstream.url}",
                    leg="decode",
                    request_id=rid,
                )
                exchange.decode_finished(status)
                return
            if not exchange.decode_answered(response.status):
                self._prefill_failed(exchange, exchange.prefill_error or "")
                return
            sent, note = self._relay(response, leg, rid)
            if note.startswith("decode"):
                exchange.decode_error = note
            exchange.decode_finished(sent, note)
        finally:
            leg.close()

    def _prefill_failed(self, exchange: _Exchange, error: str) -> None:
        self._send_error(
            HTTPStatus.BAD_GATEWAY,
            f"request {exchange.request_id}: prefill leg failed: {error} "
            f"from {exchange.prefill.url}",
            leg="prefill",
            request_id=exchange.request_id,
        )
        exchange.decode_finished(HTTPStatus.BAD_GATEWAY, "prefill failed first; decode closed")

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
        self, response: http.client.HTTPResponse, leg: _Leg, request_id: str | None
    ) -> tuple[int, str]:
        """D's status, headers and body to the client, each piece as soon as it arrives.

        Returns the status sent and a note: ``""``, ``"client disconnected"`` (D's connection
        is then closed so vLLM aborts the request) or ``"decode …"`` when D's body broke off
        (the client's connection is then closed without the final chunk, so it sees the cut).
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
            return response.status, "client disconnected"
        while True:
            try:
                data = response.read1(_RELAY_BYTES)
            except (OSError, http.client.HTTPException) as error:
                self.close_connection = True
                return response.status, (
                    f"decode body broke off: {_failure(error, self.server.timeouts.decode_s)}"
                )
            try:
                if not data:
                    if chunked_out:
                        self.wfile.write(b"0\r\n\r\n")
                    return response.status, ""
                if chunked_out:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                else:
                    self.wfile.write(data)
            except OSError:
                leg.abort()
                self.close_connection = True
                return response.status, "client disconnected"

    # ---- client side ----

    def _read_body(self) -> bytes | None:
        """The request body (Content-Length or chunked); None after answering an error."""
        try:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                return self._read_chunked()
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            self._send_error(HTTPStatus.BAD_REQUEST, "malformed request body framing", leg=None)
            return None
        if length < 0 or length > MAX_BODY_BYTES:
            self._send_error(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"body of {length} bytes (limit {MAX_BODY_BYTES})",
                leg=None,
            )
            return None
        return self.rfile.read(length)

    def _read_chunked(self) -> bytes | None:
        parts: list[bytes] = []
        total = 0
        while True:
            size = int(self.rfile.readline(1024).split(b";", 1)[0].strip(), 16)
            if size == 0:
                while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(parts)
            total += size
            if total > MAX_BODY_BYTES:
                self._send_error(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    f"chunked body over the limit of {MAX_BODY_BYTES} bytes",
                    leg=None,
                )
                self.close_connection = True
                return None
            parts.append(self.rfile.read(size))
            self.rfile.readline(1024)

    def _send_json(self, status: int, payload: JSON, request_id: str | None = None) -> None:
        data = json.dumps(payload).encode()
        with contextlib.suppress(OSError):
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if request_id is not None:
                self.send_header("X-Request-Id", request_id)
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
    accepting, aborts the requests in flight and joins the thread."""

    def __init__(
        self,
        prefill: Sequence[PrefillInstance],
        decode: Sequence[str],
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        timeouts: Timeouts | None = None,
    ) -> None:
        if not prefill:
            raise ValueError("the proxy needs at least one prefill instance")
        if not decode:
            raise ValueError("the proxy needs at least one decode instance")
        self.prefill = list(prefill)
        self.decode = [_Upstream.parse(url) for url in decode]
        self.timeouts = timeouts or Timeouts()
        self._httpd = _HTTPServer((host, port), self.prefill, self.decode, self.timeouts)
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
            "kvpush proxy on %s: prefill %s, decode %s",
            self.url,
            ", ".join(f"{p.url} ({p.engine_id})" for p in self.prefill),
            ", ".join(d.url for d in self.decode),
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
            args.prefill, args.decode, host=args.host, port=args.port, timeouts=timeouts
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
