"""Type stubs of the native core (``kvpush._native``). Import from ``kvpush`` instead."""

import builtins
from collections.abc import Sequence
from typing import Any, Literal, final

from kvpush.outcomes import Reason

__all__ = [
    "PROTOCOL_VERSION",
    "REASON_CODES",
    "Arrival",
    "AuthenticationError",
    "BusyError",
    "Cancellation",
    "ConfigError",
    "Decoder",
    "DuplicateReadyError",
    "Encoder",
    "Endpoint",
    "Expired",
    "FencedError",
    "Finished",
    "InvalidBlocksError",
    "KvLayout",
    "KvPushError",
    "LayoutError",
    "MalformedMessageError",
    "MessageTooLargeError",
    "NixlUnavailableError",
    "NotMatchedError",
    "Plan",
    "PlanError",
    "Planner",
    "ProtocolError",
    "Region",
    "RendezvousError",
    "RendezvousTable",
    "StaleEpochError",
    "TableFullError",
    "TransferEvent",
    "TransportError",
    "UnhealthyError",
    "__version__",
    "canonical_request_id",
    "frame_length",
    "tp_sources",
    "transfer_key",
]

__version__: str
PROTOCOL_VERSION: int
REASON_CODES: list[str]

def transfer_key(request_id: str, transfer_id: str | None = None) -> str:
    """The key P and D both derive: ``transfer_id`` if given, else the canonical request id."""

def canonical_request_id(request_id: str) -> str:
    """A vLLM request id without its front-end prefix and per-engine random suffix."""

def tp_sources(
    tp_rank: int,
    tp_size: int,
    kv_heads: int,
    p_tp_size: int,
    *,
    total_kv_heads: int | None = None,
    mla: bool = False,
    slices_heads: bool = True,
) -> tuple[list[int], tuple[int, int] | None]:
    """Which of P's ``p_tp_size`` ranks hold the KV heads of D rank ``tp_rank`` of ``tp_size``
    (``kv_heads`` on the rank), and ``(slot, of)`` when one P rank writes into ``of`` D ranks.
    Raises ``LayoutError`` when the sizes cannot exchange KV."""

# --- layouts and planning -------------------------------------------------------------------

@final
class Region:
    """One array of kernel blocks: block ``k`` starts at ``base + k * block_stride``."""

    def __new__(cls, base: int, block_stride: int, num_blocks: int, group: int = 0) -> Region: ...
    @property
    def base(self) -> int: ...
    @property
    def block_stride(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def group(self) -> int: ...

@final
class KvLayout:
    """One worker's KV cache: regions, block sizes, heads and byte order. Validated on creation."""

    def __new__(
        cls,
        regions: Sequence[Region],
        *,
        block_tokens: int,
        heads: int,
        head_bytes: int,
        kernel_block_tokens: int | None = None,
        token_order: Literal["NHD", "HND"] = "NHD",
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> KvLayout: ...
    @property
    def regions(self) -> list[Region]: ...
    @property
    def block_tokens(self) -> int: ...
    @property
    def kernel_block_tokens(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def head_bytes(self) -> int: ...
    @property
    def token_order(self) -> Literal["NHD", "HND"]: ...
    @property
    def tp_rank(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    def to_dict(self) -> dict[str, Any]: ...
    @staticmethod
    def from_dict(layout: dict[str, Any]) -> KvLayout: ...

@final
class Plan:
    """The runs to WRITE for one request, merged where contiguous on both sides."""

    @property
    def bytes(self) -> int: ...
    @property
    def unmerged_runs(self) -> int: ...
    def __len__(self) -> int: ...
    def runs(self) -> list[tuple[int, int, int]]:
        """``(src_addr, dst_addr, length)`` triples."""

    def to_bytes(self) -> builtins.bytes:
        """The runs as native-endian ``uint64`` triples (``memoryview(...).cast("Q")``)."""

@final
class Planner:
    """Plans writes from one P rank's layout (source) into one D rank's layout (destination)."""

    def __new__(cls, src: KvLayout, dst: KvLayout) -> Planner: ...
    @property
    def writes_anything(self) -> bool:
        """False when the two ranks share no KV heads (nothing to write between them)."""

    def plan(
        self,
        request: str,
        num_tokens: int,
        src_blocks: Sequence[Sequence[int]] | Sequence[int],
        dst_blocks: Sequence[Sequence[int]] | Sequence[int],
        *,
        src_first_tokens: Sequence[int] | None = None,
        dst_first_tokens: Sequence[int] | None = None,
    ) -> Plan:
        """Runs for ``num_tokens`` tokens. Block lists are per KV group (a flat list is one
        group); ``*_first_tokens[g]`` is the token the group's first block starts at (D's
        prefix-cache hit: D lists only its uncached suffix)."""

# --- rendezvous -----------------------------------------------------------------------------

@final
class Arrival:
    """What inserting one half of a transfer did."""

    @property
    def matched(self) -> bool: ...
    @property
    def key(self) -> str: ...
    @property
    def epoch(self) -> int | None: ...
    @property
    def registration(self) -> Any: ...
    @property
    def ready(self) -> Any: ...
    @property
    def superseded(self) -> Any:
        """The registration a higher epoch replaced, if any."""

@final
class Finished:
    @property
    def outcome(self) -> Literal["done", "failed"]: ...
    @property
    def cancel_acknowledged(self) -> bool: ...
    @property
    def rematch(self) -> Arrival | None: ...

@final
class Cancellation:
    @property
    def status(self) -> Literal["not_found", "removed", "deferred"]: ...
    @property
    def registration(self) -> Any: ...
    @property
    def ready(self) -> Any: ...

@final
class Expired:
    @property
    def key(self) -> str: ...
    @property
    def epoch(self) -> int | None: ...
    @property
    def registration(self) -> Any: ...
    @property
    def ready(self) -> Any: ...
    @property
    def was_matched(self) -> bool: ...

@final
class RendezvousTable:
    """Thread-safe. Times are seconds on the table's own monotonic clock (``now()``); pass
    ``now=`` to drive it deterministically."""

    def __new__(
        cls, *, shards: int = 64, max_entries: int = 65536, fence_ttl: float = 60.0
    ) -> RendezvousTable: ...
    def now(self) -> float: ...
    def register(
        self,
        request_id: str,
        epoch: int,
        payload: Any,
        *,
        ttl: float,
        transfer_id: str | None = None,
        now: float | None = None,
    ) -> Arrival: ...
    def ready(
        self,
        request_id: str,
        payload: Any,
        *,
        ttl: float,
        transfer_id: str | None = None,
        now: float | None = None,
    ) -> Arrival: ...
    def begin_write(self, key: str, epoch: int) -> None: ...
    def finish(
        self, key: str, epoch: int, *, error: str | None = None, now: float | None = None
    ) -> Finished: ...
    def cancel(
        self, key: str, epoch: int | None = None, *, now: float | None = None
    ) -> Cancellation: ...
    def expire(self, *, now: float | None = None) -> list[Expired]: ...
    def __len__(self) -> int: ...
    @property
    def fences(self) -> int: ...

# --- push endpoint ---------------------------------------------------------------------------

@final
class TransferEvent:
    """How one request's transfer ended on this side."""

    @property
    def role(self) -> Literal["send", "receive"]: ...
    @property
    def request_id(self) -> str: ...
    @property
    def key(self) -> str: ...
    @property
    def outcome(self) -> Literal["done", "failed", "cancelled", "quarantined"]: ...
    @property
    def reason(self) -> str | None:
        """Why, when not done: the detail, for people (may be reworded)."""
    @property
    def code(self) -> Reason | None:
        """Why, when not done: the stable code programs and metrics branch on."""
    @property
    def bytes(self) -> int: ...
    @property
    def runs(self) -> int: ...
    @property
    def timeline(self) -> dict[str, float]:
        """Seconds on the endpoint's clock: registered, ready, matched, posted, completed."""

@final
class Endpoint:
    """A worker's push endpoint: side channel, rendezvous table and native writer thread.

    ``memory`` lists ``(address, length)`` of the KV cache buffers; they must stay allocated
    until :meth:`close` (for good, if close reports the writer thread stuck). With
    ``transport="nixl"`` the library is found by :func:`kvpush.nixl.library_path` unless
    ``nixl_library`` names it; the native writer thread drives NIXL's progress itself unless
    ``nixl_progress_thread`` asks for NIXL's own thread.
    Without a ``secret``, the side channel listens only on loopback and connects only to P
    workers on loopback, unless ``insecure`` opts out.
    """

    def __new__(
        cls,
        engine_id: str,
        layout: KvLayout,
        *,
        memory: Sequence[tuple[int, int]],
        transport: Literal["nixl", "loopback"] = "nixl",
        agent_name: str | None = None,
        nixl_library: str | None = None,
        nixl_progress_thread: bool = False,
        device: int | None = None,
        bind: str = "127.0.0.1:0",
        secret: builtins.bytes | None = None,
        compatibility: str = "",
        write_timeout: float = 10.0,
        heartbeat_interval: float = 1.0,
        peer_timeout: float = 5.0,
        connect_timeout: float = 3.0,
        insecure: bool = False,
        max_registrations_per_host: int = 16384,
        max_registration_bytes_per_host: int = 64 << 20,
        inbox_capacity: int = 16384,
        delivery_bound: float | None = None,
        pp_rank: int = 0,
        pp_size: int = 1,
    ) -> Endpoint: ...
    @property
    def address(self) -> str: ...
    @property
    def memory_space(self) -> tuple[Literal["dram", "vram"], int]:
        """Where the KV cache was registered: ("dram", 0) or ("vram", device)."""
    @property
    def write_horizon(self) -> float:
        """Seconds a D waits after losing this worker before handing its blocks back."""
    def health(self) -> str | None:
        """None while healthy; else why the writer stopped or stalled."""
    @property
    def pending(self) -> int: ...
    def ready(
        self,
        request_id: str,
        blocks: Sequence[Sequence[int]] | Sequence[int],
        num_tokens: int,
        *,
        transfer_id: str | None = None,
        first_tokens: Sequence[int] | None = None,
        ttl: float = 30.0,
    ) -> None: ...
    def abort(
        self, request_id: str, transfer_id: str | None = None
    ) -> Literal["released", "in_flight", "unknown"]:
        """Raises :class:`BusyError` when the writer is far behind: nothing was done."""
    def expect(
        self,
        request_id: str,
        source: str | Sequence[str],
        blocks: Sequence[Sequence[int]] | Sequence[int],
        num_tokens: int,
        *,
        transfer_id: str | None = None,
        first_tokens: Sequence[int] | None = None,
        epoch: int = 1,
        ttl: float = 30.0,
        share: tuple[int, int] | None = None,
    ) -> None:
        """D: register ``blocks`` with the P rank(s) at ``source`` and await the KV; ends in one
        event. A request id still awaited may be expected again only at a higher ``epoch``: the
        awaited receive is cancelled with P, and its own ("cancelled") event comes before the new
        one's. The same call again is ignored (the awaited receive's event answers both); another
        expectation at the same or a lower epoch is refused with its own ("refused") event.
        Raises :class:`BusyError` when the writer is far behind: nothing was done."""
    def cancel(self, request_id: str) -> None:
        """Raises :class:`BusyError` when the writer is far behind: nothing was done."""
    def poll(self) -> list[TransferEvent]:
        """Every event since the last call; never blocks, even while a thread is in wait()."""
    def wait(self, timeout: float) -> list[TransferEvent]: ...
    def clock(self) -> float: ...
    def stats(self) -> dict[str, int]: ...
    def close(self) -> str | None:
        """None, or what a writer thread stuck in a transport call still held when it was
        left running (the KV memory must then stay allocated)."""
    def __enter__(self) -> Endpoint: ...
    def __exit__(self, *args: object) -> bool: ...

# --- kvpush/1 protocol ----------------------------------------------------------------------

def frame_length(prefix: bytes, max_frame_bytes: int | None = None) -> int | None:
    """Total bytes of the frame ``prefix`` starts, or None while fewer than 4 bytes are known."""

@final
class Encoder:
    """Signs (with a secret) and frames messages; one per sender, safe to share across threads."""

    def __new__(cls, sender: str, secret: bytes | None = None) -> Encoder: ...
    @property
    def sender(self) -> str: ...
    @property
    def session(self) -> int:
        """The random nonce this encoder's frames carry (a new one per encoder)."""
    def encode(self, message: dict[str, Any], *, now_ms: int | None = None) -> bytes:
        """``message`` is ``{"kind": "register" | "done" | ..., **fields}``."""

@final
class Decoder:
    """Verifies and decodes frames; keeps the replay windows of its peers."""

    def __new__(
        cls,
        secret: bytes | None = None,
        *,
        max_frame_bytes: int | None = None,
        max_block_ids: int | None = None,
        max_clock_skew: float | None = None,
    ) -> Decoder:
        """``None`` takes the protocol's default limits (a clock skew of 30 s)."""
    def decode(self, frame: bytes, *, now_ms: int | None = None) -> dict[str, Any]:
        """``{"sender", "session", "seq", "ts_ms", "message": {"kind": ..., **fields}}``."""

# --- exceptions (re-exported by kvpush.exceptions) ------------------------------------------

class KvPushError(Exception):
    code: str

class LayoutError(KvPushError): ...
class PlanError(KvPushError): ...
class InvalidBlocksError(PlanError): ...
class RendezvousError(KvPushError): ...
class StaleEpochError(RendezvousError): ...
class FencedError(RendezvousError): ...
class DuplicateReadyError(RendezvousError): ...
class NotMatchedError(RendezvousError): ...
class TableFullError(RendezvousError): ...
class ProtocolError(KvPushError): ...
class MessageTooLargeError(ProtocolError): ...
class MalformedMessageError(ProtocolError): ...
class AuthenticationError(ProtocolError): ...
class TransportError(KvPushError): ...
class NixlUnavailableError(TransportError): ...
class ConfigError(KvPushError): ...
class UnhealthyError(KvPushError): ...
class BusyError(KvPushError): ...
