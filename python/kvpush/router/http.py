"""The router's HTTP front, which ``kvpush proxy`` serves: OpenAI-compatible, over one
:class:`~kvpush.router.core.Router`.

``POST /v1/completions`` and ``/v1/chat/completions`` go through the router's disaggregated
exchange (push: both legs at once with one ``X-Request-Id`` and ``transfer_id``; pull: P, then
D with P's ``kv_transfer_params``); D's answer is streamed back as it comes, with the request
id in ``X-Request-Id``. ``GET /health`` says how many instances of each role are healthy;
``GET /v1/models`` goes to a D. Errors the proxy makes are OpenAI-style JSON of type
``kvpush_proxy_error``, naming the leg and the request: P failing before D's answer began is a
502 naming the prefill leg; D unreachable is a 502 naming D; a D error is passed back as D sent
it. A client that hangs up aborts both legs (aiohttp cancels the request's handler, which
closes them), whether or not anything was written to it yet.

Everything a client can make the proxy hold is bounded: a request body is never read past
``max_body_bytes`` whatever its framing (413; aiohttp's parser refuses malformed framing with
400; no length and not chunked is 411); at most ``max_connections`` clients are served at once
(one over the cap gets a prompt 503 with ``Retry-After`` from a protocol that never parses its
request); reads, writes and idle keep-alive connections are bounded by ``Timeouts.client_s``.

:class:`ProxyServer` runs the server on a named background thread with its own event loop
(the demo and the benchmark start it in-process); :func:`add_arguments` and :func:`run` are
``kvpush proxy``'s options and its serving until a signal (:mod:`kvpush.cli` lists the command).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import socket
import threading
from collections.abc import Callable, Sequence
from http import HTTPStatus
from typing import Any, cast

import aiohttp
from aiohttp import web

from kvpush.router.balance import NoHealthyInstanceError
from kvpush.router.core import Router
from kvpush.router.exchange import Exchange, LegFailedError, Mode, RouterStoppingError, Timeouts
from kvpush.router.instances import PrefillInstance, Upstream, parse_prefill
from kvpush.router.loop import LoopThread

__all__ = [
    "HEALTH_INTERVAL_S",
    "MAX_BODY_BYTES",
    "MAX_CONNECTIONS",
    "ProxyServer",
    "add_arguments",
    "run",
]

# The name the proxy's log lines have always carried (the router's own say kvpush.router).
logger = logging.getLogger("kvpush.proxy")

JSON = dict[str, Any]

ERROR_TYPE = "kvpush_proxy_error"
MAX_BODY_BYTES = 64 << 20
"""The largest request body accepted, whatever its framing (Content-Length or chunked)."""
MAX_CONNECTIONS = 1024
"""Default cap on concurrent client connections."""
HEALTH_INTERVAL_S = 5.0
"""``kvpush proxy``'s default interval between health checks of each instance."""
# A client turned away at the cap is told when to come back, and its connection is closed once
# it has read the 503 and hung up (or after this long), so that closing does not reset it away.
_RETRY_AFTER_S = 1
_TURNED_AWAY_LINGER_S = 2.0
_LINGER_S = 1.0
# Per-connection headers (RFC 9110 §7.6.1) and those aiohttp writes itself.
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


def _error(
    status: int,
    message: str,
    *,
    leg: str | None = None,
    request_id: str | None = None,
    close: bool = False,
    retry_after_s: int | None = None,
) -> web.Response:
    error: JSON = {"message": message, "type": ERROR_TYPE}
    if leg is not None:
        error["leg"] = leg
    if request_id is not None:
        error["request_id"] = request_id
    response = web.json_response({"error": error}, status=status)
    if request_id is not None:
        response.headers["X-Request-Id"] = request_id
    if retry_after_s is not None:
        response.headers["Retry-After"] = str(retry_after_s)
    if close:
        response.force_close()
    return response


class _RefusedBodyError(Exception):
    """A request body the proxy will not read (or read further): answered ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _RequestHandler(web.RequestHandler):
    """aiohttp's connection handler, answering what it refuses itself (malformed framing or
    headers, a handler that failed) as the proxy's JSON errors, with the connection closed."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            logger.error("kvpush proxy: %s %s failed", request.method, request.path, exc_info=exc)
        else:
            logger.debug("kvpush proxy: refused a request: %s", message or exc)
        if request.writer.output_size > 0:
            raise ConnectionError("the answer has begun: the connection is closed instead")
        detail = " ".join((message or HTTPStatus(status).phrase).split())
        return _error(status, f"request refused: {detail}", close=True)


# --- the connection cap ------------------------------------------------------------------------


class _Admitted(asyncio.Protocol):
    """An aiohttp connection that holds one of the cap's slots until it closes."""

    def __init__(self, inner: asyncio.Protocol, release: Callable[[], None]) -> None:
        self._inner = inner
        self._release = release

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            self._inner.connection_lost(exc)
        finally:
            self._release()


class _TurnedAway(asyncio.Protocol):
    """A connection over the cap: a 503 with ``Retry-After`` at once, nothing parsed; closed
    once the client hangs up or after a short linger, what it sends meanwhile dropped."""

    def __init__(self, answer: bytes) -> None:
        self._answer = answer
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        writer = cast(asyncio.Transport, transport)
        writer.write(self._answer)
        if writer.can_write_eof():
            writer.write_eof()
        self._timer = asyncio.get_running_loop().call_later(_TURNED_AWAY_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()


def _turned_away_answer(max_connections: int) -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": (
                    f"the proxy is serving its limit of {max_connections} client "
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
    return head + body


# --- the HTTP front ----------------------------------------------------------------------------


class _Front:
    """The aiohttp application's handlers over one :class:`Router`."""

    def __init__(self, router: Router, max_body_bytes: int) -> None:
        self.router = router
        self.max_body_bytes = max_body_bytes

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completion)
        app.router.add_post("/v1/chat/completions", self.completion)
        app.router.add_route("*", "/{tail:.*}", self.not_found)
        return app

    async def health(self, request: web.Request) -> web.Response:
        state = self.router.health()
        return web.json_response(state, status=200 if state["status"] == "ok" else 503)

    async def not_found(self, request: web.Request) -> web.Response:
        return _error(404, f"no route {request.method} {request.path}")

    async def models(self, request: web.Request) -> web.StreamResponse:
        try:
            decode = self.router.decode.pick()
        except NoHealthyInstanceError as error:
            return _error(503, str(error), leg="decode", retry_after_s=_RETRY_AFTER_S)
        timeouts = self.router.timeouts
        try:
            async with self.router.session.get(
                decode.upstream.join(request.path_qs),
                headers=_forwarded(request),
                timeout=timeouts.upstream(timeouts.decode_s),
            ) as upstream:
                payload = await upstream.read()
                response = web.Response(status=upstream.status, body=payload)
                _copy_headers(upstream.headers, response)
                return response
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as error:
            return _error(
                502, f"GET {request.path} failed: {error!r} from {decode.url}", leg="decode"
            )

    async def completion(self, request: web.Request) -> web.StreamResponse:
        try:
            raw = await self._read_body(request)
        except _RefusedBodyError as refusal:
            return _error(refusal.status, f"request body: {refusal}", close=True)
        try:
            body = json.loads(raw)
        except ValueError as error:
            return _error(400, f"body is not JSON: {error}")
        if not isinstance(body, dict):
            return _error(400, "body must be a JSON object")
        try:
            async with self.router.exchange(request.path, body, _forwarded(request)) as exchange:
                return await self._relay(request, exchange)
        except NoHealthyInstanceError as error:
            return _error(503, str(error), leg=error.role, retry_after_s=_RETRY_AFTER_S)

    async def _relay(self, request: web.Request, exchange: Exchange) -> web.StreamResponse:
        rid = exchange.request_id
        try:
            answer = await exchange.answer()
        except LegFailedError as failure:
            exchange.client_status = failure.status
            return _error(failure.status, str(failure), leg=failure.leg, request_id=rid)
        except RouterStoppingError:
            exchange.client_status = 503
            return _error(
                503,
                f"request {rid}: the proxy is stopping; retry once it is back or on another one",
                request_id=rid,
                close=True,
            )
        response = web.StreamResponse(status=answer.status, reason=answer.reason)
        _copy_headers(answer.headers, response)
        response.headers["X-Request-Id"] = rid
        if answer.length is not None:
            response.content_length = answer.length
        elif request.version >= (1, 1):
            response.enable_chunked_encoding()
        else:
            response.force_close()
        client_s = self.router.timeouts.client_s
        exchange.client_status = answer.status
        try:
            await asyncio.wait_for(response.prepare(request), client_s)
            async for data in answer.chunks():
                await asyncio.wait_for(response.write(data), client_s)
            await asyncio.wait_for(response.write_eof(), client_s)
        except LegFailedError:
            # D's body broke off, or the proxy stopped: the client sees the cut (no final chunk).
            _close(request)
        except ConnectionError:
            exchange.abort("client hung up; both legs closed")
            _close(request)
        except asyncio.TimeoutError:
            exchange.abort(f"client stalled over {client_s:g} s; both legs closed")
            _close(request)
        return response

    async def _read_body(self, request: web.Request) -> bytes:
        """The body, read only as its framing says and never past ``max_body_bytes``.

        aiohttp's parser refuses malformed framing itself (400); a POST with neither a length
        nor chunked has no body (RFC 9112 §6.3): 411, not a read to EOF.
        """
        codings = [
            coding.strip().lower()
            for value in request.headers.getall("Transfer-Encoding", [])
            for coding in value.split(",")
            if coding.strip()
        ]
        if codings and codings != ["chunked"]:
            raise _RefusedBodyError(
                501, f"Transfer-Encoding {', '.join(codings)}: only chunked is supported"
            )
        chunked = bool(codings)
        length = request.content_length
        if length is None and not chunked:
            raise _RefusedBodyError(411, "no Content-Length and not chunked; send one of them")
        if length is not None and length > self.max_body_bytes:
            raise _RefusedBodyError(
                413, f"{length} bytes is over the limit of {self.max_body_bytes} bytes"
            )
        data = bytearray()

        async def read() -> None:
            async for piece in request.content.iter_any():
                data.extend(piece)
                if len(data) > self.max_body_bytes:
                    raise _RefusedBodyError(
                        413, f"chunked body over the limit of {self.max_body_bytes} bytes"
                    )

        client_s = self.router.timeouts.client_s
        try:
            await asyncio.wait_for(read(), client_s)
        except asyncio.TimeoutError:
            raise _RefusedBodyError(408, f"not received within {client_s:g} s") from None
        except (ValueError, OSError) as error:
            raise _RefusedBodyError(400, f"{type(error).__name__}: {error}") from None
        return bytes(data)


def _close(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.close()


def _forwarded(request: web.Request) -> dict[str, str]:
    return {name: value for name in _FORWARDED if (value := request.headers.get(name))}


def _copy_headers(headers: Any, response: web.StreamResponse) -> None:
    for name, value in headers.items():
        if name.lower() not in _NOT_RELAYED:
            response.headers.add(name, value)


# --- the server --------------------------------------------------------------------------------


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class ProxyServer:
    """The router's HTTP front, in process: ``start()`` serves on a named background thread
    with its own event loop, ``address`` is where it listens (bound at construction;
    ``port=0`` picks a free port), ``stop()`` (idempotent) stops accepting, answers the
    requests in flight 503 (or cuts those relaying) and joins the thread.

    ``mode`` is ``push`` or ``pull``; a ``PrefillInstance`` without coordinates has them
    learned from its first answer. ``health_interval_s`` (None: off) checks each instance's
    ``/health`` that often. ``max_connections`` caps the client connections served at once;
    one over it is answered 503 with ``Retry-After`` at once and closed.
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
        mode: Mode = "push",
        health_interval_s: float | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        if not prefill:
            raise ValueError("the proxy needs at least one prefill instance")
        if not decode:
            raise ValueError("the proxy needs at least one decode instance")
        if max_connections < 1:
            raise ValueError(f"max_connections={max_connections}: the proxy needs at least 1")
        self.prefill = list(prefill)
        self.decode = list(decode)
        self.timeouts = timeouts or Timeouts()
        self.max_connections = max_connections
        self._router = Router(
            self.prefill,
            self.decode,
            mode=mode,
            timeouts=self.timeouts,
            health_interval_s=health_interval_s,
        )
        self._front = _Front(self._router, max_body_bytes)
        self._sock = _listen(host, port)
        self._address = cast(tuple[str, int], self._sock.getsockname()[:2])
        self._lock = threading.Lock()
        self._loop: LoopThread | None = None
        self._stopped = False
        self._connections = 0
        self._at_cap_logged = False
        self._runner: web.AppRunner | None = None
        self._server: asyncio.Server | None = None

    @property
    def router(self) -> Router:
        return self._router

    @property
    def address(self) -> tuple[str, int]:
        return self._address

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def start(self) -> None:
        with self._lock:
            if self._stopped:
                raise RuntimeError("kvpush proxy: stopped; make a new ProxyServer")
            if self._loop is not None:
                return
            self._loop = LoopThread(f"kvpush-proxy-{self.address[1]}")
        self._loop.run(self._serve())
        logger.info(
            "kvpush proxy on %s (%s): prefill %s, decode %s, at most %d client connections",
            self.url,
            self._router.mode,
            ", ".join(
                f"{p.url} ({p.engine_id or 'coordinates learned from its answer'})"
                for p in self.prefill
            ),
            ", ".join(self.decode),
            self.max_connections,
        )

    async def _serve(self) -> None:
        await self._router.start()
        # Connections are made by _protocol (the cap) with _RequestHandler, not by the runner.
        runner = web.AppRunner(self._front.app(), handler_cancellation=True, shutdown_timeout=2.0)
        await runner.setup()
        self._runner = runner
        self._server = await asyncio.get_running_loop().create_server(
            self._protocol, sock=self._sock
        )

    def _protocol(self) -> asyncio.Protocol:
        """Each accepted connection: served if under the cap, else turned away."""
        if self._connections >= self.max_connections:
            if not self._at_cap_logged:
                self._at_cap_logged = True
                logger.warning(
                    "kvpush proxy: %d client connections open (--max-connections); "
                    "turning new ones away with 503 until one closes",
                    self.max_connections,
                )
            return _TurnedAway(_turned_away_answer(self.max_connections))
        assert self._runner is not None
        assert self._runner.server is not None
        self._connections += 1
        handler = _RequestHandler(
            self._runner.server,
            loop=asyncio.get_running_loop(),
            keepalive_timeout=self.timeouts.client_s,
            # No aiohttp access log: the router writes one line per request.
            access_log=cast(logging.Logger, None),
            # A refused body's rest is read and dropped this long before the connection closes
            # (closing on unread input resets it, which can lose the answer).
            lingering_time=_LINGER_S,
        )
        return _Admitted(handler, self._release)

    def _release(self) -> None:
        self._connections -= 1
        self._at_cap_logged = False

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            loop = self._loop
        try:
            if loop is not None:
                loop.run(self._shutdown(), timeout_s)
        finally:
            if loop is not None:
                loop.close(timeout_s)
            self._sock.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._router.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def __enter__(self) -> ProxyServer:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


# --- command line ------------------------------------------------------------------------------


def _prefill_arg(spec: str) -> PrefillInstance:
    try:
        return parse_prefill(spec)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _decode_arg(url: str) -> str:
    try:
        Upstream.parse(url)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--decode {error}") from None
    return url


def _positive_int_arg(flag: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected an integer >= 1")
        return value

    return parse


def _interval_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"--health-interval {text!r}: expected seconds >= 0")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvpush proxy``'s options."""
    defaults = Timeouts()
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument(
        "--prefill",
        type=_prefill_arg,
        action="append",
        required=True,
        metavar="URL[,engine_id=ID,side_channel=HOST:PORT][,tp=N][,pp=N]",
        help=(
            "a prefill server (repeatable); without engine_id= and side_channel=, push mode "
            "learns them from its first answer (sent serially)"
        ),
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
        "--mode",
        choices=["push", "pull"],
        default="push",
        help=(
            "push: both legs at once, D names P (kvpush, NixlPushConnector); pull: P first, "
            "D gets P's kv_transfer_params (NixlConnector). Default push"
        ),
    )
    parser.add_argument(
        "--health-interval",
        type=_interval_arg,
        default=HEALTH_INTERVAL_S,
        metavar="SECONDS",
        help=(
            "seconds between /health checks of each instance; one that fails is skipped until "
            f"it answers again (0: no checks; default {HEALTH_INTERVAL_S:g})"
        ),
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
        type=_positive_int_arg("--max-connections"),
        default=MAX_CONNECTIONS,
        metavar="N",
        help=(
            "client connections served at once; one more is answered 503 with Retry-After "
            f"(default {MAX_CONNECTIONS}; each holds up to three file descriptors with its "
            "legs, so keep the open-files limit above 3N)"
        ),
    )
    parser.add_argument(
        "--max-body-bytes",
        type=_positive_int_arg("--max-body-bytes"),
        default=MAX_BODY_BYTES,
        metavar="N",
        help=f"largest request body accepted, any framing (default {MAX_BODY_BYTES})",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (default INFO: one line per request)",
    )


def run(args: argparse.Namespace) -> int:
    """``kvpush proxy``: serves with the options of :func:`add_arguments` until SIGINT or
    SIGTERM."""
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
            mode=args.mode,
            health_interval_s=args.health_interval or None,
            max_body_bytes=args.max_body_bytes,
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
