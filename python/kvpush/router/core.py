"""The router: P and D pools, their health checks, one HTTP client session, and the
exchanges in flight. Serves ``kvpush proxy`` (:mod:`kvpush.router.http`) and in-process callers
(:mod:`kvpush.router.client`) alike; lives on one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import aiohttp

from kvpush.router.balance import Pool
from kvpush.router.exchange import Exchange, Mode, Timeouts
from kvpush.router.health import HealthMonitor
from kvpush.router.instances import Instance, PrefillInstance

__all__ = ["Router"]

logger = logging.getLogger("kvpush.router")

JSON = dict[str, Any]


class Router:
    """Routes requests over ``prefill`` and ``decode`` in ``mode`` (``push`` or ``pull``).

    ``health_interval_s`` (None: off) checks every instance's ``/health`` that often and
    leaves out of balancing those that fail. :meth:`start` and :meth:`close` (idempotent) run
    on the loop that serves the requests; ``async with`` does both.
    """

    def __init__(
        self,
        prefill: Sequence[PrefillInstance],
        decode: Sequence[str],
        *,
        mode: Mode = "push",
        timeouts: Timeouts | None = None,
        health_interval_s: float | None = None,
    ) -> None:
        if mode not in ("push", "pull"):
            raise ValueError(f"mode {mode!r}: expected 'push' or 'pull'")
        if health_interval_s is not None and health_interval_s <= 0:
            raise ValueError(f"health_interval_s={health_interval_s} must be positive (or None)")
        self.mode: Mode = mode
        self.timeouts = timeouts or Timeouts()
        self.prefill = Pool("prefill", [Instance("prefill", p.url, p) for p in prefill])
        self.decode = Pool("decode", [Instance("decode", url) for url in decode])
        self._health_interval_s = health_interval_s
        self._session: aiohttp.ClientSession | None = None
        self._health: HealthMonitor | None = None
        self._stopping: asyncio.Event | None = None
        self._active: set[Exchange] = set()

    async def start(self) -> None:
        if self._session is not None:
            return
        self._stopping = asyncio.Event()
        # No connection limit (the proxy's client cap bounds the legs); bodies relayed as sent.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False
        )
        if self._health_interval_s is not None:
            self._health = HealthMonitor(
                self._session,
                [*self.prefill.instances, *self.decode.instances],
                self._health_interval_s,
                self.timeouts.connect_s,
            )
            self._health.start()

    async def close(self) -> None:
        """Aborts the requests in flight (their clients are told the router stopped), stops
        the health checks, and closes the client session."""
        if self._stopping is not None:
            self._stopping.set()
        for exchange in list(self._active):
            exchange.stop()
        if self._health is not None:
            await self._health.close()
            self._health = None
        # Let the exchanges just told to stop answer their clients before the session goes.
        for _ in range(50):
            if not self._active:
                break
            await asyncio.sleep(0.01)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> Router:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("kvpush router: not started (await router.start())")
        return self._session

    @contextlib.asynccontextmanager
    async def exchange(
        self, path: str, body: JSON, headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[Exchange]:
        """One request's legs on the least-loaded healthy P and D (NoHealthyInstanceError
        when a role has none); :meth:`Exchange.finish` runs on the way out."""
        session = self.session
        assert self._stopping is not None  # set by start() with the session
        prefill = self.prefill.pick()
        decode = self.decode.pick()
        exchange = Exchange(
            session,
            self.mode,
            self.timeouts,
            prefill,
            decode,
            path,
            body,
            headers or {},
            self._stopping,
        )
        self._active.add(exchange)
        try:
            yield exchange
        except BaseException as error:
            gone = isinstance(error, (asyncio.CancelledError, ConnectionError))
            exchange.abort("client hung up; both legs closed" if gone else type(error).__name__)
            raise
        finally:
            try:
                await exchange.finish()
            finally:
                self._active.discard(exchange)

    def health(self) -> JSON:
        """What ``/health`` says: each role's instances, and how many passed their check."""
        ok = self.prefill.healthy > 0 and self.decode.healthy > 0
        return {
            "status": "ok" if ok else "unavailable",
            "mode": self.mode,
            "prefill_instances": len(self.prefill),
            "decode_instances": len(self.decode),
            "prefill_healthy": self.prefill.healthy,
            "decode_healthy": self.decode.healthy,
        }
