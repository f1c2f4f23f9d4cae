"""The connector's scheduler-side bookkeeping, in plain Python (no vLLM import).

The scheduler decides, per request, what the workers must do; the workers' native endpoints do
it. What crosses from the scheduler to the workers each step is a :class:`PushMetadata`:

* P: ``sends``: a finished prefill whose KV may be written to D (the blocks stay allocated
  until the workers report the send finished); ``aborts``: a prefill that ended without KV to
  send (D is told at once).
* D: ``recvs``: blocks allocated for a remote prefill, to register with P; ``cancels``: a
  request aborted while waiting for its KV.

Block lists are per KV cache group, for the groups kvpush moves (:class:`CacheGroups`), each
with the token its first block starts at: D lists its uncached blocks, P its computed ones, and
a sliding-window group on either side only its blocks from the window on (vLLM's table holds the
null block before it), so P and D name the same tokens of every group.

kv_transfer_params are vLLM's push-proxy contract (``do_remote_prefill``, ``do_remote_decode``,
``remote_engine_id``, ``remote_host``, ``remote_port``, ``tp_size``, ``pp_size``,
``remote_request_id``, ``transfer_id``), so an unchanged push router drives kvpush.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpush.vllm._layout import CacheGroups, window_start

REQUIRED_D_PARAMS = ("remote_host", "remote_port")

logger = logging.getLogger("vllm.kvpush")


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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


@dataclass
class PushMetadata:
    """One step's instructions from the scheduler to every worker."""

    sends: list[SendRequest] = field(default_factory=list)
    aborts: list[tuple[str, str | None]] = field(default_factory=list)
    recvs: list[RecvRequest] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    #: The step computes nothing (every request waits for its KV, or for P to finish sending):
    #: the workers may wait for transfer events instead of letting the engine spin.
    idle: bool = False

    def __bool__(self) -> bool:
        return bool(self.sends or self.aborts or self.recvs or self.cancels)


@dataclass(frozen=True)
class RemoteSource:
    """Where D finds P, as a request's kv_transfer_params name it."""

    host: str
    port: int
    tp_size: int


def remote_source(params: Mapping[str, Any]) -> RemoteSource | str:
    """P's coordinates from ``params``, or what is wrong with them (for the request's log line).

    Everything a router sends is checked here, before vLLM reserves a single block for the
    remote prefill: a bad request must fail alone, never inside the engine's step, where an
    exception kills the engine and every request it serves.
    """
    missing = [key for key in REQUIRED_D_PARAMS if params.get(key) in (None, "")]
    if missing:
        return (
            f"kv_transfer_params lack {', '.join(missing)}: the router must send P's side "
            "channel host and port with do_remote_prefill (the fields of P's own answer)"
        )
    host = params["remote_host"]
    if not isinstance(host, str):
        return f"remote_host must be a host name or address, not {host!r}"
    try:
        port = int(params["remote_port"])
        tp_size = 1 if params.get("tp_size") is None else int(params["tp_size"])
        pp_size = 1 if params.get("pp_size") is None else int(params["pp_size"])
    except (TypeError, ValueError) as error:
        return f"remote_port, tp_size and pp_size must be integers ({error})"
    if not 0 < port < 65_536:
        return f"remote_port {port} is not a TCP port"
    if tp_size < 1:
        return f"tp_size {tp_size} must be at least 1"
    if pp_size != 1:
        # A kvpush P refuses pipeline stages at startup, so this P is not kvpush's or the
        # router mixed up its fields: D would wait for stages that never write.
        return f"pp_size {pp_size}: kvpush pairs with single-stage prefill engines only"
    return RemoteSource(host, port, tp_size)


def _transfer_id(params: Mapping[str, Any]) -> str | None:
    value = params.get("transfer_id")
    return str(value) if value else None


class PushScheduler:
    """Per-request decisions of the scheduler role (P and D alike: a ``kv_both`` engine is
    both)."""

    def __init__(
        self, identity: Mapping[str, Any] | None = None, groups: CacheGroups | None = None
    ) -> None:
        #: The KV cache groups vLLM hands block lists for (None: one group, all of the cache).
        self._groups = groups
        #: P's identity, returned with every finished prefill's kv_transfer_params (engine id,
        #: side-channel host and base port, TP and PP sizes): a router that learns P from its
        #: answer (llm-d's push dispatch) forwards them to D, which needs nothing else.
        self._identity = dict(identity or {})
        self._pending = PushMetadata()
        self._sending: set[str] = set()
        self._receiving: set[str] = set()

    # ---- D --------------------------------------------------------------------------------

    @staticmethod
    def external_tokens(
        request_id: str,
        params: dict[str, Any] | None,
        prompt_tokens: int,
        num_computed: int,
    ) -> tuple[int, bool]:
        """How many prompt tokens P will write (loaded asynchronously), after D's local hit.

        A remote prefill whose kv_transfer_params do not say where P is falls back to a local
        prefill (0 tokens from P), with a warning naming the request: vLLM's contract lets a
        connector match nothing, and one bad request must not stop the others.
        """
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        source = remote_source(params)
        if isinstance(source, str):
            logger.warning(
                "kvpush: request %s: %s; prefilling it locally instead", request_id, source
            )
            params["do_remote_prefill"] = False
            return 0, False
        count = prompt_tokens - num_computed
        return (count, True) if count > 0 else (0, False)

    def allocated(
        self,
        request_id: str,
        params: dict[str, Any] | None,
        uncached_blocks: Sequence[Sequence[int]],
        num_computed: int,
        prompt_tokens: int,
        num_external: int,
    ) -> None:
        """D's blocks for a remote prefill are allocated: register them with P this step.

        ``params["do_remote_prefill"]`` is cleared so a re-entry (preemption) never registers
        twice with the same epoch. Only params that :meth:`external_tokens` accepted get here
        with external tokens.
        """
        if not params or not params.get("do_remote_prefill") or num_external <= 0:
            return
        source = remote_source(params)
        assert not isinstance(source, str), f"request {request_id}: {source}"
        params["do_remote_prefill"] = False
        self._receiving.add(request_id)
        blocks = self._moved(uncached_blocks)
        self._pending.recvs.append(
            RecvRequest(
                request_id=request_id,
                transfer_id=_transfer_id(params),
                remote_host=source.host,
                remote_port=source.port,
                remote_tp_size=source.tp_size,
                blocks=blocks,
                first_token=num_computed,
                num_tokens=prompt_tokens,
                first_tokens=self._uncached_starts(blocks, num_computed, prompt_tokens),
            )
        )

    def _moved(self, block_ids: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
        if self._groups is None:
            return tuple(tuple(group) for group in block_ids)
        return self._groups.select(block_ids)

    def _uncached_starts(
        self, blocks: tuple[tuple[int, ...], ...], num_computed: int, prompt_tokens: int
    ) -> tuple[int, ...]:
        """D: the first token of each group's uncached blocks. vLLM lists a group's blocks for
        ``[num_computed, prompt)``, except that a sliding-window group lacks those before its
        window (null blocks, left out of the list): its blocks are the prompt's last ones."""
        groups = self._groups
        if groups is None:
            return (num_computed,) * len(blocks)
        size = groups.block_size
        starts = []
        for windowed, group in zip(groups.windowed, blocks, strict=True):
            whole = -(-(prompt_tokens - num_computed) // size)
            if windowed and len(group) < whole:
                # A count that fits neither case is left to the planner, which refuses it.
                starts.append((-(-prompt_tokens // size) - len(group)) * size)
            else:
                starts.append(num_computed)
        return tuple(starts)

    # ---- P, and D's aborts ----------------------------------------------------------------

    def finished(
        self,
        request_id: str,
        params: dict[str, Any] | None,
        finished_normally: bool,
        blocks: Sequence[Sequence[int]],
        prompt_tokens: int,
    ) -> tuple[bool, dict[str, Any] | None]:
        """A request finished; returns vLLM's ``(delay_free_blocks, kv_transfer_params)``."""
        if not params:
            return False, None
        if request_id in self._receiving:
            # D: aborted while waiting for its KV. The scheduler keeps the blocks until the
            # workers report the receive finished, which they do once P confirmed the cancel.
            self._pending.cancels.append(request_id)
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        transfer_id = _transfer_id(params)
        if not finished_normally or not any(blocks):
            self._pending.aborts.append((request_id, transfer_id))
            return False, None
        self._sending.add(request_id)
        moved = self._moved(blocks)
        if self._groups is None:
            first_tokens: tuple[int, ...] = ()
        else:
            # vLLM's null block stands for the blocks a sliding window dropped: never sent (any
            # group: a null block is never KV), the group's list starts after them.
            starts = [window_start(group, self._groups.block_size) for group in moved]
            first_tokens = tuple(start for start, _ in starts)
            moved = tuple(kept for _, kept in starts)
        self._pending.sends.append(
            SendRequest(
                request_id=request_id,
                transfer_id=transfer_id,
                blocks=moved,
                num_tokens=prompt_tokens,
                first_tokens=first_tokens,
            )
        )
        return True, {
            **self._identity,
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_mode": "push",
            **({"transfer_id": transfer_id} if transfer_id else {}),
        }

    # ---- every step -----------------------------------------------------------------------

    def take_metadata(self) -> PushMetadata:
        """This step's instructions; the next step starts empty."""
        metadata, self._pending = self._pending, PushMetadata()
        return metadata

    def transfers_finished(self, sending: set[str], recving: set[str]) -> None:
        """The workers reported these sends and receives over."""
        self._sending -= sending
        self._receiving -= recving

    def has_pending_work(self) -> bool:
        """True while sends are unfinished: the engine must keep stepping to report them."""
        return bool(self._sending or self._pending)
