"""The one error hierarchy of kvpush.

Every error kvpush raises derives from :class:`KvPushError`. The classes are defined by the
native core (so Rust errors map onto them without a translation table in Python) and re-exported
here, which is where user code should import them from::

    KvPushError
    ├── LayoutError               a KV layout is inconsistent, or two layouts cannot be paired
    ├── PlanError                 a transfer cannot be planned from the block lists given
    │   └── InvalidBlocksError    a peer sent out-of-range, duplicate or miscounted block ids
    ├── RendezvousError           the rendezvous table refused an arrival or transition
    │   ├── StaleEpochError       a registration older than the current one
    │   ├── FencedError           the transfer already ended (delivered, failed, cancelled, expired)
    │   ├── DuplicateReadyError   the KV of a request was reported ready twice
    │   ├── NotMatchedError       a write began or finished for an epoch that is not matched
    │   └── TableFullError        too many transfers pending: backpressure
    ├── ProtocolError             a kvpush/1 message was refused
    │   ├── MessageTooLargeError  over the frame size limit
    │   ├── MalformedMessageError not a valid kvpush/1 frame (truncated, bad fields, unknown kind)
    │   └── AuthenticationError   unsigned, forged, replayed or too old (with a secret configured)
    ├── TransportError            the data path (NIXL, loopback) or the side channel failed
    │   └── NixlUnavailableError  NIXL's C API library could not be found or loaded
    ├── ConfigError               a setting is out of range or unsafe (no secret beyond loopback)
    ├── UnhealthyError            the endpoint's writer stopped or stalled: no new work
    └── BusyError                 the endpoint's writer is behind: nothing was done, retry later

Each instance carries a stable ``code`` (snake_case, for metrics and logs) and, where one is
known, the ``key`` (transfer key) or ``request`` it concerns.
"""

from kvpush._native import (
    AuthenticationError,
    BusyError,
    ConfigError,
    DuplicateReadyError,
    FencedError,
    InvalidBlocksError,
    KvPushError,
    LayoutError,
    MalformedMessageError,
    MessageTooLargeError,
    NixlUnavailableError,
    NotMatchedError,
    PlanError,
    ProtocolError,
    RendezvousError,
    StaleEpochError,
    TableFullError,
    TransportError,
    UnhealthyError,
)

__all__ = [
    "AuthenticationError",
    "BusyError",
    "ConfigError",
    "DuplicateReadyError",
    "FencedError",
    "InvalidBlocksError",
    "KvPushError",
    "LayoutError",
    "MalformedMessageError",
    "MessageTooLargeError",
    "NixlUnavailableError",
    "NotMatchedError",
    "PlanError",
    "ProtocolError",
    "RendezvousError",
    "StaleEpochError",
    "TableFullError",
    "TransportError",
    "UnhealthyError",
]
