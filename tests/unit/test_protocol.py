"""The kvpush/1 codec through the binding, and against an independent Python reading of the
wire format in docs/protocol.md (msgpack + the documented MAC input)."""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Any

import msgpack
import pytest

import kvpush
from kvpush._native import lab
from kvpush.exceptions import (
    AuthenticationError,
    MalformedMessageError,
    MessageTooLargeError,
    ProtocolError,
)

REGISTER: dict[str, Any] = {
    "kind": "register",
    "transfer_key": "xfer-1",
    "request_id": "cmpl-xfer-1-0-1a2b3c4d",
    "epoch": 3,
    "engine_id": "decode-0",
    "address": "127.0.0.1:5601",
    "tp_rank": 0,
    "tp_size": 1,
    "groups": [{"first_token": 32, "block_ids": [4, 9, 2]}],
    "num_tokens": 80,
    "ttl_ms": 30_000,
}


def mac_input(env: dict[str, Any]) -> bytes:
    kind: bytes = env["kind"].encode()
    sender: bytes = env["sender"].encode()
    body = bytes(env["body"])
    return (
        b"kvpush/1 envelope mac\x00"
        + struct.pack(">H", env["version"])
        + struct.pack(">I", len(kind))
        + kind
        + struct.pack(">I", len(sender))
        + sender
        + struct.pack(">QQQ", env["session"], env["seq"], env["ts_ms"])
        + struct.pack(">I", len(body))
        + body
    )


def test_messages_round_trip(secret: bytes) -> None:
    encoder, decoder = lab.Encoder("decode-0", secret), lab.Decoder(secret)
    envelope = decoder.decode(encoder.encode(REGISTER))
    # A register without a fan-out (an older peer's) is for one D rank; without a nonce, none.
    assert envelope["message"] == {**REGISTER, "fanout": 1, "nonce": 0}
    assert envelope["sender"] == "decode-0"
    assert envelope["seq"] == 1
    assert envelope["session"] == encoder.session


def test_frame_is_plain_msgpack_with_the_documented_mac(secret: bytes) -> None:
    frame = lab.Encoder("decode-0", secret).encode(REGISTER, now_ms=1_700_000_000_000)
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    assert lab.frame_length(frame[:4]) == len(frame)
    env = msgpack.unpackb(frame[4:], raw=False)
    assert env["version"] == kvpush.PROTOCOL_VERSION
    assert env["kind"] == "register"
    assert env["ts_ms"] == 1_700_000_000_000
    body = msgpack.unpackb(env["body"], raw=False)
    assert body["groups"] == [{"first_token": 32, "block_ids": [4, 9, 2]}]
    expected = hmac.new(secret, mac_input(env), hashlib.sha256).digest()
    assert hmac.compare_digest(env["mac"], expected)


def test_a_python_peer_following_the_docs_is_accepted(secret: bytes) -> None:
    body = msgpack.packb({"transfer_key": "k", "request_id": "r", "epoch": 1})
    env: dict[str, Any] = {
        "version": 1,
        "kind": "cancel",
        "sender": "py-peer",
        "session": 42,
        "seq": 1,
        "ts_ms": 1_700_000_000_000,
        "body": body,
    }
    env["mac"] = hmac.new(secret, mac_input(env), hashlib.sha256).digest()
    packed = msgpack.packb(env)
    message = lab.Decoder(secret).decode(
        struct.pack(">I", len(packed)) + packed, now_ms=1_700_000_000_500
    )["message"]
    assert message == {"kind": "cancel", "transfer_key": "k", "request_id": "r", "epoch": 1}


def test_forged_replayed_and_unsigned_frames_are_refused(secret: bytes) -> None:
    frame = lab.Encoder("decode-0", secret).encode(REGISTER)
    decoder = lab.Decoder(secret)
    forged = bytearray(frame)
    forged[len(forged) // 2] ^= 0x40
    with pytest.raises(ProtocolError) as caught:
        decoder.decode(bytes(forged))
    assert caught.value.code in {"bad_signature", "malformed"}
    decoder.decode(frame)
    with pytest.raises(AuthenticationError, match="replay") as replay:
        decoder.decode(frame)
    assert replay.value.code == "replayed"
    unsigned = lab.Encoder("decode-0").encode(REGISTER)
    with pytest.raises(AuthenticationError) as unauth:
        decoder.decode(unsigned)
    assert unauth.value.code == "unauthenticated"
    with pytest.raises(AuthenticationError) as wrong:
        lab.Decoder(b"another-secret-of-32-bytes-long!!").decode(frame)
    assert wrong.value.code == "bad_signature"


def test_old_frames_are_refused_by_the_clock_check(secret: bytes) -> None:
    frame = lab.Encoder("decode-0", secret).encode(REGISTER, now_ms=1_000_000)
    with pytest.raises(AuthenticationError) as caught:
        lab.Decoder(secret, max_clock_skew=30.0).decode(frame, now_ms=1_000_000 + 31_000)
    assert caught.value.code == "clock_skew"


def test_oversized_and_garbage_input_are_refused_cleanly() -> None:
    decoder = lab.Decoder(max_frame_bytes=1024)
    with pytest.raises(MessageTooLargeError):
        decoder.decode(struct.pack(">I", 1 << 30) + b"x")
    with pytest.raises(MessageTooLargeError):
        lab.frame_length(struct.pack(">I", 2048), max_frame_bytes=1024)
    assert lab.frame_length(b"\x00\x00") is None
    for garbage in [
        b"",
        b"\x00\x00\x00\x05hello",
        b"\x00\x00\x00\x01\xc1",
        b"\x00\x00\x00\x10" + bytes(range(16)),
    ]:
        with pytest.raises(MalformedMessageError):
            decoder.decode(garbage)


def test_unknown_kind_and_bad_fields_are_refused() -> None:
    with pytest.raises(ValueError, match="kind"):
        lab.Encoder("x").encode({"transfer_key": "k"})
    with pytest.raises(ValueError, match="kvpush/1 message"):
        lab.Encoder("x").encode({"kind": "register", "epoch": "not a number"})
    with pytest.raises(ProtocolError) as caught:
        lab.Decoder().decode(lab.Encoder("x").encode({**REGISTER, "transfer_key": "k" * 5000}))
    assert caught.value.code == "invalid"


def test_weak_secret_is_refused() -> None:
    with pytest.raises(ProtocolError) as caught:
        lab.Encoder("x", b"short")
    assert caught.value.code == "weak_secret"
