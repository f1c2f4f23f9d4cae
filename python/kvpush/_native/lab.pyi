"""Type stubs of ``kvpush._native.lab``: bindings for kvpush's lab and tests only (the
rendezvous table, the planner, the kvpush/1 codec), never used by the product."""

import builtins
from collections.abc import Sequence
from typing import Any, Literal, final

from typing_extensions import Buffer

from kvpush._native import KvLayout

__all__ = [
    "Arrival",
    "Cancellation",
    "Decoder",
    "Encoder",
    "Expired",
    "Finished",
    "Plan",
    "Planner",
    "RendezvousTable",
    "frame_length",
]

#: Block ids: a sequence of ints or a buffer of integers, per KV group or flat for one group.
_BlockIds = Sequence[int] | Buffer
_Blocks = Sequence[_BlockIds] | _BlockIds

# --- planning -------------------------------------------------------------------------------

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
        src_blocks: _Blocks,
        dst_blocks: _Blocks,
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
