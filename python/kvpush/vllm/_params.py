"""What a request's ``kv_transfer_params`` ask of kvpush, read once, in plain Python (no vLLM).

The params come from whoever sent the request (a router, a client, a proxy forwarding P's
answer), as JSON that Python's parser accepts: ``Infinity``, ``NaN``, ``1e300``, integers of any
size, nesting, strings of any length. Every hook that reads them goes through
:func:`parse_params`, which either returns the typed fields kvpush uses or says what is wrong
with them (:class:`Refused`), so a bad request is refused alone, with the reason, before
anything of it reaches the engine's arithmetic or the endpoint.

The contract is vLLM's push proxy's: D's remote prefill (``do_remote_prefill``,
``remote_host``, ``remote_port``, ``tp_size``, ``pp_size``, ``remote_engine_id``,
``remote_request_id``, ``transfer_id``) and P's remote decode (``do_remote_decode``,
``transfer_id``). Keys kvpush does not use are ignored, whatever they hold.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass

#: Longest host name or address (DNS's limit on a whole name), in UTF-8 bytes.
MAX_HOST_BYTES = 255
#: Longest engine, request or transfer id, in UTF-8 bytes (a UUID-based id is under 64).
MAX_ID_BYTES = 256
#: Largest tensor parallel size P may claim: beyond any real engine, and small enough that D's
#: list of P ranks (one address each) stays small.
MAX_TP_SIZE = 1024
#: D's fields that must name P.
REQUIRED_D_PARAMS = ("remote_host", "remote_port")

# The records below are read-only by convention, not frozen: a frozen dataclass assigns each
# field through ``object.__setattr__``, which costs 2 µs a request on the scheduler's thread.


@dataclass(slots=True)
class Refused:
    """Why a request's kv_transfer_params cannot be acted on (for the request's log line)."""

    reason: str


@dataclass(slots=True)
class RemotePrefill:
    """D: the KV comes from P, whose worker ``r`` listens on ``host:port + r``."""

    host: str
    port: int
    tp_size: int
    pp_size: int
    transfer_id: str | None
    engine_id: str | None
    request_id: str | None


@dataclass(slots=True)
class RemoteDecode:
    """P: D will register for this request's KV under ``transfer_id`` (None: the request id)."""

    transfer_id: str | None


@dataclass(slots=True)
class TransferParams:
    """A request's kv_transfer_params as kvpush reads them: each role's ask, None when that
    role is not asked, or why it is refused."""

    remote_prefill: RemotePrefill | Refused | None = None
    remote_decode: RemoteDecode | Refused | None = None


class _FieldError(ValueError):
    """One field's complaint, on its way to a :class:`Refused`."""


def parse_params(params: object) -> TransferParams:
    """Reads ``params`` (a request's kv_transfer_params) into what kvpush will do with them.

    Never raises: whatever ``params`` holds, the answer is a :class:`TransferParams`.
    """
    try:
        return _parse(params)
    except Exception as error:  # a Mapping of a client's making: never seen
        refused = Refused(f"kv_transfer_params could not be read ({type(error).__name__})")
        return TransferParams(refused, refused)


def _parse(params: object) -> TransferParams:
    if params is None:
        return TransferParams()
    if not isinstance(params, Mapping):
        refused = Refused(f"kv_transfer_params must be an object, not {_shown(params)}")
        return TransferParams(refused, refused)
    try:
        prefill_asked = _flag(params, "do_remote_prefill")
    except _FieldError as bad:
        prefill: RemotePrefill | Refused | None = Refused(str(bad))
    else:
        prefill = _remote_prefill(params) if prefill_asked else None
    try:
        decode_asked = _flag(params, "do_remote_decode")
    except _FieldError as bad:
        decode: RemoteDecode | Refused | None = Refused(str(bad))
    else:
        decode = _remote_decode(params) if decode_asked else None
    return TransferParams(prefill, decode)


def _remote_prefill(params: Mapping[object, object]) -> RemotePrefill | Refused:
    missing = [key for key in REQUIRED_D_PARAMS if params.get(key) in (None, "")]
    if missing:
        return Refused(
            f"kv_transfer_params lack {', '.join(missing)}: the router must send P's side "
            "channel host and port with do_remote_prefill (the fields of P's own answer)"
        )
    try:
        host = _host(params["remote_host"])
        port = _integer(params, "remote_port", 1, 65_535, "is not a TCP port")
        tp_size = _integer(params, "tp_size", 1, MAX_TP_SIZE, "is not a tensor parallel size")
        pp_size = _integer(params, "pp_size", 1, MAX_TP_SIZE, "is not a pipeline size")
        transfer_id = _id(params, "transfer_id")
        engine_id = _id(params, "remote_engine_id")
        request_id = _id(params, "remote_request_id")
    except _FieldError as bad:
        return Refused(str(bad))
    if pp_size != 1:
        # A kvpush P refuses pipeline stages at startup, so this P is not kvpush's or the
        # router mixed up its fields: D would wait for stages that never write.
        return Refused(f"pp_size {pp_size}: kvpush pairs with single-stage prefill engines only")
    if port + tp_size - 1 > 65_535:
        return Refused(
            f"remote_port {port} with tp_size {tp_size}: P's workers listen on remote_port + "
            "rank, past the last TCP port"
        )
    return RemotePrefill(host, port, tp_size, pp_size, transfer_id, engine_id, request_id)


def _remote_decode(params: Mapping[object, object]) -> RemoteDecode | Refused:
    try:
        return RemoteDecode(_id(params, "transfer_id"))
    except _FieldError as bad:
        return Refused(str(bad))


def _flag(params: Mapping[object, object], key: str) -> bool:
    value = params.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _FieldError(f"{key} must be true or false, not {_shown(value)}")
    return value


def _integer(params: Mapping[object, object], key: str, low: int, high: int, what: str) -> int:
    """``params[key]`` as an int in ``[low, high]`` (absent or null: ``low``).

    Only numbers: a bool is not one here, a float only when finite and integral (JSON has one
    number type), a string never (a router that sends one has mixed up its fields).
    """
    value = params.get(key)
    if value is None:
        return low
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _FieldError(f"{key} must be an integer, not {_shown(value)}")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise _FieldError(f"{key} must be an integer, not {_shown(value)}")
        if not low <= value <= high:
            raise _FieldError(f"{key} {value:g} {what} ({low} to {high})")
        value = int(value)
    if not low <= value <= high:
        shown = str(value) if value.bit_length() <= 64 else f"of {value.bit_length()} bits"
        raise _FieldError(f"{key} {shown} {what} ({low} to {high})")
    return value


def _host(value: object) -> str:
    if not isinstance(value, str):
        raise _FieldError(f"remote_host must be a host name or address, not {_shown(value)}")
    if _utf8_len(value) > MAX_HOST_BYTES:
        raise _FieldError(f"remote_host of {len(value)} characters is longer than a host name")
    # Of the white space, only the plain space is printable.
    if not value.isprintable() or " " in value:
        raise _FieldError(f"remote_host {_shown(value)} holds characters no host name has")
    return value


def _id(params: Mapping[object, object], key: str) -> str | None:
    """An optional id: absent, null or empty is None; else a string of printable characters of
    at most :data:`MAX_ID_BYTES`."""
    value = params.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise _FieldError(f"{key} must be a string, not {_shown(value)}")
    if _utf8_len(value) > MAX_ID_BYTES:
        raise _FieldError(f"{key} of {len(value)} characters is longer than {MAX_ID_BYTES} bytes")
    if not value.isprintable():
        raise _FieldError(f"{key} {_shown(value)} holds unprintable characters")
    return value


def _utf8_len(value: str) -> int:
    """``value``'s length in UTF-8 bytes (a lone surrogate, which JSON allows, counts 3)."""
    return len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))


#: Values in log lines: short, whatever a client sent (a million ids, nesting, huge ints).
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 2, 40, 40
_REPR.maxlist = _REPR.maxdict = _REPR.maxtuple = 4


def _shown(value: object) -> str:
    """``value`` for a log line: its text cut short, and its type."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        text = f"an integer of {value.bit_length()} bits"  # repr() refuses > 4300 digits
    else:
        try:
            text = _REPR.repr(value)
        except Exception:  # a client's value never stops the log line
            text = "?"
    return f"{text} ({type(value).__name__})"
