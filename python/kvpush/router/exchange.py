"""One client request's legs to P and D, and the single decision of what ends it.

**Push** (kvpush, vLLM's ``NixlPushConnector``): both legs go out at once with one
``X-Request-Id`` and one ``transfer_id`` (bodies: :mod:`kvpush.router.bodies`). When P's
coordinates are not configured, the first request to that P goes serially (P, then D with the
identity P answered); every later one goes in parallel. **Pull** (vLLM's ``NixlConnector``): P
first, then D with the ``kv_transfer_params`` P answered.

The first of these decides what the client gets: D's answer begins (its first body byte, or
its error answer), P's leg fails, D's leg fails, the client hangs up, the router stops. A
failure that comes first aborts the legs still running (their connections are closed, which
vLLM takes for the client going away, so neither side works or holds KV for a lost request).
D's answer begins with its first body byte (a D waiting for P's KV cannot send one before the
KV is there); from then on D wins and P's failure is only logged. The log line is written once
both legs have ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import aiohttp
from multidict import CIMultiDictProxy

from kvpush.router.bodies import decode_body, prefill_body, pull_decode_body, pull_prefill_body
from kvpush.router.instances import Instance, PrefillCoordinates

__all__ = [
    "DecodeAnswer",
    "Exchange",
    "Leg",
    "LegFailedError",
    "Mode",
    "RouterStoppingError",
    "Timeouts",
]

logger = logging.getLogger("kvpush.router")

JSON = dict[str, Any]
Leg = Literal["prefill", "decode"]
Mode = Literal["push", "pull"]
_T = TypeVar("_T")


@dataclass(frozen=True)
class Timeouts:
    """Bounds, in seconds, on every wait of the router.

    ``prefill_s`` is how long P may take to answer (its whole prompt's prefill); ``decode_s``
    bounds each wait on D: for its first byte (a non-streaming D answers only when done) and
    between two streamed chunks. ``client_s`` bounds reading a client's body, each write to
    it, and an idle keep-alive connection.
    """

    connect_s: float = 5.0
    prefill_s: float = 600.0
    decode_s: float = 600.0
    client_s: float = 600.0

    def upstream(self, read_s: float) -> aiohttp.ClientTimeout:
        """One upstream request's bounds: connecting, and each read (``read_s``); no total, so
        a long stream is not cut."""
        return aiohttp.ClientTimeout(total=None, connect=self.connect_s, sock_read=read_s)


class LegFailedError(Exception):
    """A leg failed before D's answer began (or D's body broke off): what the client is told.

    ``status`` is the client's: 502, or 504 when the upstream did not answer in time.
    """

    def __init__(
        self, leg: Leg, request_id: str, detail: str, url: str, *, timed_out: bool = False
    ) -> None:
        super().__init__(f"request {request_id}: {leg} leg failed: {detail} from {url}")
        self.leg: Leg = leg
        self.request_id = request_id
        self.detail = detail
        self.url = url
        self.status = 504 if timed_out else 502


class RouterStoppingError(Exception):
    """The router stopped while the request's legs ran."""


def _describe(error: BaseException, timeout_s: float) -> str:
    if isinstance(error, aiohttp.ConnectionTimeoutError):
        return "cannot connect: timed out"
    if isinstance(error, asyncio.TimeoutError):
        return f"no answer within {timeout_s:g} s"
    if isinstance(error, aiohttp.ClientConnectorError):
        cause = error.os_error
        return f"cannot connect: {type(cause).__name__}: {cause.strerror or cause}"
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _error_detail(payload: bytes) -> str:
    """The ``message`` of an OpenAI-style error body, else its start."""
    text = payload.decode("utf-8", "replace")
    with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):
        error = json.loads(text)["error"]
        text = str(error["message"] if isinstance(error, dict) else error)
    text = " ".join(text.split())
    return text[:300] + ("…" if len(text) > 300 else "")


_LEG_ERRORS = (aiohttp.ClientError, OSError, asyncio.TimeoutError)


class DecodeAnswer:
    """D's answer once it has begun: status, headers, and its body as it comes.

    ``first`` is the start of the body (all of it for an error answer). :meth:`chunks` yields
    it and then the rest; it raises :class:`LegFailedError` when D's body breaks off or the
    exchange was aborted under it, and returns only after D's last byte.
    """

    def __init__(self, exchange: Exchange, response: aiohttp.ClientResponse, first: bytes) -> None:
        self._exchange = exchange
        self._response = response
        self.first = first
        self.status = response.status
        self.reason = response.reason or ""
        self.headers: CIMultiDictProxy[str] = response.headers
        chunked = "chunked" in response.headers.get("Transfer-Encoding", "").lower()
        self.length = None if chunked else response.content_length

    async def chunks(self) -> AsyncIterator[bytes]:
        exchange = self._exchange
        if self.first:
            yield self.first
        while True:
            try:
                data = await self._response.content.readany()
            except _LEG_ERRORS as error:
                raise exchange.decode_broke_off(
                    _describe(error, exchange.timeouts.decode_s)
                ) from None
            if exchange.cut is not None:
                raise exchange.decode_broke_off(exchange.cut)
            if not data:
                if not self._response.content.is_eof():
                    raise exchange.decode_broke_off("D's answer ended early")
                exchange.decode_complete()
                return
            yield data

    def close(self) -> None:
        self._response.close()


class Exchange:
    """One client request's legs. Made by :class:`~kvpush.router.core.Router`, which picked
    ``prefill`` and ``decode``; driven by :meth:`answer`, then :meth:`abort` if the request was
    lost, and always :meth:`finish` (which waits for the legs and writes the log line)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        mode: Mode,
        timeouts: Timeouts,
        prefill: Instance,
        decode: Instance,
        path: str,
        body: JSON,
        headers: Mapping[str, str],
        stopping: asyncio.Event,
    ) -> None:
        self.request_id = str(uuid.uuid4())
        self.transfer_id = str(uuid.uuid4()) if mode == "push" else ""
        self.mode: Mode = mode
        self.timeouts = timeouts
        self.prefill = prefill
        self.decode = decode
        self.path = path
        self.body = body
        self._session = session
        self._headers = {
            "Content-Type": "application/json",
            "Accept-Encoding": "identity",
            "X-Request-Id": self.request_id,
            **headers,
        }
        self._stopping = stopping
        self._tasks: list[asyncio.Task[Any]] = []
        self._answer: DecodeAnswer | None = None
        self._held: set[Leg] = {"prefill", "decode"}
        prefill.outstanding += 1
        decode.outstanding += 1
        self.started = time.monotonic()
        #: What cut the request short (the first failure, hang-up or stop), if anything.
        self.cut: str | None = None
        self.serial = False
        self.prefill_status: int | None = None
        self.prefill_s: float | None = None
        self.prefill_answer: JSON | None = None
        self.prefill_error: str | None = None
        self.decode_sent_s: float | None = None
        self.decode_status: int | None = None
        self.decode_first_s: float | None = None
        self.decode_done_s: float | None = None
        self.decode_error: str | None = None
        self.client_status: int | None = None

    # ---- what the client gets ----

    async def answer(self) -> DecodeAnswer:
        """Runs the legs until D's answer begins; raises :class:`LegFailedError` when a leg
        failed first, :class:`RouterStoppingError` when the router stopped first. Anything
        raised (a cancellation too: the client hung up) aborts the legs still running."""
        try:
            if self.mode == "pull":
                params = await self._pull_prefill()
                self._answer = await self._until_stopped(
                    self._decode_head(pull_decode_body(self.body, params))
                )
            else:
                coordinates = await self._coordinates()
                d_body = decode_body(self.body, coordinates, self.request_id, self.transfer_id)
                if self.serial:
                    self._answer = await self._until_stopped(self._decode_head(d_body))
                else:
                    self._answer = await self._both_legs(d_body)
            return self._answer
        except asyncio.CancelledError:
            self.abort("client hung up; both legs closed")
            raise
        except (LegFailedError, RouterStoppingError) as error:
            self.abort(str(error))
            raise
        except BaseException as error:
            self.abort(f"{type(error).__name__}: {error}")
            raise

    def decode_broke_off(self, detail: str) -> LegFailedError:
        """D's body ended early (or the exchange was aborted under it): P is aborted too."""
        if self.cut is None:
            self.decode_error = f"decode body broke off: {detail}"
        self.abort(self.cut or self.decode_error or detail)
        return LegFailedError("decode", self.request_id, detail, self.decode.url)

    def decode_complete(self) -> None:
        self.decode_done_s = time.monotonic() - self.started
        self._release("decode")

    def abort(self, cause: str) -> None:
        """The request is lost (``cause`` says why, unless an earlier cause did): every leg
        still running is closed."""
        if self.cut is None:
            self.cut = cause
        for task in self._tasks:
            task.cancel()
        if self._answer is not None:
            self._answer.close()

    def stop(self) -> None:
        """The router is stopping: a request whose answer is relaying is cut (one whose answer
        is complete keeps its P leg while the router waits for it)."""
        if self._answer is not None and self.decode_done_s is None:
            self.abort("proxy stopping")

    async def finish(self) -> None:
        """Waits for the legs (a P leg that outlives D's answer ends within its own timeout),
        then logs the request. Safe to call once, from a task that is being cancelled too."""
        settle = asyncio.ensure_future(self._settle())
        await asyncio.shield(settle)

    async def _settle(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._answer is not None and self.decode_done_s is None:
            self._answer.close()
        self._release("prefill")
        self._release("decode")
        self._log()

    # ---- the legs ----

    async def _coordinates(self) -> PrefillCoordinates:
        """P's coordinates; when not known yet, this request learns them with a serial P leg
        (others for the same P wait for it, and try themselves if it failed)."""
        instance = self.prefill
        while instance.coordinates is None:
            if instance.learning is not None:
                await asyncio.shield(instance.learning)
                continue
            learning = asyncio.get_running_loop().create_future()
            instance.learning = learning
            try:
                answer = await self._until_stopped(
                    self._prefill_leg(prefill_body(self.body, self.transfer_id))
                )
                params = answer.get("kv_transfer_params") or {}
                try:
                    coordinates = PrefillCoordinates.from_params(params)
                except ValueError as error:
                    self.prefill_error = f"cannot learn P's coordinates: {error}"
                    raise LegFailedError(
                        "prefill",
                        self.request_id,
                        f"{self.prefill_error}; configure them with --prefill "
                        "URL,engine_id=ID,side_channel=HOST:PORT",
                        self.prefill.url,
                    ) from None
                instance.coordinates = coordinates
                self.serial = True
                logger.info(
                    "prefill %s: learned engine %s, side channel %s:%d, tp %d, pp %d",
                    instance.url,
                    coordinates.engine_id,
                    coordinates.side_channel_host,
                    coordinates.side_channel_port,
                    coordinates.tp,
                    coordinates.pp,
                )
                return coordinates
            finally:
                instance.learning = None
                learning.set_result(None)
        return instance.coordinates

    async def _pull_prefill(self) -> JSON:
        answer = await self._until_stopped(self._prefill_leg(pull_prefill_body(self.body)))
        params = answer.get("kv_transfer_params")
        if not isinstance(params, dict) or not params:
            self.prefill_error = "P answered no kv_transfer_params"
            raise LegFailedError(
                "prefill",
                self.request_id,
                f"{self.prefill_error} (is it a pull connector's P?)",
                self.prefill.url,
            )
        return params

    async def _both_legs(self, d_body: JSON) -> DecodeAnswer:
        p_task = self._task(self._prefill_leg(prefill_body(self.body, self.transfer_id)), "P")
        d_task = self._task(self._decode_head(d_body), "D")
        stop = asyncio.ensure_future(self._stopping.wait())
        pending: set[asyncio.Future[Any]] = {p_task, d_task, stop}
        try:
            while True:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if stop in done:
                    raise RouterStoppingError(f"request {self.request_id}: the router is stopping")
                if p_task in done and not p_task.cancelled() and p_task.exception() is not None:
                    # P failed before D's answer began: P decides (D is aborted by answer()).
                    p_task.result()
                if d_task in done:
                    # D's answer began, or D failed: either way D decides; P is aborted on a
                    # failure (nobody takes its KV), else left to finish.
                    answer = d_task.result()
                    if answer.status >= 400:
                        p_task.cancel()
                    return answer
        finally:
            stop.cancel()

    def _task(self, coroutine: Coroutine[Any, Any, _T], leg: str) -> asyncio.Task[_T]:
        task = asyncio.get_running_loop().create_task(
            coroutine, name=f"kvpush-router-{leg}-{self.request_id[:8]}"
        )
        self._tasks.append(task)
        return task

    async def _until_stopped(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        """Runs ``coroutine`` as a leg task; RouterStoppingError if the router stops first."""
        task = self._task(coroutine, "leg")
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not task.done():
            raise RouterStoppingError(f"request {self.request_id}: the router is stopping")
        return task.result()

    async def _prefill_leg(self, body: JSON) -> JSON:
        """P's leg: send, read the whole answer; its JSON, or LegFailedError."""
        timeout = self.timeouts.upstream(self.timeouts.prefill_s)
        try:
            async with self._session.post(
                self.prefill.upstream.join(self.path),
                data=json.dumps(body).encode(),
                headers=self._headers,
                timeout=timeout,
            ) as response:
                self.prefill_status = response.status
                payload = await response.read()
                reason = response.reason
        except _LEG_ERRORS as error:
            self.prefill_error = _describe(error, self.timeouts.prefill_s)
            raise LegFailedError(
                "prefill",
                self.request_id,
                self.prefill_error,
                self.prefill.url,
                timed_out=isinstance(error, asyncio.TimeoutError),
            ) from None
        finally:
            self.prefill_s = time.monotonic() - self.started
            self._release("prefill")
        if response.status >= 400:
            self.prefill_error = f"HTTP {response.status} {reason}: {_error_detail(payload)}"
        else:
            try:
                answer = json.loads(payload)
                if not isinstance(answer, dict):
                    raise ValueError("not a JSON object")
            except ValueError as error:
                self.prefill_error = f"answer is not a JSON object ({error})"
            else:
                self.prefill_answer = answer
                return answer
        raise LegFailedError("prefill", self.request_id, self.prefill_error, self.prefill.url)

    async def _decode_head(self, body: JSON) -> DecodeAnswer:
        """D's leg until its answer begins: the head and first body bytes (all of an error
        answer). Raises LegFailedError when D cannot be reached or breaks off first."""
        timeout = self.timeouts.upstream(self.timeouts.decode_s)
        self.decode_sent_s = time.monotonic() - self.started
        response: aiohttp.ClientResponse | None = None
        try:
            response = await self._session.post(
                self.decode.upstream.join(self.path),
                data=json.dumps(body).encode(),
                headers=self._headers,
                timeout=timeout,
            )
            self.decode_status = response.status
            if response.status >= 400:
                first = await response.read()
                self.decode_error = f"HTTP {response.status} {response.reason}"
                self.decode_done_s = time.monotonic() - self.started
            else:
                first = await response.content.readany()
            self.decode_first_s = time.monotonic() - self.started
            return DecodeAnswer(self, response, first)
        except _LEG_ERRORS as error:
            if response is not None:
                response.close()
            self.decode_error = _describe(error, self.timeouts.decode_s)
            raise LegFailedError(
                "decode",
                self.request_id,
                self.decode_error,
                self.decode.url,
                timed_out=isinstance(error, asyncio.TimeoutError),
            ) from None
        except BaseException:
            if response is not None:
                response.close()
            raise

    def _release(self, leg: Leg) -> None:
        if leg in self._held:
            self._held.discard(leg)
            (self.prefill if leg == "prefill" else self.decode).outstanding -= 1

    def _log(self) -> None:
        total = time.monotonic() - self.started
        p_s = "-" if self.prefill_s is None else f"{self.prefill_s:.3f} s"
        p = f"prefill {self.prefill.url} {self.prefill_status or '-'} {p_s}"
        if self.serial:
            p += " (serial: learned P's coordinates)"
        if self.prefill_error:
            p += f" FAILED {self.prefill_error}"
        first = "-" if self.decode_first_s is None else f"{self.decode_first_s:.3f} s"
        d = f"decode {self.decode.url} {self.decode_status or '-'} first byte {first}"
        if self.decode_error:
            d += f" FAILED {self.decode_error}"
        failed = (
            self.cut is not None
            or self.prefill_error
            or self.decode_error
            or (self.client_status or 0) >= 400
        )
        logger.log(
            logging.WARNING if failed else logging.INFO,
            "request %s transfer %s %s %s -> %s%s | %s | %s | %.3f s",
            self.request_id,
            self.transfer_id or "-",
            self.mode,
            self.path,
            self.client_status or "-",
            f" ({self.cut})" if self.cut else "",
            p,
            d,
            total,
        )
