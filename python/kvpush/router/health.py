"""Per-instance health checks: ``GET /health`` on every P and D, every ``interval_s``; an
instance that fails one is taken out of balancing, and put back by its next good answer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import aiohttp

from kvpush.router.instances import Instance

__all__ = ["HealthMonitor"]

logger = logging.getLogger("kvpush.router")


class HealthMonitor:
    """One task that checks ``instances`` every ``interval_s`` (each check bounded by
    ``timeout_s``), until :meth:`close`."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        instances: Sequence[Instance],
        interval_s: float,
        timeout_s: float,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"health check interval {interval_s} must be positive")
        self._session = session
        self._instances = list(instances)
        self._interval_s = interval_s
        self._timeout = aiohttp.ClientTimeout(total=min(timeout_s, interval_s * 4))
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="kvpush-router-health"
            )

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def check_all(self) -> None:
        """One round: every instance at once."""
        await asyncio.gather(*(self._check(instance) for instance in self._instances))

    async def _run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self._interval_s)

    async def _check(self, instance: Instance) -> None:
        try:
            async with self._session.get(
                instance.upstream.join("/health"), timeout=self._timeout
            ) as response:
                await response.read()
                problem = None if response.status == 200 else f"HTTP {response.status}"
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as error:
            problem = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        healthy = problem is None
        if healthy != instance.healthy:
            if healthy:
                logger.warning(
                    "%s %s: healthy again, back in rotation", instance.role, instance.url
                )
            else:
                logger.warning(
                    "%s %s: health check failed (%s), out of rotation until it answers",
                    instance.role,
                    instance.url,
                    problem,
                )
        if healthy:
            instance.healthy = True
        else:
            instance.taken_out()
