"""kvpush: push-based KV-cache transfer for disaggregated prefill/decode serving.

The public API, typed, from the native core (``kvpush._native``, private):

* :class:`Endpoint`, :class:`EndpointOptions`: a worker's push endpoint (side channel,
  rendezvous table and native writer thread over NIXL or the in-process loopback) and how it
  runs;
* :class:`TransferEvent`, :class:`Timeline`: how one request's transfer ended, and when each of
  its steps happened;
* :class:`Role`, :class:`Outcome`, :class:`Reason`, :class:`AbortOutcome`: the codes an event
  and ``Endpoint.abort`` carry (each member equals its stable code, ``"done"`` and so on);
* :class:`KvLayout`, :class:`Region`: where a worker's KV cache lives;
* :func:`transfer_key`, :func:`canonical_request_id`: how P and D name one request;
* :mod:`kvpush.exceptions`: the error hierarchy; :mod:`kvpush.nixl`: finding NIXL's library.

The rendezvous table, the planner and the protocol's codec are bound for kvpush's lab and tests
only, in ``kvpush._native.lab``. Importing kvpush never imports vLLM.
"""

import sys
from typing import TYPE_CHECKING, Any

from kvpush import exceptions, nixl
from kvpush._native import (
    PROTOCOL_VERSION,
    AbortOutcome,
    EndpointOptions,
    KvLayout,
    Outcome,
    Reason,
    Region,
    Role,
    Timeline,
    TransferEvent,
    __version__,
    canonical_request_id,
    lab,
    transfer_key,
)
from kvpush.endpoint import Endpoint

# ``import kvpush._native.lab`` finds the native submodule.
sys.modules.setdefault("kvpush._native.lab", lab)

__all__ = [
    "PROTOCOL_VERSION",
    "AbortOutcome",
    "Endpoint",
    "EndpointOptions",
    "KvLayout",
    "Outcome",
    "Reason",
    "Region",
    "Role",
    "Timeline",
    "TransferEvent",
    "__version__",
    "canonical_request_id",
    "exceptions",
    "nixl",
    "transfer_key",
]

if not TYPE_CHECKING:  # typed code imports them from kvpush._native.lab

    def __getattr__(name: str) -> Any:
        """The lab's bindings (``kvpush._native.lab``) were exported here before they moved:
        still reachable as attributes, for code written then, but never in ``__all__``."""
        if not name.startswith("__"):
            try:
                return getattr(lab, name)
            except AttributeError:
                pass
        raise AttributeError(f"module 'kvpush' has no attribute {name!r}")
