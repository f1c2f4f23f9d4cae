"""kv_transfer_params as a router, a client or a forwarded answer may send them, read by the one
validation every connector hook uses (:func:`kvpush.vllm._params.parse_params`): what kvpush
accepts, and for everything else a refusal that names the field and what is wrong with it.

The values are those Python's JSON parser accepts from a request body (``Infinity``, ``NaN``,
``1e300``, integers of any size, nesting, long strings), plus a few no JSON can carry.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvpush.vllm._params import (
    MAX_HOST_BYTES,
    MAX_ID_BYTES,
    MAX_TP_SIZE,
    Refused,
    RemoteDecode,
    RemotePrefill,
    TransferParams,
    parse_params,
)

GOOD_D = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "prefill-0",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "tp_size": 2,
    "pp_size": 1,
    "remote_request_id": "cmpl-1234-0",
    "transfer_id": "xfer-5b1c",
}


def refusal(params: Any) -> str:
    """The reason D refuses ``params``' remote prefill (failing when it is accepted)."""
    asked = parse_params(params).remote_prefill
    assert isinstance(asked, Refused), f"accepted: {asked}"
    return asked.reason


def test_a_routers_params_are_read_into_typed_fields() -> None:
    assert parse_params(GOOD_D) == TransferParams(
        remote_prefill=RemotePrefill(
            host="10.0.0.7",
            port=5600,
            tp_size=2,
            pp_size=1,
            transfer_id="xfer-5b1c",
            engine_id="prefill-0",
            request_id="cmpl-1234-0",
        ),
        remote_decode=None,
    )
    assert parse_params({"do_remote_decode": True, "transfer_id": "xfer-1"}) == TransferParams(
        None, RemoteDecode("xfer-1")
    )


@pytest.mark.parametrize(
    "params",
    [
        None,
        {},
        {"do_remote_prefill": False, "remote_port": float("inf")},
        {"do_remote_prefill": None, "do_remote_decode": None},
        {"unrelated": {"nested": [1, 2, float("nan")]}, "transfer_mode": "push"},
    ],
)
def test_params_that_ask_nothing_ask_nothing(params: Any) -> None:
    """Fields of a role that is not asked are not read: P's answer holds D's fields, and a
    request without a remote prefill is none of kvpush's business."""
    assert parse_params(params) == TransferParams(None, None)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("remote_port", 5600.0),  # JSON has one number type: 5600.0 is 5600
        ("remote_port", 1),
        ("remote_port", 65_535),
        ("tp_size", None),
        ("tp_size", MAX_TP_SIZE),
        ("pp_size", None),
        ("pp_size", 1.0),
        ("transfer_id", None),
        ("transfer_id", ""),
        ("transfer_id", "x" * MAX_ID_BYTES),
        ("remote_engine_id", None),
        ("remote_request_id", None),
        ("remote_host", "::1"),
        ("remote_host", "prefill-0.pods.cluster.local"),
        ("remote_host", "h" * MAX_HOST_BYTES),
        ("remote_host", "préfill.example"),
    ],
)
def test_good_shapes_are_accepted(field: str, value: Any) -> None:
    params = {**GOOD_D, field: value}
    if field == "remote_port":
        params["tp_size"] = 1
    asked = parse_params(params).remote_prefill
    assert isinstance(asked, RemotePrefill), asked
    if field == "remote_port":
        assert asked.port == int(value)
        assert type(asked.port) is int
    if field == "transfer_id":
        assert asked.transfer_id == (value or None)


#: (field, value, what the refusal says). Numbers are what ``json.loads`` makes of Infinity,
#: NaN, 1e300 and 2**70; the rest are wrong types, nesting and oversized strings.
BAD_D_FIELDS: list[tuple[str, Any, str]] = [
    ("remote_port", float("inf"), "remote_port must be an integer, not inf (float)"),
    ("remote_port", float("-inf"), "remote_port must be an integer"),
    ("remote_port", float("nan"), "remote_port must be an integer, not nan (float)"),
    ("remote_port", 1e300, "remote_port 1e+300 is not a TCP port (1 to 65535)"),
    ("remote_port", 2**70, "remote_port of 71 bits is not a TCP port"),
    ("remote_port", -(2**70), "remote_port of 71 bits is not a TCP port"),
    ("remote_port", 10**5000, "remote_port of 16610 bits"),  # str() would refuse it
    ("remote_port", 0, "remote_port 0 is not a TCP port"),
    ("remote_port", -1, "remote_port -1 is not a TCP port"),
    ("remote_port", 65_536, "remote_port 65536 is not a TCP port"),
    ("remote_port", 5600.5, "remote_port must be an integer, not 5600.5 (float)"),
    ("remote_port", True, "remote_port must be an integer, not True (bool)"),
    ("remote_port", "5600", "remote_port must be an integer, not '5600' (str)"),
    ("remote_port", [5600], "remote_port must be an integer, not [5600] (list)"),
    ("remote_port", {"port": 5600}, "remote_port must be an integer, not {'port': 5600} (dict)"),
    ("tp_size", float("inf"), "tp_size must be an integer, not inf (float)"),
    ("tp_size", float("nan"), "tp_size must be an integer"),
    ("tp_size", 1e300, "tp_size 1e+300 is not a tensor parallel size"),
    ("tp_size", 2**70, "tp_size of 71 bits"),
    ("tp_size", 0, "tp_size 0 is not a tensor parallel size (1 to 1024)"),
    ("tp_size", MAX_TP_SIZE + 1, "tp_size 1025"),
    ("tp_size", False, "tp_size must be an integer, not False (bool)"),
    ("tp_size", "two", "tp_size must be an integer, not 'two' (str)"),
    ("tp_size", [[2]], "tp_size must be an integer"),
    ("pp_size", 2, "pp_size 2: kvpush pairs with single-stage prefill engines only"),
    ("pp_size", float("inf"), "pp_size must be an integer"),
    ("pp_size", "1", "pp_size must be an integer, not '1' (str)"),
    ("remote_host", 12, "remote_host must be a host name or address, not 12 (int)"),
    ("remote_host", ["10.0.0.7"], "remote_host must be a host name or address"),
    ("remote_host", {"host": "h"}, "remote_host must be a host name or address"),
    ("remote_host", "h" * (MAX_HOST_BYTES + 1), "remote_host of 256 characters is longer"),
    ("remote_host", "é" * 128, "remote_host of 128 characters is longer"),  # 256 bytes
    ("remote_host", "10.0.0.7 evil", "holds characters no host name has"),
    ("remote_host", "10.0.0.7\n", "holds characters no host name has"),
    ("remote_host", "h\x00", "holds characters no host name has"),
    ("remote_host", "\ud800", "holds characters no host name has"),  # JSON's lone surrogate
    ("transfer_id", 7, "transfer_id must be a string, not 7 (int)"),
    ("transfer_id", ["xfer"], "transfer_id must be a string"),
    ("transfer_id", {"id": "xfer"}, "transfer_id must be a string"),
    ("transfer_id", True, "transfer_id must be a string"),
    ("transfer_id", "x" * (MAX_ID_BYTES + 1), "transfer_id of 257 characters"),
    ("transfer_id", "xfer\n1", "transfer_id 'xfer\\n1' (str) holds unprintable characters"),
    ("remote_engine_id", 0, "remote_engine_id must be a string, not 0 (int)"),
    ("remote_engine_id", "e" * 10_000, "remote_engine_id of 10000 characters"),
    ("remote_request_id", ["a"] * 100_000, "remote_request_id must be a string"),
    ("do_remote_prefill", "yes", "do_remote_prefill must be true or false, not 'yes' (str)"),
    ("do_remote_prefill", 1, "do_remote_prefill must be true or false, not 1 (int)"),
    ("do_remote_prefill", [True], "do_remote_prefill must be true or false"),
]


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    BAD_D_FIELDS,
    ids=[f"{field}-{i}" for i, (field, _, _) in enumerate(BAD_D_FIELDS)],  # str(10**5000) fails
)
def test_each_bad_field_is_refused_with_its_name_and_what_is_wrong(
    field: str, value: Any, reason: str
) -> None:
    said = refusal({**GOOD_D, "tp_size": 1, field: value})
    assert reason in said
    assert len(said) < 400, "a client's value is cut short in the log line"


def test_the_two_engine_killers_of_the_report_are_refused() -> None:
    """Sent as JSON text: ``json.dumps`` refuses to write Infinity, Python's parser reads it."""
    port = json.loads('{"do_remote_prefill": true, "remote_host": "h", "remote_port": Infinity}')
    tp = json.loads(
        '{"do_remote_prefill": true, "remote_host": "h", "remote_port": 5600, "tp_size": Infinity}'
    )
    assert "remote_port must be an integer, not inf" in refusal(port)
    assert "tp_size must be an integer, not inf" in refusal(tp)


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        ({"do_remote_prefill": True}, "lack remote_host, remote_port"),
        ({"do_remote_prefill": True, "remote_host": "", "remote_port": None}, "lack remote_host"),
        ({"do_remote_prefill": True, "remote_host": "h"}, "lack remote_port"),
        (
            {"do_remote_prefill": True, "remote_host": "h", "remote_port": 65_535, "tp_size": 2},
            "remote_port 65535 with tp_size 2: P's workers listen on remote_port + rank",
        ),
        (["do_remote_prefill"], "kv_transfer_params must be an object, not ['do_remote_prefill']"),
        ("do_remote_prefill", "kv_transfer_params must be an object"),
        (1, "kv_transfer_params must be an object, not 1 (int)"),
    ],
)
def test_params_that_do_not_name_p_are_refused(params: Any, reason: str) -> None:
    assert reason in refusal(params)


def test_ps_fields_are_read_only_when_p_is_asked() -> None:
    assert parse_params({"do_remote_decode": True}) == TransferParams(None, RemoteDecode(None))
    for bad, reason in (
        ({"do_remote_decode": True, "transfer_id": 1e300}, "transfer_id must be a string"),
        ({"do_remote_decode": "true"}, "do_remote_decode must be true or false"),
    ):
        asked = parse_params(bad).remote_decode
        assert isinstance(asked, Refused)
        assert reason in asked.reason


def test_a_mapping_that_cannot_be_read_is_refused_not_raised() -> None:
    class Hostile(dict[str, Any]):
        def get(self, key: str, default: Any = None) -> Any:
            raise RuntimeError("no")

    refused = parse_params(Hostile(do_remote_prefill=True))
    assert refused.remote_prefill == refused.remote_decode
    assert isinstance(refused.remote_prefill, Refused)
    assert "could not be read (RuntimeError)" in refused.remote_prefill.reason
