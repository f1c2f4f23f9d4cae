"""What the connector's scheduler side sends its workers each step, in plain Python (no vLLM
import): a :class:`PushMetadata` (vLLM's ``KVConnectorMetadata`` wrapper around it,
``KvPushMetadata``, is in :mod:`kvpush.vllm.connector`).

* P: ``sends``: a finished prefill whose KV may be written to D (the blocks stay allocated
  until the workers report the send finished); ``aborts``: a prefill that ended without KV to
  send (D is told at once); ``streams`` (layer-wise push): a prefill that ends in this step's
  forward, each of whose layers may be written to D as soon as the layer ran.
* D: ``recvs``: blocks allocated for a remote prefill, to register with P; ``cancels``: a
  request aborted while waiting for its KV; ``refused``: a remote prefill vLLM waits for that
  cannot be registered (the workers report it failed, so ``kv_load_failure_policy`` applies).

Block lists are per KV cache group, for the groups kvpush moves
(:class:`~kvpush.vllm._layout.CacheGroups`), each with the token its first block starts at: D
lists its uncached blocks, P its computed ones, and a sliding-window group on either side only
its blocks from the window on (vLLM's table holds the null block before it), so P and D name the
same tokens of every group.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["PushMetadata", "RecvRefused", "RecvRequest", "SendRequest"]

# The requests below are read-only by convention, not frozen: a frozen dataclass assigns each
# field through ``object.__setattr__``, which costs 1.5 µs a request on the scheduler's thread.


@dataclass(slots=True)
class SendRequest:
    """P: the KV of ``request_id`` is computed in ``blocks`` (per KV group)."""

    request_id: str
    transfer_id: str | None
    blocks: tuple[tuple[int, ...], ...]
    num_tokens: int
    #: Per group, the token its first listed block starts at (past a sliding window's null
    #: blocks); empty: 0 for every group.
    first_tokens: tuple[int, ...] = ()
    #: Unix time the scheduler saw the prefill finish: the worker's ``ready`` follows when the
    #: next step's metadata reaches it (before that step's forward), and the timeline shows
    #: that wait.
    decided_at: float = field(default_factory=time.time)


@dataclass(slots=True)
class RecvRequest:
    """D: register ``blocks`` (the uncached suffix from ``first_token``) with P."""

    request_id: str
    transfer_id: str | None
    remote_host: str
    remote_port: int
    remote_tp_size: int
    blocks: tuple[tuple[int, ...], ...]
    first_token: int
    num_tokens: int
    #: Per group, the token its first listed block starts at: ``first_token``, or later for a
    #: sliding-window group whose blocks before the window vLLM never allocated; empty:
    #: ``first_token`` for every group.
    first_tokens: tuple[int, ...] = ()
    #: Unix time the scheduler allocated D's blocks (the registration leaves when this step's
    #: metadata reaches the worker, before the forward).
    decided_at: float = field(default_factory=time.time)


@dataclass(slots=True)
class RecvRefused:
    """D: a remote prefill vLLM already waits for (its blocks are allocated) that the scheduler
    cannot register: every worker reports it finished and failed, so vLLM's
    ``kv_load_failure_policy`` decides (recompute it locally, or fail it)."""

    request_id: str
    #: The request's allocated blocks, all groups (load errors where vLLM takes them).
    blocks: tuple[int, ...]
    reason: str


@dataclass
class PushMetadata:
    """One step's instructions from the scheduler to every worker."""

    sends: list[SendRequest] = field(default_factory=list)
    #: P, layer-wise push: the KV the step's forward finishes, as its ``sends`` will name it.
    streams: list[SendRequest] = field(default_factory=list)
    aborts: list[tuple[str, str | None]] = field(default_factory=list)
    #: P, layer-wise push: prefills aborted after a step streamed them. vLLM keeps their blocks
    #: (a layer's WRITE may still read them) until the workers report each finished sending.
    stream_aborts: list[tuple[str, str | None]] = field(default_factory=list)
    recvs: list[RecvRequest] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    refused: list[RecvRefused] = field(default_factory=list)
    #: The step computes nothing (every request waits for its KV, or for P to finish sending):
    #: the workers may wait for transfer events instead of letting the engine spin.
    idle: bool = False

    def __bool__(self) -> bool:
        return bool(
            self.sends
            or self.streams
            or self.aborts
            or self.stream_aborts
            or self.recvs
            or self.cancels
            or self.refused
        )
