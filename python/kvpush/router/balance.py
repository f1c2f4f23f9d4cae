"""Choosing an instance for a leg: least outstanding legs among the healthy ones, ties broken
round-robin (so an idle pool is walked in turn), unhealthy ones skipped."""

from __future__ import annotations

from collections.abc import Sequence

from kvpush.router.instances import Instance, Role

__all__ = ["NoHealthyInstanceError", "Pool"]


class NoHealthyInstanceError(Exception):
    """Every instance of a role failed its last health check."""

    def __init__(self, role: Role, count: int) -> None:
        super().__init__(
            f"no healthy {role} instance: all {count} failed their last health check; retry shortly"
        )
        self.role = role


class Pool:
    """The P instances, or the D instances, of one router."""

    def __init__(self, role: Role, instances: Sequence[Instance]) -> None:
        if not instances:
            raise ValueError(f"the router needs at least one {role} instance")
        self.role = role
        self.instances = list(instances)
        self._cursor = 0

    def __len__(self) -> int:
        return len(self.instances)

    @property
    def healthy(self) -> int:
        return sum(1 for instance in self.instances if instance.healthy)

    def pick(self) -> Instance:
        """The healthy instance with the fewest outstanding legs; among equals, the first at or
        after the one after the last pick."""
        count = len(self.instances)
        best: Instance | None = None
        best_at = 0
        for step in range(count):
            at = (self._cursor + step) % count
            instance = self.instances[at]
            if instance.healthy and (best is None or instance.outstanding < best.outstanding):
                best, best_at = instance, at
        if best is None:
            raise NoHealthyInstanceError(self.role, count)
        self._cursor = (best_at + 1) % count
        return best
