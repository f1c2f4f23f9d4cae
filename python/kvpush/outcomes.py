"""Why a transfer ended without its KV: :class:`Reason`, the stable codes behind
``TransferEvent.code`` (the native core's ``Reason``; ``TransferEvent.reason`` is the detail for
people and may be reworded at will). Metric labels and programs branch on the code."""

from __future__ import annotations

import enum

from kvpush._native import REASON_CODES


class Reason(str, enum.Enum):
    """One member per code of the native core; a test keeps the two lists equal."""

    ABORTED = "aborted"
    """P's request was aborted or finished without KV (D: P said so)."""
    CANCELLED = "cancelled"
    """D cancelled (aborted or preempted the request)."""
    EXPIRED = "expired"
    """A deadline passed first: P's lease with no registration, D's wait for the KV."""
    REFUSED = "refused"
    """P refused the registration: invalid or stale blocks, another peer's transfer, a quota."""
    LEASE_LAPSED = "lease_lapsed"
    """P's lease on D had lapsed (no fresh proof that D is alive): P did not write."""
    INCOMPATIBLE = "incompatible"
    """P and D cannot exchange KV (compatibility, layout, memory)."""
    WRITE_ERROR = "write_error"
    """The WRITE failed or timed out (and was released)."""
    PEER_LOST = "peer_lost"
    """The peer was lost (D: reported once P's write horizon passed)."""
    UNREACHABLE = "unreachable"
    """D could not reach P: nothing was registered."""
    QUARANTINED = "quarantined"
    """The WRITE could not be released: the blocks stay held for good."""
    CLOSED = "closed"
    """The endpoint, or its peer, shut down."""
    WRITER_DIED = "writer_died"
    """The writer thread died: the endpoint is unhealthy."""


assert {r.value for r in Reason} == set(REASON_CODES), "kvpush.outcomes.Reason is out of date"

__all__ = ["Reason"]
