"""kvpush: push-based KV-cache transfer for disaggregated prefill/decode serving.

The public API is re-exported here from the native core (``kvpush._native``, private):

* :class:`RendezvousTable`: where D's registration meets P's finished KV;
* :class:`KvLayout`, :class:`Region`, :class:`Planner`, :class:`Plan`: block ids to byte runs;
* :class:`Encoder`, :class:`Decoder`: the kvpush/1 control messages (``docs/protocol.md``);
* :class:`Endpoint`, :class:`TransferEvent`: a worker's push endpoint (side channel, table and
  native writer thread over NIXL or the in-process loopback);
* :func:`transfer_key`, :func:`canonical_request_id`: how P and D name one request;
* :class:`Reason` (:mod:`kvpush.outcomes`): why a transfer ended without its KV, as a code;
* :mod:`kvpush.exceptions`: the error hierarchy.

Importing kvpush never imports vLLM.
"""

from kvpush import exceptions, nixl
from kvpush._native import (
    PROTOCOL_VERSION,
    Arrival,
    Cancellation,
    Decoder,
    Encoder,
    Endpoint,
    Expired,
    Finished,
    KvLayout,
    Plan,
    Planner,
    Region,
    RendezvousTable,
    TransferEvent,
    __version__,
    canonical_request_id,
    frame_length,
    transfer_key,
)
from kvpush.outcomes import Reason

__all__ = [
    "PROTOCOL_VERSION",
    "Arrival",
    "Cancellation",
    "Decoder",
    "Encoder",
    "Endpoint",
    "Expired",
    "Finished",
    "KvLayout",
    "Plan",
    "Planner",
    "Reason",
    "Region",
    "RendezvousTable",
    "TransferEvent",
    "__version__",
    "canonical_request_id",
    "exceptions",
    "frame_length",
    "nixl",
    "transfer_key",
]
