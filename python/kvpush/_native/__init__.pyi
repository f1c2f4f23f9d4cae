"""Type stubs of the native core (``kvpush._native``). Import from ``kvpush`` instead."""

import builtins
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Literal, Protocol, final

from typing_extensions import Buffer, Self, disjoint_base

from kvpush._native import lab as lab

__all__ = [
    "PROTOCOL_VERSION",
    "AbortOutcome",
    "AuthenticationError",
    "BusyError",
    "ConfigError",
    "DuplicateReadyError",
    "Endpoint",
    "EndpointOptions",
    "FencedError",
    "InvalidBlocksError",
    "KvLayout",
    "KvPushError",
    "LayerStreams",
    "LayoutError",
    "MalformedMessageError",
    "MessageTooLargeError",
    "NixlUnavailableError",
    "NotMatchedError",
    "Outcome",
    "PlanError",
    "ProtocolError",
    "Reason",
    "Region",
    "RendezvousError",
    "Role",
    "StaleEpochError",
    "TableFullError",
    "Timeline",
    "TransferEvent",
    "TransportError",
    "UnhealthyError",
    "__version__",
    "canonical_request_id",
    "lab",
    "tp_sources",
    "transfer_key",
]

__version__: str
PROTOCOL_VERSION: int

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

# --- push endpoint ---------------------------------------------------------------------------

class _Code:
    """A code enum's member: equal to its stable code (and hashed like it); ``str()`` is it."""

    def __new__(cls, code: str) -> Self:
        """The member of that code, as Python's enums look one up by value (``from_code``
        gives the class's own object)."""

    @property
    def value(self) -> str:
        """The stable code (metric labels, JSON, logs)."""
    @property
    def name(self) -> str: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __ne__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class Role(_Code):
    """Which side of a transfer an event is from."""

    SEND: ClassVar[Role]
    RECEIVE: ClassVar[Role]
    @classmethod
    def members(cls) -> list[Role]: ...
    @classmethod
    def from_code(cls, code: str) -> Role: ...

@final
class Outcome(_Code):
    """How a transfer ended on this side (``QUARANTINED`` is a notice: the final event follows)."""

    DONE: ClassVar[Outcome]
    FAILED: ClassVar[Outcome]
    CANCELLED: ClassVar[Outcome]
    QUARANTINED: ClassVar[Outcome]
    @classmethod
    def members(cls) -> list[Outcome]: ...
    @classmethod
    def from_code(cls, code: str) -> Outcome: ...

@final
class Reason(_Code):
    """Why a transfer ended without its KV: the stable codes programs and metrics branch on."""

    ABORTED: ClassVar[Reason]
    CANCELLED: ClassVar[Reason]
    EXPIRED: ClassVar[Reason]
    REFUSED: ClassVar[Reason]
    LEASE_LAPSED: ClassVar[Reason]
    INCOMPATIBLE: ClassVar[Reason]
    WRITE_ERROR: ClassVar[Reason]
    PEER_LOST: ClassVar[Reason]
    UNREACHABLE: ClassVar[Reason]
    QUARANTINED: ClassVar[Reason]
    CLOSED: ClassVar[Reason]
    WRITER_DIED: ClassVar[Reason]
    @classmethod
    def members(cls) -> list[Reason]: ...
    @classmethod
    def from_code(cls, code: str) -> Reason: ...

@final
class AbortOutcome(_Code):
    """What ``Endpoint.abort`` did."""

    RELEASED: ClassVar[AbortOutcome]
    IN_FLIGHT: ClassVar[AbortOutcome]
    UNKNOWN: ClassVar[AbortOutcome]
    @classmethod
    def members(cls) -> list[AbortOutcome]: ...
    @classmethod
    def from_code(cls, code: str) -> AbortOutcome: ...

@final
class Timeline:
    """Seconds on the endpoint's clock at which each step happened (None: not taken); also a
    read-only mapping of the steps taken."""

    def __new__(
        cls,
        *,
        registered: float | None = None,
        streamed: float | None = None,
        ready: float | None = None,
        matched: float | None = None,
        posted: float | None = None,
        completed: float | None = None,
    ) -> Timeline: ...
    @property
    def registered(self) -> float | None: ...
    @property
    def streamed(self) -> float | None:
        """P, layer-wise push: the first layer's WRITE was posted (before ``ready``)."""
    @property
    def ready(self) -> float | None: ...
    @property
    def matched(self) -> float | None: ...
    @property
    def posted(self) -> float | None: ...
    @property
    def completed(self) -> float | None: ...
    def items(self) -> list[tuple[str, float]]: ...
    def keys(self) -> list[str]: ...
    def get(self, step: str, default: float | None = None) -> float | None: ...
    def __getitem__(self, step: str, /) -> float: ...
    def __contains__(self, step: str, /) -> bool: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[str]: ...

@final
class TransferEvent:
    """How one request's transfer ended on this side."""

    @property
    def role(self) -> Role: ...
    @property
    def request_id(self) -> str: ...
    @property
    def key(self) -> str: ...
    @property
    def outcome(self) -> Outcome: ...
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
    def streamed_bytes(self) -> int:
        """P, layer-wise push: of ``bytes``, those written layer by layer before ``ready``."""
    @property
    def rewritten_bytes(self) -> int:
        """P, layer-wise push of a prompt computed in chunks: of ``bytes``, those written again
        (D's block holding an earlier chunk's last token)."""
    @property
    def timeline(self) -> Timeline: ...

@final
class EndpointOptions:
    """How an endpoint runs; each setting checked when made. Without a ``secret``, the side
    channel listens only on loopback and connects only to P workers on loopback, unless
    ``insecure`` opts out. The NIXL writer drives NIXL's progress itself unless
    ``nixl_progress_thread`` asks for NIXL's own thread."""

    def __new__(
        cls,
        *,
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
        busy_poll: float = 0.0002,
        insecure: bool = False,
        max_registrations_per_host: int = 16384,
        max_registration_bytes_per_host: int = 64 << 20,
        inbox_capacity: int = 16384,
        max_connections: int = 256,
        max_connections_per_host: int = 32,
        max_handshakes: int = 16,
        delivery_bound: float | None = None,
        pp_rank: int = 0,
        pp_size: int = 1,
    ) -> EndpointOptions: ...
    def replace(self, **changes: Any) -> EndpointOptions: ...
    @property
    def transport(self) -> Literal["nixl", "loopback"]: ...
    @property
    def agent_name(self) -> str | None: ...
    @property
    def nixl_library(self) -> str | None: ...
    @property
    def nixl_progress_thread(self) -> bool: ...
    @property
    def device(self) -> int | None: ...
    @property
    def bind(self) -> str: ...
    @property
    def has_secret(self) -> bool: ...
    @property
    def compatibility(self) -> str: ...
    @property
    def write_timeout(self) -> float: ...
    @property
    def heartbeat_interval(self) -> float: ...
    @property
    def peer_timeout(self) -> float: ...
    @property
    def connect_timeout(self) -> float: ...
    @property
    def busy_poll(self) -> float:
        """Seconds between the writer's polls while a WRITE is in flight or a receive awaits its
        DONEs (10 µs to 100 ms): longer costs less CPU and notices a completion that much later."""
    @property
    def insecure(self) -> bool: ...
    @property
    def max_registrations_per_host(self) -> int: ...
    @property
    def max_registration_bytes_per_host(self) -> int: ...
    @property
    def inbox_capacity(self) -> int: ...
    @property
    def max_connections(self) -> int:
        """Most side-channel connections held at once (a P holds one per D rank)."""
    @property
    def max_connections_per_host(self) -> int: ...
    @property
    def max_handshakes(self) -> int:
        """Most connections in their handshake at once; a D turned away tries again."""
    @property
    def delivery_bound(self) -> float | None: ...
    @property
    def pp_rank(self) -> int: ...
    @property
    def pp_size(self) -> int: ...

#: Block ids: a sequence of ints, or a one-dimensional buffer of integers (a numpy array,
#: ``array.array``), per KV group or flat for one group.
_BlockIds = Sequence[int] | Buffer
_Blocks = Sequence[_BlockIds] | _BlockIds

class _Stream(Protocol):
    """A request's KV as :meth:`Endpoint.layers_ready` takes it, as attributes."""

    @property
    def request_id(self) -> str: ...
    @property
    def blocks(self) -> _Blocks: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def transfer_id(self) -> str | None: ...
    @property
    def first_tokens(self) -> Sequence[int] | None: ...

@final
class LayerStreams:
    """Layer-wise push: the requests whose prefill one forward pass computes, read once, so
    that each layer's :meth:`Endpoint.streams_ready` converts nothing."""

    def __new__(cls, streams: Sequence[_Stream] = ...) -> Self: ...
    @property
    def request_ids(self) -> list[str]: ...
    def blocks(self) -> list[list[list[int]]]:
        """Each request's block ids per KV group, in order."""
    def without(self, request_ids: builtins.set[str]) -> LayerStreams:
        """These streams but those of ``request_ids``."""
    def __len__(self) -> int: ...

@disjoint_base
class Endpoint:
    """A worker's push endpoint (use ``kvpush.Endpoint``, which finds NIXL's library).

    ``memory`` lists ``(address, length)`` of the KV cache buffers; they must stay allocated
    until :meth:`close` (for good, if close reports the writer thread stuck).
    """

    def __new__(
        cls,
        engine_id: str,
        layout: KvLayout,
        *,
        memory: Sequence[tuple[int, int]],
        options: EndpointOptions,
    ) -> Self: ...
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
        blocks: _Blocks,
        num_tokens: int,
        *,
        transfer_id: str | None = None,
        first_tokens: Sequence[int] | None = None,
        ttl: float = 30.0,
    ) -> None: ...
    def layers_ready(
        self,
        request_id: str,
        blocks: _Blocks,
        num_tokens: int,
        start: int,
        end: int,
        *,
        transfer_id: str | None = None,
        first_tokens: Sequence[int] | None = None,
    ) -> None:
        """Layer-wise push: regions ``start..end`` of the KV of the prompt's first
        ``num_tokens`` tokens (all of it, or the chunks computed so far) in ``blocks`` are
        final; written now where D registered."""
    def streams_ready(self, streams: LayerStreams, start: int, end: int) -> None:
        """Layer-wise push: :meth:`layers_ready` for every request of ``streams`` at once."""
    def abort(self, request_id: str, transfer_id: str | None = None) -> AbortOutcome:
        """Raises :class:`BusyError` when the writer is far behind: nothing was done."""
    def expect(
        self,
        request_id: str,
        source: str | Sequence[str],
        blocks: _Blocks,
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
