"""The router as a library: one completion through P and D, in-process, with each leg's
timings, for the benchmark client and the end-to-end harness (the same legs, bodies and abort
rules as ``kvpush proxy``, without an HTTP hop in between).

:func:`complete` is the async call on a started :class:`~kvpush.router.core.Router`;
:class:`RouterThread` runs a router on a background loop for synchronous callers (threads of
a benchmark, a test) and :func:`complete_once` is one request with a router of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpush.router.balance import NoHealthyInstanceError
from kvpush.router.core import Router
from kvpush.router.exchange import (
    DecodeAnswer,
    Exchange,
    Leg,
    LegFailedError,
    Mode,
    RouterStoppingError,
    Timeouts,
)
from kvpush.router.instances import PrefillInstance
from kvpush.router.loop import LoopThread

__all__ = ["Completion", "RouterThread", "complete", "complete_once"]

JSON = dict[str, Any]


@dataclass
class Completion:
    """One request as the router saw it. Times are seconds after it went out (None where it
    never happened); ``error`` says what failed, on ``failed_leg``."""

    request_id: str = ""
    transfer_id: str = ""
    #: Unix time the request went out (``time.time()``), and the monotonic clock then.
    sent: float = 0.0
    mono_sent: float = 0.0
    prefill_status: int | None = None
    #: P's answer (its JSON body) and when it came.
    prefill_response: JSON | None = None
    prefill_s: float | None = None
    #: When D's leg went out (0 for parallel push legs; after P's answer for pull and a
    #: serial first request), D's status, and when its first and last token came.
    decode_sent_s: float | None = None
    status: int | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    #: Streamed events that carried choices (one per token for vLLM), or 1 for a whole answer.
    chunks: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    #: D's non-streamed answer (JSON), or None when streamed.
    response: JSON | None = None
    failed_leg: Leg | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token_s is not None

    @property
    def decode_s(self) -> float | None:
        """D's leg, from when it went out to its last token."""
        if self.last_token_s is None or self.decode_sent_s is None:
            return None
        return self.last_token_s - self.decode_sent_s

    def _fail(self, leg: Leg, detail: str) -> None:
        if self.error is None:
            self.failed_leg, self.error = leg, detail


def _choice(event: JSON) -> JSON | None:
    choices = event.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0]
    return None


def _take_choice(completion: Completion, choice: JSON) -> None:
    text = choice.get("text")
    if text is None and isinstance(choice.get("delta"), dict):
        text = choice["delta"].get("content")
    if text is None and isinstance(choice.get("message"), dict):
        text = choice["message"].get("content")
    completion.text += text or ""
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        completion.token_ids.extend(int(i) for i in ids)


async def _read_stream(answer: DecodeAnswer, completion: Completion) -> None:
    """D's SSE stream: each ``data:`` event's choices, up to ``[DONE]``."""
    buffer = b""
    done = False
    async for data in answer.chunks():
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        for raw in lines:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:") or done:
                continue
            payload = line[len("data:") :].strip()
            if payload == "[DONE]":
                done = True
                continue
            event = json.loads(payload)
            if "error" in event:
                completion._fail("decode", f"error event: {json.dumps(event['error'])[:300]}")
                return
            choice = _choice(event)
            if choice is not None:
                now = time.monotonic() - completion.mono_sent
                if completion.first_token_s is None:
                    completion.first_token_s = now
                completion.last_token_s = now
                completion.chunks += 1
                _take_choice(completion, choice)
    if not done:
        completion._fail("decode", "the stream ended without [DONE]")
    elif completion.first_token_s is None:
        completion._fail("decode", "no token streamed")


async def _read_whole(answer: DecodeAnswer, completion: Completion) -> None:
    payload = b"".join([data async for data in answer.chunks()])
    completion.first_token_s = completion.last_token_s = time.monotonic() - completion.mono_sent
    response = json.loads(payload)
    if not isinstance(response, dict):
        raise ValueError("D's answer is not a JSON object")
    completion.response = response
    completion.chunks = 1
    choice = _choice(response)
    if choice is not None:
        _take_choice(completion, choice)


def _take_legs(completion: Completion, exchange: Exchange) -> None:
    completion.request_id = exchange.request_id
    completion.transfer_id = exchange.transfer_id
    completion.prefill_status = exchange.prefill_status
    completion.prefill_response = exchange.prefill_answer
    completion.prefill_s = exchange.prefill_s
    completion.decode_sent_s = exchange.decode_sent_s
    completion.status = exchange.decode_status


async def complete(
    router: Router,
    body: JSON,
    *,
    path: str = "/v1/completions",
    headers: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
) -> Completion:
    """One request through ``router`` (started), streamed if ``body["stream"]``; never
    raises for a failed request (see ``error``). Past ``timeout_s`` both legs are closed and
    the leg still awaited (P until it answered, else D) is the one that failed."""
    completion = Completion(sent=time.time(), mono_sent=time.monotonic())
    try:
        async with router.exchange(path, body, headers) as exchange:
            completion.request_id = exchange.request_id
            completion.transfer_id = exchange.transfer_id
            try:
                await asyncio.wait_for(_run(exchange, body, completion), timeout_s)
            except asyncio.TimeoutError:
                exchange.abort(f"past the request's deadline of {timeout_s:g} s")
                leg: Leg = "decode" if exchange.prefill_s is not None else "prefill"
                completion._fail(leg, f"no answer within the request's deadline of {timeout_s:g} s")
            except LegFailedError as error:
                completion._fail(error.leg, error.detail)
            except RouterStoppingError:
                leg = "decode" if exchange.prefill_s is not None else "prefill"
                completion._fail(leg, "the router stopped")
            except ValueError as error:
                completion._fail("decode", f"D's answer is not JSON: {error}")
        _take_legs(completion, exchange)
    except NoHealthyInstanceError as error:
        completion._fail(error.role, str(error))
    return completion


async def _run(exchange: Exchange, body: JSON, completion: Completion) -> None:
    answer = await exchange.answer()
    if answer.status >= 400:
        payload = b"".join([data async for data in answer.chunks()])
        text = " ".join(payload.decode("utf-8", "replace").split())[:300]
        completion._fail("decode", f"HTTP {answer.status}: {text}")
        exchange.client_status = answer.status
        return
    if body.get("stream"):
        await _read_stream(answer, completion)
    else:
        await _read_whole(answer, completion)
    exchange.client_status = answer.status


class RouterThread:
    """A :class:`Router` on its own background loop, for synchronous callers: :meth:`complete`
    blocks the calling thread (any number of threads at once); :meth:`close` is idempotent."""

    def __init__(
        self,
        prefill: Sequence[PrefillInstance],
        decode: Sequence[str],
        *,
        mode: Mode = "push",
        timeouts: Timeouts | None = None,
        health_interval_s: float | None = None,
    ) -> None:
        self.router = Router(
            prefill, decode, mode=mode, timeouts=timeouts, health_interval_s=health_interval_s
        )
        self._loop = LoopThread("kvpush-router-client")
        try:
            self._loop.run(self.router.start())
        except BaseException:
            self._loop.close()
            raise

    def complete(
        self,
        body: JSON,
        *,
        path: str = "/v1/completions",
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Completion:
        return self._loop.run(
            complete(self.router, body, path=path, headers=headers, timeout_s=timeout_s)
        )

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop was closed already
            self._loop.run(self.router.close(), timeout_s=10.0)
        self._loop.close()

    def __enter__(self) -> RouterThread:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def complete_once(
    prefill: PrefillInstance,
    decode: str,
    body: JSON,
    *,
    mode: Mode = "push",
    path: str = "/v1/completions",
    headers: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
    timeouts: Timeouts | None = None,
) -> Completion:
    """One request with a router of its own, on a loop of its own (for a test's thread)."""

    async def once() -> Completion:
        async with Router([prefill], [decode], mode=mode, timeouts=timeouts) as router:
            return await complete(router, body, path=path, headers=headers, timeout_s=timeout_s)

    return asyncio.run(once())
