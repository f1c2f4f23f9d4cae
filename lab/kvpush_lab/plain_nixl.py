"""Plain NIXL: one agent of NIXL's Python API over one buffer, driven from Python the way vLLM's
connectors drive theirs; the baseline the transfer benchmark and the GPU check measure kvpush's
data path against.

The agent runs without NIXL's progress thread: that thread busy-spins a whole core (its poll
delay is hard-wired to 0 in the Python API), which on a small machine would slow both paths and
measure the scheduler instead of the transfer. Without it, whoever waits must progress the agent,
so every wait here polls, at the cadence of kvpush's writer thread (:data:`POLL_INTERVAL`).
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from typing import Any

import numpy as np

import kvpush
from kvpush.exceptions import NixlUnavailableError

#: How often a waiting side polls: kvpush's writer thread polls every 200 µs while a write is in
#: flight or a DONE awaited, so the Python baseline does the same.
POLL_INTERVAL = 200e-6


def nixl_module() -> Any:
    """NIXL's Python API from the wheel kvpush's native side loads too, so both share one UCX."""
    errors = []
    for name in kvpush.nixl.WHEEL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as error:  # absent, or its bindings built for another Python
            errors.append(f"{name}: {error}")
            continue
        if "NIXL_LOG_LEVEL" not in os.environ:
            # Its INFO lines (one per agent and backend) would interleave with the progress.
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return module
    raise NixlUnavailableError(
        f"no NIXL Python API found ({'; '.join(errors)}): kvpush's data path is compared with "
        "NIXL driven from Python; pip install nixl-cu12"
    )


class PlainAgent:
    """A NIXL agent (UCX, no progress thread) with ``nbytes`` at ``address`` registered as
    ``memory`` (DRAM or VRAM) of ``device``, at most one remote agent, and the notifications
    taken but not yet awaited."""

    def __init__(
        self,
        name: str,
        address: int,
        nbytes: int,
        *,
        memory: str = "DRAM",
        device: int = 0,
        telemetry: bool = False,
    ) -> None:
        nixl = nixl_module()
        config = nixl.nixl_agent_config(
            enable_prog_thread=False, capture_telemetry=telemetry, backends=["UCX"]
        )
        self.agent = nixl.nixl_agent(name, config)
        self.memory = memory
        self.device = device
        whole = np.array([[address, nbytes, device]], dtype=np.uint64)
        self.registration = self.agent.register_memory(whole, memory)
        self.peer: str | None = None
        self.inbox: list[bytes] = []

    def metadata(self) -> bytes:
        """What the peer's :meth:`connect` takes."""
        metadata: bytes = self.agent.get_agent_metadata()
        return metadata

    def connect(self, metadata: bytes) -> str:
        self.peer = self.agent.add_remote_agent(metadata)
        return self.peer

    def descriptors(self, rows: np.ndarray) -> Any:
        """Transfer descriptors of ``(address, length, device)`` rows in this agent's memory."""
        return self.agent.get_xfer_descs(rows, self.memory)

    def complete(self, handle: Any, state: str, deadline: float, what: str) -> None:
        """Polls the posted transfer ``handle`` (``state``: what posting it returned) until it
        is DONE; TimeoutError past ``deadline``, RuntimeError if it ends otherwise."""
        while state == "PROC":
            if time.monotonic() > deadline:
                raise TimeoutError(f"NIXL WRITE {what}: not DONE in time")
            time.sleep(POLL_INTERVAL)
            state = self.agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL WRITE {what} ended in state {state}")

    def notify(self, message: bytes) -> None:
        """Sends ``message`` to the peer."""
        self.agent.send_notif(self.peer, message)

    def await_notification(self, prefix: bytes, deadline: float, what: str) -> bytes:
        """The rest of the first notification starting with ``prefix``. Polling is what
        progresses the agent; notifications for later requests are kept."""
        while True:
            for i, message in enumerate(self.inbox):
                if message.startswith(prefix):
                    del self.inbox[i]
                    return message[len(prefix) :]
            for messages in self.agent.get_new_notifs().values():
                self.inbox.extend(messages)
            if not any(m.startswith(prefix) for m in self.inbox):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what}: no NIXL notification {prefix!r} in time")
                time.sleep(POLL_INTERVAL)

    def close(self) -> None:
        """Forgets the peer and deregisters the memory."""
        if self.peer is not None:
            self.agent.remove_remote_agent(self.peer)
            self.peer = None
        self.agent.deregister_memory(self.registration)
