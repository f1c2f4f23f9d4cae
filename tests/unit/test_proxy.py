"""``kvpush proxy`` and the router core against fake P and D servers (no vLLM): the legs each
side receives, how D's answer reaches the client, what the client gets when a leg fails, that a
failing leg or a client hanging up closes the other legs, the bounds on bodies and connections,
health checks, least-outstanding balancing, P's coordinates learned from its answer, pull mode,
and the in-process client API (:func:`kvpush.router.complete`).

The fakes are small ThreadingHTTPServers that record every request. Concurrency and
streaming are proven with events, not clocks: the fake P answers only once the fake D holds
its leg, and the fake D sends its last chunk only once the client has read the first. A leg
the proxy should abort is held open by its fake until the proxy closes it (or a bounded wait
runs out, and the fake answers after all).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvpush import cli
from kvpush.router import PrefillInstance, RouterThread, Timeouts, complete_once, parse_prefill
from kvpush.router.http import ProxyServer
from tests.support.fake_http import Fake, FakeHandler, Received, Respond, answer

JSON = dict[str, Any]
WAIT_S = 2.0
SSE = [b'data: {"n": 0}\n\n', b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"]


def prefill_at(fake: Fake, n: int = 0, *, tp: int = 1, pp: int = 1) -> PrefillInstance:
    return PrefillInstance(fake.url, f"engine-p{n}", f"10.0.0.{n + 1}", 5600 + n, tp=tp, pp=pp)


@contextlib.contextmanager
def proxy(
    prefill: list[PrefillInstance],
    decode: list[str],
    timeouts: Timeouts | None = None,
    **options: Any,
) -> Iterator[ProxyServer]:
    server = ProxyServer(
        prefill=prefill, decode=decode, host="127.0.0.1", port=0, timeouts=timeouts, **options
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def request(
    server: ProxyServer, method: str, path: str, body: JSON | None = None
) -> tuple[http.client.HTTPResponse, http.client.HTTPConnection]:
    host, port = server.address
    connection = http.client.HTTPConnection(host, port, timeout=5.0)
    data = None if body is None else json.dumps(body).encode()
    connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
    return connection.getresponse(), connection


def call(server: ProxyServer, method: str, path: str, body: JSON | None = None) -> tuple[int, Any]:
    response, connection = request(server, method, path, body)
    try:
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def call_on(
    connection: http.client.HTTPConnection, method: str, path: str, body: JSON | None = None
) -> tuple[int, Any]:
    """One more request on an open (keep-alive) connection."""
    data = None if body is None else json.dumps(body).encode()
    connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, json.loads(response.read())


def read_event(response: http.client.HTTPResponse) -> bytes:
    """One SSE event (up to its blank line), as soon as the proxy relays it."""
    data = b""
    while not data.endswith(b"\n\n"):
        piece = response.read1(1024)
        assert piece, f"stream ended inside an event: {data!r}"
        data += piece
    return data


def streaming_decode(client_saw_first: threading.Event, log: list[str]) -> Respond:
    """D streams SSE and sends everything after the first event only once the client has it."""

    def respond(handler: FakeHandler, _received: Received) -> None:
        handler.start_stream()
        handler.send_chunk(SSE[0])
        log.append("first sent")
        if client_saw_first.wait(WAIT_S):
            log.append("client had the first before the rest was produced")
        for event in SSE[1:]:
            handler.send_chunk(event)
        handler.end_stream()

    return respond


def holds_until_closed(closed: threading.Event, *, stream: bool = False) -> Respond:
    """A leg that stays open, as a P prefilling or a D waiting for P's KV does, and sets
    ``closed`` when the proxy closes it; one never closed answers after ``WAIT_S``."""

    def respond(handler: FakeHandler, _received: Received) -> None:
        if stream:
            handler.start_stream()
        if handler.peer_closed(WAIT_S):
            closed.set()
        elif stream:
            handler.send_chunk(SSE[0])
            handler.end_stream()
        else:
            handler.send_json(200, {"choices": [{"text": "answered after all"}]})

    return respond


def raw_request(server: ProxyServer, data: bytes) -> tuple[http.client.HTTPResponse, socket.socket]:
    """Send ``data`` as it is and read the answer's head, keeping the connection open (so a
    proxy reading the body to EOF would never answer)."""
    sock = socket.create_connection(server.address, timeout=5.0)
    sock.sendall(data)
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response, sock


def post(headers: str, body: bytes = b"") -> bytes:
    """A completion POST with these extra header lines (each ending in CRLF), then ``body``."""
    head = "POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
    return (head + headers + "\r\n").encode() + body


def closed_by_proxy(sock: socket.socket) -> bool:
    """Whether the proxy closes ``sock`` after its answer, rather than waiting for more."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def eventually(check: Callable[[], bool]) -> bool:
    """``check()``, retried for up to ``WAIT_S`` (for what the proxy does once a client closes)."""
    deadline = time.monotonic() + WAIT_S
    while not check():
        if time.monotonic() > deadline:
            return False
        threading.Event().wait(0.02)
    return True


# --- the legs ----------------------------------------------------------------------------------


def test_both_legs_arrive_together_with_one_request_and_transfer_id(
    fakes: Callable[[Respond], Fake],
) -> None:
    legs: dict[str, Fake] = {}

    def after(other: str, status: int, payload: JSON) -> Respond:
        # Each side answers only once the other side holds its leg: both were in flight at once.
        def respond(handler: FakeHandler, _received: Received) -> None:
            if legs[other].arrived.wait(WAIT_S):
                handler.send_json(status, payload)
            else:
                handler.send_json(500, {"error": {"message": f"{other} leg never arrived"}})

        return respond

    decoded = {"id": "cmpl-d", "choices": [{"text": " world", "index": 0}]}
    legs["P"] = fakes(after("D", 200, {"id": "cmpl-p", "choices": [{"text": "!"}]}))
    legs["D"] = fakes(after("P", 200, decoded))
    p = prefill_at(legs["P"], tp=2, pp=3)
    client_body = {"model": "m", "prompt": "hello", "max_tokens": 16, "temperature": 0.0}
    with proxy([p], [legs["D"].url]) as server:
        response, connection = request(server, "POST", "/v1/completions", client_body)
        status, payload = response.status, json.loads(response.read())
        client_request_id = response.getheader("X-Request-Id")
        connection.close()

    assert (status, payload) == (200, decoded)
    p_leg, d_leg = legs["P"].only(), legs["D"].only()
    request_id, transfer_id = p_leg.request_id, p_leg.params["transfer_id"]
    assert uuid.UUID(request_id).version == 4
    assert uuid.UUID(transfer_id).version == 4
    assert d_leg.request_id == request_id == client_request_id
    assert p_leg.path == d_leg.path == "/v1/completions"
    assert p_leg.body == {
        **client_body,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": transfer_id,
        },
    }
    assert d_leg.body == {
        **client_body,
        "kv_transfer_params": {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_engine_id": "engine-p0",
            "remote_host": "10.0.0.1",
            "remote_port": 5600,
            "tp_size": 2,
            "pp_size": 3,
            "remote_request_id": request_id,
            "transfer_id": transfer_id,
        },
    }


def test_streaming_relays_each_event_as_decode_produces_it(
    fakes: Callable[[Respond], Fake],
) -> None:
    client_saw_first = threading.Event()
    log: list[str] = []
    p = fakes(answer(200, {"choices": [{"text": "!"}]}))
    d = fakes(streaming_decode(client_saw_first, log))
    body = {"model": "m", "prompt": "hello", "max_tokens": 8, "stream": True}
    with proxy([prefill_at(p)], [d.url]) as server:
        response, connection = request(server, "POST", "/v1/completions", body)
        assert response.status == 200
        assert response.getheader("Content-Type") == "text/event-stream"
        assert response.getheader("Transfer-Encoding") == "chunked"
        first = read_event(response)
        client_saw_first.set()
        rest = response.read()
        connection.close()

    assert first == SSE[0]
    assert first + rest == b"".join(SSE)
    assert log == ["first sent", "client had the first before the rest was produced"]
    assert p.only().body["stream"] is False
    assert d.only().body["stream"] is True


def test_chat_completions_stream_with_one_token_on_the_prefill_leg(
    fakes: Callable[[Respond], Fake],
) -> None:
    client_saw_first = threading.Event()
    log: list[str] = []
    p = fakes(answer(200, {"choices": [{"message": {"content": "!"}}]}))
    d = fakes(streaming_decode(client_saw_first, log))
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 32,
        "min_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with proxy([prefill_at(p)], [d.url]) as server:
        response, connection = request(server, "POST", "/v1/chat/completions", body)
        assert response.status == 200
        first = read_event(response)
        client_saw_first.set()
        rest = response.read()
        connection.close()

    assert first + rest == b"".join(SSE)
    assert log[-1] == "client had the first before the rest was produced"
    p_leg, d_leg = p.only(), d.only()
    assert p_leg.path == d_leg.path == "/v1/chat/completions"
    # stream_options and min_tokens would make vLLM refuse a one-token, non-streamed request.
    assert p_leg.body == {
        "model": "m",
        "messages": body["messages"],
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": d_leg.params["transfer_id"],
        },
    }
    assert {k: v for k, v in d_leg.body.items() if k != "kv_transfer_params"} == body
    assert d_leg.params["remote_request_id"] == p_leg.request_id == d_leg.request_id


def test_idle_instances_are_taken_in_turn_with_each_prefills_coordinates(
    fakes: Callable[[Respond], Fake],
) -> None:
    ps = [fakes(answer(200, {"choices": []})) for _ in range(2)]
    ds = [fakes(answer(200, {"choices": [{"text": f"d{i}"}]})) for i in range(2)]
    instances = [prefill_at(p, n, tp=n + 1, pp=2 - n) for n, p in enumerate(ps)]
    request_ids = []
    with proxy(instances, [d.url for d in ds]) as server:
        for i in range(4):
            response, connection = request(
                server, "POST", "/v1/completions", {"prompt": f"p{i}", "max_tokens": 4}
            )
            assert json.loads(response.read()) == {"choices": [{"text": f"d{i % 2}"}]}
            request_ids.append(response.getheader("X-Request-Id"))
            connection.close()

    for n in range(2):
        assert [r.request_id for r in ps[n].received] == request_ids[n::2]
        assert [r.request_id for r in ds[n].received] == request_ids[n::2]
    p_of = {r.request_id: n for n, p in enumerate(ps) for r in p.received}
    for d in ds:
        for leg in d.received:
            n = p_of[leg.request_id]
            assert leg.params["remote_engine_id"] == instances[n].engine_id
            assert leg.params["remote_host"] == instances[n].side_channel_host
            assert leg.params["remote_port"] == instances[n].side_channel_port
            assert (leg.params["tp_size"], leg.params["pp_size"]) == (n + 1, 2 - n)


def test_health_and_models(fakes: Callable[[Respond], Fake]) -> None:
    models = {"object": "list", "data": [{"id": "tiny", "object": "model"}]}
    p = fakes(answer(200, {}))
    ds = [fakes(answer(200, models)) for _ in range(3)]
    with proxy([prefill_at(p)], [d.url for d in ds]) as server:
        assert call(server, "GET", "/health") == (
            200,
            {
                "status": "ok",
                "mode": "push",
                "prefill_instances": 1,
                "decode_instances": 3,
                "prefill_healthy": 1,
                "decode_healthy": 3,
            },
        )
        assert call(server, "GET", "/v1/models") == (200, models)
        status, payload = call(server, "GET", "/nowhere")
    assert status == 404
    assert payload["error"]["type"] == "kvpush_proxy_error"
    assert [len(d.received) for d in ds] == [1, 0, 0]
    assert p.received == []


# --- failures ----------------------------------------------------------------------------------


def test_prefill_failure_is_a_502_naming_the_prefill_leg_and_closes_decode(
    fakes: Callable[[Respond], Fake],
) -> None:
    decode_closed = threading.Event()
    decode_has_its_leg = threading.Event()

    def waits_for_prefill(handler: FakeHandler, _received: Received) -> None:
        decode_has_its_leg.set()
        # A real D would fail by itself once P fails it over the side channel; this one only
        # notices that the proxy gave up on it.
        if handler.peer_closed(WAIT_S):
            decode_closed.set()
        else:
            handler.send_json(200, {"choices": [{"text": "D answered after all"}]})

    def fails_once_decode_has_its_leg(handler: FakeHandler, received: Received) -> None:
        # Fail only once D holds its leg, so the test sees both legs of one request (otherwise
        # the proxy may close D before D's server even reads the request).
        decode_has_its_leg.wait(WAIT_S)
        answer(500, {"error": {"message": "prefill exploded"}})(handler, received)

    p = fakes(fails_once_decode_has_its_leg)
    d = fakes(waits_for_prefill)
    with proxy([prefill_at(p)], [d.url], Timeouts(decode_s=WAIT_S + 1)) as server:
        status, payload = call(server, "POST", "/v1/completions", {"prompt": "x"})

    assert status == 502
    error = payload["error"]
    assert (error["type"], error["leg"]) == ("kvpush_proxy_error", "prefill")
    assert "prefill leg failed: HTTP 500" in error["message"]
    assert "prefill exploded" in error["message"]
    assert p.url in error["message"]
    assert error["request_id"] == p.only().request_id == d.only().request_id
    assert decode_closed.wait(WAIT_S), "the proxy left D's leg open after P failed"


def test_unreachable_prefill_is_a_502_naming_the_prefill_leg(
    fakes: Callable[[Respond], Fake],
) -> None:
    def never_answers(handler: FakeHandler, _received: Received) -> None:
        handler.peer_closed(WAIT_S)

    d = fakes(never_answers)
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        p_url = f"http://127.0.0.1:{unused.getsockname()[1]}"
        p = PrefillInstance(p_url, "engine-p", "127.0.0.1", 5600)
        with proxy([p], [d.url], Timeouts(decode_s=WAIT_S)) as server:
            status, payload = call(server, "POST", "/v1/completions", {"prompt": "x"})

    assert status == 502
    assert payload["error"]["leg"] == "prefill"
    assert f"from {p_url}" in payload["error"]["message"]
    assert "ConnectionRefusedError" in payload["error"]["message"]


def test_unreachable_decode_is_a_502_naming_decode(fakes: Callable[[Respond], Fake]) -> None:
    prefill_closed = threading.Event()
    p = fakes(holds_until_closed(prefill_closed))
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        d_url = f"http://127.0.0.1:{unused.getsockname()[1]}"
        with proxy([prefill_at(p)], [d_url]) as server:
            response, connection = request(server, "POST", "/v1/completions", {"prompt": "x"})
            status, payload = response.status, json.loads(response.read())
            # The proxy reads this connection's next request only once P's leg has ended.
            assert call_on(connection, "GET", "/health")[0] == 200
            connection.close()

    assert status == 502
    error = payload["error"]
    assert (error["type"], error["leg"]) == ("kvpush_proxy_error", "decode")
    assert "decode leg failed: cannot connect: ConnectionRefusedError" in error["message"]
    assert d_url in error["message"]
    # P's leg was aborted: never sent, or closed before P answered.
    assert p.received == [] or prefill_closed.wait(WAIT_S), "P's leg outlived D's failure"


def test_decode_error_is_passed_back_as_decode_sent_it(fakes: Callable[[Respond], Fake]) -> None:
    refusal = {"error": {"message": "prompt too long", "type": "BadRequestError", "code": 400}}
    p = fakes(answer(200, {"choices": []}))
    d = fakes(answer(400, refusal))
    with proxy([prefill_at(p)], [d.url]) as server:
        assert call(server, "POST", "/v1/completions", {"prompt": "x"}) == (400, refusal)


def test_client_hanging_up_mid_stream_closes_the_decode_connection(
    fakes: Callable[[Respond], Fake],
) -> None:
    decode_saw = threading.Event()
    sent: list[int] = []

    def endless(handler: FakeHandler, _received: Received) -> None:
        handler.start_stream()
        try:
            for n in range(1000):
                handler.send_chunk(b'data: {"n": %d}\n\n' % n)
                sent.append(n)
                decode_saw.wait(0.005)
        except OSError:  # BrokenPipeError / ConnectionResetError: the proxy hung up on D
            decode_saw.set()

    p = fakes(answer(200, {"choices": []}))
    d = fakes(endless)
    with proxy([prefill_at(p)], [d.url]) as server:
        response, connection = request(
            server, "POST", "/v1/completions", {"prompt": "x", "stream": True}
        )
        assert read_event(response).startswith(b"data: ")
        connection.close()
        assert decode_saw.wait(WAIT_S), "D kept streaming to a client that hung up"
    assert len(sent) < 1000


def test_a_malformed_body_is_a_400_and_sends_no_leg(fakes: Callable[[Respond], Fake]) -> None:
    p, d = fakes(answer(200, {})), fakes(answer(200, {}))
    with proxy([prefill_at(p)], [d.url]) as server:
        host, port = server.address
        connection = http.client.HTTPConnection(host, port, timeout=5.0)
        connection.request("POST", "/v1/completions", body=b"{not json")
        response = connection.getresponse()
        status, payload = response.status, json.loads(response.read())
        connection.close()
    assert status == 400
    assert "not JSON" in payload["error"]["message"]
    assert p.received == d.received == []


# --- a leg that fails, or a client that hangs up, closes the other legs -------------------------


def _decode_refuses(handler: FakeHandler, received: Received) -> None:
    answer(500, {"error": {"message": "decode exploded", "type": "InternalServerError"}})(
        handler, received
    )


def _decode_hangs_up(handler: FakeHandler, _received: Received) -> None:
    handler.close_connection = True  # no answer at all: the proxy sees D go away


@pytest.mark.parametrize(
    ("decode_fails", "client_status", "in_message"),
    [
        (_decode_refuses, 500, "decode exploded"),
        (_decode_hangs_up, 502, "decode leg failed: ServerDisconnectedError"),
    ],
    ids=["error-status", "hangs-up"],
)
def test_decode_failure_aborts_the_prefill_leg(
    fakes: Callable[[Respond], Fake], decode_fails: Respond, client_status: int, in_message: str
) -> None:
    prefill_closed = threading.Event()
    p = fakes(holds_until_closed(prefill_closed))

    def fails_once_prefill_has_its_leg(handler: FakeHandler, received: Received) -> None:
        p.arrived.wait(WAIT_S)
        decode_fails(handler, received)

    d = fakes(fails_once_prefill_has_its_leg)
    with proxy([prefill_at(p)], [d.url]) as server:
        status, payload = call(server, "POST", "/v1/completions", {"prompt": "x"})

    assert status == client_status
    assert in_message in payload["error"]["message"]
    assert p.only().request_id == d.only().request_id
    assert prefill_closed.wait(WAIT_S), "P kept its leg (and would hold the KV) after D failed"


def test_prefill_failure_after_decode_sent_its_head_aborts_decode(
    fakes: Callable[[Respond], Fake],
) -> None:
    # A streaming D sends its response head at once, then waits for P's KV: its answer has not
    # begun, so P's failure still decides, and D must not wait for KV that will never come.
    decode_closed = threading.Event()
    d = fakes(holds_until_closed(decode_closed, stream=True))

    def fails_once_decode_sent_its_head(handler: FakeHandler, received: Received) -> None:
        d.arrived.wait(WAIT_S)
        answer(500, {"error": {"message": "prefill exploded"}})(handler, received)

    p = fakes(fails_once_decode_sent_its_head)
    with proxy([prefill_at(p)], [d.url]) as server:
        status, payload = call(server, "POST", "/v1/completions", {"prompt": "x", "stream": True})

    assert status == 502
    assert payload["error"]["leg"] == "prefill"
    assert "prefill exploded" in payload["error"]["message"]
    assert decode_closed.wait(WAIT_S), "the proxy left D's leg open after P failed"


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_client_hanging_up_while_the_legs_run_aborts_both(
    fakes: Callable[[Respond], Fake], stream: bool
) -> None:
    prefill_closed, decode_closed = threading.Event(), threading.Event()
    p = fakes(holds_until_closed(prefill_closed))
    d = fakes(holds_until_closed(decode_closed, stream=stream))
    body = json.dumps({"prompt": "x", "stream": stream}).encode()
    with proxy([prefill_at(p)], [d.url]) as server:
        client = socket.create_connection(server.address, timeout=5.0)
        client.sendall(post(f"Content-Length: {len(body)}\r\n", body))
        assert p.arrived.wait(WAIT_S)
        assert d.arrived.wait(WAIT_S)
        # Nothing has been written to the client yet (D has produced no token): only watching
        # the client socket can tell that it went away.
        client.close()
        assert decode_closed.wait(WAIT_S), "D kept decoding for a client that hung up"
        assert prefill_closed.wait(WAIT_S), "P kept its leg for a client that hung up"


# --- bounds on bodies and connections ----------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "body", "status", "reason"),
    [
        # Framing aiohttp's parser refuses: the proxy answers its reason as a JSON error.
        ("Transfer-Encoding: chunked\r\n", b"-1\r\n{}\r\n", 400, "chunk size"),
        ("Transfer-Encoding: chunked\r\n", b"+2\r\n{}\r\n", 400, "chunk size"),
        ("Transfer-Encoding: chunked\r\n", b"0x2\r\n{}\r\n", 400, "chunk size"),
        ("Transfer-Encoding: chunked\r\n", b"1_0\r\n{}\r\n", 400, "chunk size"),
        ("Transfer-Encoding: chunked\r\n", b"zz\r\n{}\r\n", 400, "chunk size"),
        ("Transfer-Encoding: chunked\r\n", b"\r\n{}\r\n", 400, "chunk size"),
        ("Transfer-Encoding: chunked\r\n", b"2\r\n{}}\r\n0\r\n\r\n", 400, "chunk"),
        ("Transfer-Encoding: gzip\r\n", b"{}", 400, "Transfer-Encoding"),
        ("Content-Length: 2\r\nTransfer-Encoding: chunked\r\n", b"{}", 400, "Content-Length"),
        ("Content-Length: -1\r\n", b"{}", 400, "Content-Length"),
        ("Content-Length: +2\r\n", b"{}", 400, "Content-Length"),
        ("Content-Length: 1_0\r\n", b"{}", 400, "Content-Length"),
        ("Content-Length: 2\r\nContent-Length: 3\r\n", b"{}", 400, "Content-Length"),
        # What the proxy refuses itself.
        ("Transfer-Encoding: gzip, chunked\r\n", b"2\r\n{}\r\n0\r\n\r\n", 501, "only chunked"),
        ("Content-Length: 101\r\n", b"{}", 413, "101 bytes is over the limit of 100 bytes"),
        ("", b"", 411, "no Content-Length and not chunked"),
    ],
)
def test_a_body_the_proxy_cannot_bound_is_refused_without_reading_it(
    fakes: Callable[[Respond], Fake], headers: str, body: bytes, status: int, reason: str
) -> None:
    # The client keeps its connection open: a proxy that read such a body to EOF would never
    # answer.
    p, d = fakes(answer(200, {})), fakes(answer(200, {}))
    with proxy([prefill_at(p)], [d.url], max_body_bytes=100) as server:
        response, sock = raw_request(server, post(headers, body))
        with sock:
            payload = json.loads(response.read())
            assert response.status == status, payload
            assert payload["error"]["type"] == "kvpush_proxy_error"
            assert reason in payload["error"]["message"]
            # What is left of the body must not be read as the next request.
            assert response.will_close
            assert closed_by_proxy(sock)
    assert p.received == d.received == []


@pytest.mark.parametrize(
    "chunks",
    [
        b"".join(b"28\r\n%s\r\n" % (b" " * 40) for _ in range(3)),  # each under, total over
        b"c8\r\n" + b" " * 200,  # one chunk over the limit, its bytes still coming
    ],
    ids=["in-total", "one-chunk"],
)
def test_a_chunked_body_over_the_limit_is_a_413(
    fakes: Callable[[Respond], Fake], chunks: bytes
) -> None:
    p, d = fakes(answer(200, {})), fakes(answer(200, {}))
    with proxy([prefill_at(p)], [d.url], max_body_bytes=100) as server:
        response, sock = raw_request(server, post("Transfer-Encoding: chunked\r\n", chunks))
        with sock:
            payload = json.loads(response.read())
            assert response.status == 413
            assert "over the limit of 100 bytes" in payload["error"]["message"]
            assert closed_by_proxy(sock)
    assert p.received == d.received == []


def test_a_chunked_body_within_the_limit_reaches_both_legs(
    fakes: Callable[[Respond], Fake],
) -> None:
    decoded = {"choices": [{"text": " world"}]}
    p, d = fakes(answer(200, {"choices": []})), fakes(answer(200, decoded))
    body = json.dumps({"prompt": "hello", "max_tokens": 4}).encode()
    chunked = b"%x;name=value\r\n%s\r\n%X\r\n%s\r\n0\r\nX-Trailer: t\r\n\r\n" % (
        5,
        body[:5],
        len(body) - 5,
        body[5:],
    )
    with proxy([prefill_at(p)], [d.url]) as server:
        response, sock = raw_request(server, post("Transfer-Encoding: chunked\r\n", chunked))
        with sock:
            assert (response.status, json.loads(response.read())) == (200, decoded)
    assert p.only().body["prompt"] == d.only().body["prompt"] == "hello"
    assert d.only().body["max_tokens"] == 4


def test_connections_over_the_cap_get_a_prompt_503(
    fakes: Callable[[Respond], Fake],
) -> None:
    p, d = fakes(answer(200, {})), fakes(answer(200, {}))
    with proxy([prefill_at(p)], [d.url], max_connections=2) as server:
        host, port = server.address
        held = [http.client.HTTPConnection(host, port, timeout=5.0) for _ in range(2)]
        for connection in held:
            # Served, and kept open: each now holds a slot while it idles.
            assert call_on(connection, "GET", "/health")[0] == 200
        turned_away = []
        for _ in range(5):
            response, sock = raw_request(server, b"GET /health HTTP/1.1\r\nHost: proxy\r\n\r\n")
            with sock:
                payload = json.loads(response.read())
                turned_away.append((response.status, response.getheader("Retry-After")))
                assert "--max-connections" in payload["error"]["message"]
                assert closed_by_proxy(sock)
        assert turned_away == [(503, "1")] * 5

        # A slot frees once the proxy sees a held connection close: new clients are served.
        held[0].close()

        def served() -> bool:
            response, sock = raw_request(server, b"GET /health HTTP/1.1\r\nHost: proxy\r\n\r\n")
            with sock:
                response.read()
                return response.status == 200

        assert eventually(served), "the cap stayed full after a connection closed"
        held[1].close()


# --- balancing and health ----------------------------------------------------------------------


def completions(fake: Fake) -> list[Received]:
    """The completion legs ``fake`` received (not the router's health checks)."""
    return [r for r in fake.received if r.path != "/health"]


def test_least_outstanding_sends_a_request_to_the_idle_decode(
    fakes: Callable[[Respond], Fake],
) -> None:
    release = threading.Event()
    first_held = threading.Event()

    def holds_the_first(handler: FakeHandler, received: Received) -> None:
        if received.body["prompt"] == "first":
            first_held.set()
            release.wait(WAIT_S * 2)
        handler.send_json(200, {"choices": [{"text": received.body["prompt"]}]})

    p = fakes(answer(200, {"choices": []}))
    ds = [fakes(holds_the_first) for _ in range(2)]
    with proxy([prefill_at(p)], [d.url for d in ds]) as server:
        outcome: list[tuple[int, Any]] = []
        first = threading.Thread(
            target=lambda: outcome.append(
                call(server, "POST", "/v1/completions", {"prompt": "first"})
            )
        )
        first.start()
        try:
            assert first_held.wait(WAIT_S)
            # D0 holds one leg, D1 none: both later requests go to D1 (round-robin alone
            # would send the third back to D0).
            for prompt in ("second", "third"):
                assert call(server, "POST", "/v1/completions", {"prompt": prompt})[0] == 200
        finally:
            release.set()
            first.join(WAIT_S * 2)
    assert outcome == [(200, {"choices": [{"text": "first"}]})]
    assert [r.body["prompt"] for r in ds[0].received] == ["first"]
    assert [r.body["prompt"] for r in ds[1].received] == ["second", "third"]


def test_health_checks_take_a_dead_decode_out_and_put_it_back(
    fakes: Callable[[Respond], Fake],
) -> None:
    alive = threading.Event()  # D1's /health answers 200 only while set

    def decode(n: int) -> Respond:
        def respond(handler: FakeHandler, received: Received) -> None:
            if received.path == "/health":
                handler.send_json(200 if n == 0 or alive.is_set() else 503, {})
            else:
                handler.send_json(200, {"choices": [{"text": f"d{n}"}]})

        return respond

    p = fakes(answer(200, {"choices": []}))
    ds = [fakes(decode(n)) for n in range(2)]

    def healthy_decodes(server: ProxyServer) -> int:
        count: int = call(server, "GET", "/health")[1]["decode_healthy"]
        return count

    with proxy([prefill_at(p)], [d.url for d in ds], health_interval_s=0.05) as server:
        assert eventually(lambda: healthy_decodes(server) == 1), "D1 was never taken out"
        for i in range(4):
            assert call(server, "POST", "/v1/completions", {"prompt": f"out {i}"}) == (
                200,
                {"choices": [{"text": "d0"}]},
            )
        alive.set()
        assert eventually(lambda: healthy_decodes(server) == 2), "D1 was never put back"
        for i in range(4):
            assert call(server, "POST", "/v1/completions", {"prompt": f"back {i}"})[0] == 200
    assert [r.body["prompt"] for r in completions(ds[1])] == ["back 0", "back 2"]
    assert any(r.path == "/health" for r in p.received)


def test_with_no_healthy_prefill_the_proxy_answers_503(fakes: Callable[[Respond], Fake]) -> None:
    def down(handler: FakeHandler, received: Received) -> None:
        handler.send_json(503 if received.path == "/health" else 200, {})

    p, d = fakes(down), fakes(answer(200, {"choices": []}))
    with proxy([prefill_at(p)], [d.url], health_interval_s=0.05) as server:
        assert eventually(lambda: call(server, "GET", "/health")[0] == 503)
        response, connection = request(server, "POST", "/v1/completions", {"prompt": "x"})
        payload = json.loads(response.read())
        connection.close()
    assert response.status == 503
    assert response.getheader("Retry-After") == "1"
    assert payload["error"]["leg"] == "prefill"
    assert "no healthy prefill instance" in payload["error"]["message"]
    assert completions(p) == completions(d) == []


# --- P's coordinates learned from its answer, and pull mode -----------------------------------

IDENTITY = {
    "remote_engine_id": "engine-learned",
    "remote_host": "10.9.8.7",
    "remote_port": 5700,
    "tp_size": 2,
    "pp_size": 1,
    "transfer_mode": "push",
}


def test_coordinates_are_learned_from_a_first_serial_request_then_legs_go_in_parallel(
    fakes: Callable[[Respond], Fake],
) -> None:
    legs: dict[str, Fake] = {}
    log: list[str] = []
    second_sent = threading.Event()

    def prefill(handler: FakeHandler, received: Received) -> None:
        n = len(legs["P"].received)
        if n == 1:
            # The second client's request is out: it must wait for this one's answer.
            second_sent.wait(WAIT_S)
            threading.Event().wait(0.2)
            held = (len(legs["D"].received), len(legs["P"].received))
            log.append(f"P answers the first with D, P holding {held} legs")
        elif legs["D"].arrived.wait(WAIT_S):
            log.append("P answers with D holding its leg")
        params = {**IDENTITY, "do_remote_prefill": True, "do_remote_decode": False}
        handler.send_json(200, {"choices": [{"text": "!"}], "kv_transfer_params": params})

    legs["P"] = fakes(prefill)
    legs["D"] = fakes(answer(200, {"choices": [{"text": "decoded"}]}))
    with proxy([PrefillInstance(legs["P"].url)], [legs["D"].url]) as server:
        results: list[tuple[int, Any]] = []
        first = threading.Thread(
            target=lambda: results.append(
                call(server, "POST", "/v1/completions", {"prompt": "one"})
            )
        )
        first.start()
        assert legs["P"].arrived.wait(WAIT_S)
        second = threading.Thread(
            target=lambda: results.append(
                call(server, "POST", "/v1/completions", {"prompt": "two"})
            )
        )
        second.start()
        second_sent.set()
        first.join(WAIT_S * 2)
        second.join(WAIT_S * 2)
        legs["D"].arrived.clear()
        assert call(server, "POST", "/v1/completions", {"prompt": "three"})[0] == 200

    assert [status for status, _ in results] == [200, 200]
    # The first went serially, and the second client's request waited for it.
    assert log[0] == "P answers the first with D, P holding (0, 1) legs"
    assert [r.body["prompt"] for r in legs["P"].received][:1] == ["one"]
    assert log[-1] == "P answers with D holding its leg"
    for d_leg in legs["D"].received:
        assert d_leg.params["remote_engine_id"] == "engine-learned"
        assert (d_leg.params["remote_host"], d_leg.params["remote_port"]) == ("10.9.8.7", 5700)
        assert (d_leg.params["tp_size"], d_leg.params["pp_size"]) == (2, 1)
        assert d_leg.params["transfer_id"] != ""
    p_by_id = {r.request_id: r for r in legs["P"].received}
    for d_leg in legs["D"].received:
        assert p_by_id[d_leg.request_id].params["transfer_id"] == d_leg.params["transfer_id"]


def test_a_prefill_answer_without_its_identity_fails_the_request_without_asking_decode(
    fakes: Callable[[Respond], Fake],
) -> None:
    p = fakes(answer(200, {"choices": [{"text": "!"}], "kv_transfer_params": {"x": 1}}))
    d = fakes(answer(200, {"choices": []}))
    with proxy([PrefillInstance(p.url)], [d.url]) as server:
        status, payload = call(server, "POST", "/v1/completions", {"prompt": "x"})
    assert status == 502
    assert payload["error"]["leg"] == "prefill"
    message = payload["error"]["message"]
    assert "cannot learn P's coordinates" in message
    assert "lack remote_engine_id, remote_host, remote_port" in message
    assert d.received == []


def test_a_prefill_back_from_a_failed_health_check_has_its_coordinates_learned_again(
    fakes: Callable[[Respond], Fake],
) -> None:
    alive = threading.Event()
    alive.set()
    port = [5700]  # P's side-channel port: a restarted P may come back on another

    def prefill(handler: FakeHandler, received: Received) -> None:
        if received.path == "/health":
            handler.send_json(200 if alive.is_set() else 503, {})
            return
        params = {**IDENTITY, "remote_port": port[0]}
        handler.send_json(200, {"choices": [], "kv_transfer_params": params})

    def healthy_prefills(server: ProxyServer) -> int:
        count: int = call(server, "GET", "/health")[1]["prefill_healthy"]
        return count

    p, d = fakes(prefill), fakes(answer(200, {"choices": [{"text": "d"}]}))
    with proxy([PrefillInstance(p.url)], [d.url], health_interval_s=0.05) as server:
        assert call(server, "POST", "/v1/completions", {"prompt": "before"})[0] == 200
        alive.clear()
        assert eventually(lambda: healthy_prefills(server) == 0)
        port[0] = 5701
        alive.set()
        assert eventually(lambda: healthy_prefills(server) == 1)
        assert call(server, "POST", "/v1/completions", {"prompt": "after"})[0] == 200
    assert [r.params["remote_port"] for r in completions(d)] == [5700, 5701]


def test_pull_mode_sends_decode_the_params_prefill_answered_after_its_answer(
    fakes: Callable[[Respond], Fake],
) -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_engine_id": "e"}
    legs: dict[str, Fake] = {}

    def prefill(handler: FakeHandler, _received: Received) -> None:
        # D must not have its leg yet: pull sends it only with P's answer.
        held = legs["D"].arrived.wait(0.2)
        handler.send_json(200, {"choices": [], "kv_transfer_params": {**params, "d_early": held}})

    legs["P"] = fakes(prefill)
    legs["D"] = fakes(answer(200, {"choices": [{"text": "pulled"}]}))
    body = {"model": "m", "prompt": "x", "max_tokens": 5, "stream_options": {"a": 1}}
    with proxy([PrefillInstance(legs["P"].url)], [legs["D"].url], mode="pull") as server:
        assert call(server, "POST", "/v1/completions", body) == (
            200,
            {"choices": [{"text": "pulled"}]},
        )
    p_leg, d_leg = legs["P"].only(), legs["D"].only()
    assert p_leg.body["max_tokens"] == 1
    assert p_leg.body["stream"] is False
    assert "stream_options" not in p_leg.body
    assert p_leg.params["do_remote_decode"] is True
    assert "transfer_id" not in p_leg.params
    assert d_leg.params == {**params, "d_early": False}
    assert d_leg.body["max_tokens"] == 5
    assert d_leg.request_id == p_leg.request_id


def test_pull_mode_without_params_from_prefill_fails_without_asking_decode(
    fakes: Callable[[Respond], Fake],
) -> None:
    p, d = fakes(answer(200, {"choices": []})), fakes(answer(200, {"choices": []}))
    with proxy([prefill_at(p)], [d.url], mode="pull") as server:
        status, payload = call(server, "POST", "/v1/completions", {"prompt": "x"})
    assert status == 502
    assert payload["error"]["leg"] == "prefill"
    assert "P answered no kv_transfer_params" in payload["error"]["message"]
    assert d.received == []


# --- stopping, and the in-process client ------------------------------------------------------


def test_a_request_in_flight_when_the_proxy_stops_gets_a_503(
    fakes: Callable[[Respond], Fake],
) -> None:
    decode_closed = threading.Event()
    p = fakes(answer(200, {"choices": []}))
    d = fakes(holds_until_closed(decode_closed))
    outcome: list[tuple[int, Any]] = []
    server = ProxyServer([prefill_at(p)], [d.url], port=0)
    server.start()
    try:
        client = threading.Thread(
            target=lambda: outcome.append(call(server, "POST", "/v1/completions", {"prompt": "x"}))
        )
        client.start()
        assert d.arrived.wait(WAIT_S)
    finally:
        server.stop()
    client.join(WAIT_S)
    ((status, payload),) = outcome
    assert status == 503
    assert "the proxy is stopping" in payload["error"]["message"]
    assert decode_closed.wait(WAIT_S), "D's leg outlived the proxy"


def sse(*texts: str) -> Respond:
    def respond(handler: FakeHandler, _received: Received) -> None:
        handler.start_stream()
        for n, text in enumerate(texts):
            event = {"choices": [{"text": text, "index": 0, "token_ids": [n]}]}
            handler.send_chunk(f"data: {json.dumps(event)}\n\n".encode())
        handler.send_chunk(b"data: [DONE]\n\n")
        handler.end_stream()

    return respond


def test_the_client_api_streams_through_the_same_legs_with_per_leg_timings(
    fakes: Callable[[Respond], Fake],
) -> None:
    p = fakes(answer(200, {"choices": [{"text": "!"}], "kv_transfer_params": {"k": 1}}))
    d = fakes(sse("a", "b", "c"))
    with RouterThread([prefill_at(p)], [d.url]) as router:
        streamed = router.complete({"prompt": "x", "max_tokens": 3, "stream": True}, timeout_s=5)
        whole = router.complete({"prompt": "y"}, timeout_s=5)

    assert streamed.ok, streamed.error
    assert (streamed.text, streamed.token_ids, streamed.chunks) == ("abc", [0, 1, 2], 3)
    assert streamed.status == streamed.prefill_status == 200
    assert streamed.prefill_response == {"choices": [{"text": "!"}], "kv_transfer_params": {"k": 1}}
    assert streamed.decode_sent_s is not None
    assert streamed.prefill_s is not None
    assert streamed.first_token_s is not None
    assert streamed.last_token_s is not None
    assert streamed.first_token_s <= streamed.last_token_s
    p_leg, d_leg = p.received[0], d.received[0]
    assert p_leg.request_id == d_leg.request_id == streamed.request_id
    assert d_leg.params["transfer_id"] == p_leg.params["transfer_id"] == streamed.transfer_id
    assert d_leg.params["remote_engine_id"] == "engine-p0"
    # Not streamed: D's whole answer (the fake streams anyway, which is not JSON).
    assert not whole.ok
    assert whole.failed_leg == "decode"


def test_the_client_api_names_the_leg_that_failed(fakes: Callable[[Respond], Fake]) -> None:
    release = threading.Event()

    def hang(handler: FakeHandler, _received: Received) -> None:
        release.wait(WAIT_S * 2)

    decode_closed = threading.Event()
    failing_p = fakes(answer(500, {"error": {"message": "boom"}}))
    good_p = fakes(answer(200, {"choices": []}))
    d = fakes(answer(200, {"choices": [{"text": "whole", "token_ids": [7]}]}))
    # A D waiting for KV that P's failure means will never come.
    waiting_d = fakes(holds_until_closed(decode_closed))
    stuck_d = fakes(hang)
    body = {"prompt": "x"}
    try:
        ok = complete_once(prefill_at(good_p), d.url, body, timeout_s=5)
        p_failed = complete_once(prefill_at(failing_p), waiting_d.url, body, timeout_s=5)
        deadline = complete_once(prefill_at(good_p), stuck_d.url, body, timeout_s=0.5)
    finally:
        release.set()
    assert decode_closed.wait(WAIT_S), "D's leg outlived P's failure"
    assert ok.ok, ok.error
    assert ok.response == {"choices": [{"text": "whole", "token_ids": [7]}]}
    assert (ok.text, ok.token_ids, ok.chunks) == ("whole", [7], 1)
    assert (p_failed.failed_leg, p_failed.ok) == ("prefill", False)
    assert p_failed.error is not None
    assert p_failed.error.startswith("HTTP 500")
    assert "boom" in p_failed.error
    assert deadline.failed_leg == "decode"
    assert deadline.error == "no answer within the request's deadline of 0.5 s"


# --- configuration -----------------------------------------------------------------------------


def test_prefill_spec() -> None:
    assert parse_prefill("http://p:8100,engine_id=P0,side_channel=10.1.2.3:5601,tp=2,pp=4") == (
        PrefillInstance("http://p:8100", "P0", "10.1.2.3", 5601, tp=2, pp=4)
    )
    assert parse_prefill("http://p:8100,engine_id=P0,side_channel=[::1]:5600") == (
        PrefillInstance("http://p:8100", "P0", "::1", 5600)
    )
    assert parse_prefill("http://p:8100") == PrefillInstance("http://p:8100")
    assert parse_prefill("http://p:8100,tp=2").configured() is None
    for spec, reason in [
        ("http://p:8100,side_channel=h:1", "engine_id= is required"),
        ("http://p:8100,engine_id=P0", "side_channel= is required"),
        ("http://p:8100,engine_id=P0,side_channel=h", "HOST:PORT"),
        ("http://p:8100,engine_id=P0,side_channel=h:1,dp=2", "unknown option 'dp=2'"),
        ("http://p:8100,engine_id=P0,side_channel=h:1,tp=0", "tp=0 pp=1 must be >= 1"),
        ("p:8100,engine_id=P0,side_channel=h:1", "http:// or https://"),
    ]:
        with pytest.raises(ValueError, match=reason):
            parse_prefill(spec)


def test_cli_proxy_subcommand_parses_instances() -> None:
    args = cli.build_parser().parse_args(
        [
            "proxy",
            "--port",
            "9000",
            "--prefill",
            "http://p0:8100,engine_id=P0,side_channel=p0:5600",
            "--prefill",
            "http://p1:8100,engine_id=P1,side_channel=p1:5600,tp=2",
            "--decode",
            "http://d0:8200",
            "--decode-timeout",
            "30",
        ]
    )
    assert args.command == "proxy"
    assert args.port == 9000
    assert args.prefill == [
        PrefillInstance("http://p0:8100", "P0", "p0", 5600),
        PrefillInstance("http://p1:8100", "P1", "p1", 5600, tp=2),
    ]
    assert args.decode == ["http://d0:8200"]
    assert args.decode_timeout == 30.0
    assert callable(args.run)


def test_cli_max_connections() -> None:
    base = ["proxy", "--prefill", "http://p:8100,engine_id=P,side_channel=p:5600"]
    base += ["--decode", "http://d:8200"]
    parser = cli.build_parser()
    assert parser.parse_args(base).max_connections == 1024
    assert parser.parse_args([*base, "--max-connections", "64"]).max_connections == 64
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--max-connections", "0"])
    assert parser.parse_args(base).health_interval == 5.0
    assert parser.parse_args([*base, "--health-interval", "0"]).health_interval == 0.0
    assert parser.parse_args([*base, "--mode", "pull"]).mode == "pull"
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--health-interval", "-1"])
    with pytest.raises(ValueError, match="max_connections=0"):
        ProxyServer(
            [PrefillInstance("http://p:1", "P", "p", 5600)],
            ["http://d:1"],
            port=0,
            max_connections=0,
        )
