"""One side (P or D) of the data-path benchmark, in its own process.

A worker is the tests' peer (:class:`kvpush_lab.peer.Worker`: a paged KV cache in numpy, written
page by page before anything is timed, and a kvpush :class:`~kvpush.Endpoint` with its native
writer thread) plus a plain NIXL agent over the same memory, driven from Python the way vLLM's
connector drives one. The coordinator (:mod:`kvpush_lab.bench.transfer`) runs each in its own
process (:class:`kvpush_lab.peer.RemoteWorker`); each command (a public method) runs one half of
one transfer and returns its timings.

Both paths poll at the cadence of kvpush's writer thread, and the Python agents run without
NIXL's progress thread (:mod:`kvpush_lab.plain_nixl` says why), so every wait below polls.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from kvpush_lab.cache import CacheShape
from kvpush_lab.peer import Worker
from kvpush_lab.plain_nixl import PlainAgent, nixl_module

#: Every 64-bit word of each side's cache before the first stamp.
FILLS = {"p": 0x0123_4567_89AB_CDEF, "d": 0}

Role = Literal["p", "d"]
Method = Literal["prepped", "initialize"]


class BenchWorker(Worker):
    """P or D: the tests' worker (the cache, stamped per repeat, and its kvpush endpoint, with
    the endpoint's own heartbeats) and a plain NIXL agent over the same memory. Public methods
    are the commands the coordinator sends."""

    def __init__(self, role: Role, shape: CacheShape) -> None:
        # Imported before the endpoint exists, so kvpush loads this wheel's C API (one UCX).
        nixl_module()
        super().__init__(
            role,
            shape,
            seed=None,
            transport="nixl",
            options={"agent_name": f"bench-{role}-kvpush"},
            fill=FILLS[role],
            engine=f"bench-{role}",
            compatibility="kvpush-bench",
            fast_peer_loss=False,
        )
        self.nixl = PlainAgent(
            f"bench-{role}-nixl", self.cache.address, self.cache.array.nbytes, telemetry=True
        )
        self.agent = self.nixl.agent
        self.peer_base = 0
        self.prepped: tuple[Any, Any] | None = None

    # ---- setup ------------------------------------------------------------------------------

    def hello(self) -> dict[str, Any]:
        return {
            "address": self.endpoint.address,
            "nixl_metadata": self.nixl.metadata(),
            "base": self.cache.address,
            "pretouch_s": self.cache.pretouch_s,
        }

    def connect(self, peer: dict[str, Any]) -> dict[str, float]:
        """Loads the peer's NIXL metadata; P also prepares both global descriptor lists (one
        descriptor per block per region), once, as vLLM does when a peer is added."""
        remote_agent = self.nixl.connect(peer["nixl_metadata"])
        self.peer_base = int(peer["base"])
        if self.role == "d":
            return {}
        started = time.perf_counter()
        every = np.arange(self.shape.descriptors, dtype=np.int64)
        local = self._descriptors(self.cache.address, every)
        remote = self._descriptors(self.peer_base, every)
        self.prepped = (
            self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM"),
            self.agent.prep_xfer_dlist(remote_agent, remote, "DRAM"),
        )
        return {"prep_dlists_s": time.perf_counter() - started}

    def _descriptors(self, base: int, indices: npt.NDArray[Any]) -> npt.NDArray[np.uint64]:
        """``(address, length, device)`` rows for blocks at ``indices`` of the region-major list."""
        rows = np.zeros((len(indices), 3), dtype=np.uint64)
        rows[:, 0] = base + indices.astype(np.uint64) * np.uint64(self.shape.block_bytes)
        rows[:, 1] = self.shape.block_bytes
        return rows

    # ---- kvpush -----------------------------------------------------------------------------

    def kvpush_ready(
        self, request_id: str, transfer_id: str, blocks: list[int], sequence: int
    ) -> None:
        """P: the request's KV is computed (stamped), so the write starts when D registers."""
        self.cache.stamp(sequence)
        tokens = len(blocks) * self.shape.block_tokens
        self.endpoint.ready(request_id, [blocks], tokens, transfer_id=transfer_id, ttl=60.0)

    def kvpush_receive(
        self,
        request_id: str,
        transfer_id: str,
        source: str,
        d_blocks: list[int],
        p_blocks: list[int],
        sequence: int,
        timeout: float,
    ) -> dict[str, Any]:
        """D: registers its blocks and waits (bounded) for the KV; returns D's view."""
        tokens = len(d_blocks) * self.shape.block_tokens
        started = self.endpoint.clock()
        self.endpoint.expect(
            request_id, source, [d_blocks], tokens, transfer_id=transfer_id, ttl=timeout
        )
        event = self.done(request_id, timeout)
        received = event["timeline"]["completed"] - started
        wrong = self.cache.wrong_blocks(sequence, np.asarray(p_blocks), np.asarray(d_blocks))
        return {"d_view_s": received, "bytes": event["bytes"], "wrong_blocks": wrong}

    def kvpush_sent(self, request_id: str, timeout: float) -> dict[str, Any]:
        """P: the send event of ``request_id``: its timeline, bytes and descriptor runs."""
        event = self.done(request_id, timeout)
        return {"timeline": event["timeline"], "bytes": event["bytes"], "runs": event["runs"]}

    # ---- plain NIXL from Python -------------------------------------------------------------

    def nixl_send(
        self, tag: str, method: Method, blocks: list[int], sequence: int, timeout: float
    ) -> dict[str, Any]:
        """P: waits for D's go (carrying D's block ids), then WRITEs the request with a
        completion notification and polls it to DONE."""
        if self.nixl.peer is None or self.prepped is None:
            raise RuntimeError("nixl_send before connect: P has no peer or descriptor lists")
        self.cache.stamp(sequence)
        p_blocks = np.asarray(blocks, dtype=np.int64)
        deadline = time.monotonic() + timeout
        payload = self.nixl.await_notification(f"go:{tag}:".encode(), deadline, self.role)
        d_blocks = np.frombuffer(payload, dtype=np.int32).astype(np.int64)
        done = f"done:{tag}".encode()

        started = time.perf_counter()
        local = self.shape.block_indices(p_blocks)
        remote = self.shape.block_indices(d_blocks)
        if method == "prepped":
            local_list, remote_list = self.prepped
            handle = self.agent.make_prepped_xfer(
                "WRITE", local_list, local, remote_list, remote, notif_msg=done
            )
        else:
            local_descs = self.nixl.descriptors(self._descriptors(self.cache.address, local))
            remote_descs = self.nixl.descriptors(self._descriptors(self.peer_base, remote))
            handle = self.agent.initialize_xfer(
                "WRITE", local_descs, remote_descs, self.nixl.peer, done
            )
        built = time.perf_counter()
        state = self.agent.transfer(handle)
        posted = time.perf_counter()
        self.nixl.complete(handle, state, deadline, tag)
        completed = time.perf_counter()
        telemetry = self.agent.get_xfer_telemetry(handle)
        self.agent.release_xfer_handle(handle)
        return {
            "plan_s": built - started,
            "control_s": posted - started,
            "total_s": completed - started,
            "bytes": int(telemetry.totalBytes),
            "descriptors": int(telemetry.descCount),
        }

    def nixl_receive(
        self, tag: str, d_blocks: list[int], p_blocks: list[int], sequence: int, timeout: float
    ) -> dict[str, Any]:
        """D: sends P the go with its block ids, then waits (bounded) for the WRITE's
        completion notification."""
        if self.nixl.peer is None:
            raise RuntimeError("nixl_receive before connect: D has no peer")
        go = f"go:{tag}:".encode() + np.asarray(d_blocks, dtype=np.int32).tobytes()
        deadline = time.monotonic() + timeout
        started = time.perf_counter()
        self.nixl.notify(go)
        self.nixl.await_notification(f"done:{tag}".encode(), deadline, self.role)
        received = time.perf_counter() - started
        wrong = self.cache.wrong_blocks(sequence, np.asarray(p_blocks), np.asarray(d_blocks))
        return {"d_view_s": received, "wrong_blocks": wrong}

    # ---- teardown ---------------------------------------------------------------------------

    def close(self) -> None:
        """Releases the NIXL lists, peer and registration, then closes the endpoint (always)."""
        try:
            if self.prepped is not None:
                for handle in self.prepped:
                    self.agent.release_dlist_handle(handle)
                self.prepped = None
            self.nixl.close()
        finally:
            super().close()
