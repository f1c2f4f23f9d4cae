"""Fake P and D servers for the router's tests: each records what arrives and answers with a
``Respond`` function (JSON, a stream, a hold). The ``fakes`` fixture (``tests/conftest.py``)
(here; conftests import it) makes them and stops them after the test."""

from __future__ import annotations

import json
import select
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

JSON = dict[str, Any]


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: JSON

    @property
    def request_id(self) -> str:
        return self.headers["X-Request-Id"]

    @property
    def params(self) -> JSON:
        params: JSON = self.body["kv_transfer_params"]
        return params


class FakeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _FakeHTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def _handle(self) -> None:
        data = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        received = Received(self.path, dict(self.headers.items()), json.loads(data or b"{}"))
        self.server.fake.record(received)
        self.server.fake.respond(self, received)

    def send_json(self, status: int, payload: JSON) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def send_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")

    def peer_closed(self, timeout_s: float) -> bool:
        """Whether the proxy closes this connection within ``timeout_s``."""
        readable, _, _ = select.select([self.connection], [], [], timeout_s)
        if not readable:
            return False
        try:
            peeked: bytes = self.connection.recv(1, socket.MSG_PEEK)
        except OSError:
            return True
        return peeked == b""


Respond = Callable[[FakeHandler, Received], None]


class _FakeHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    fake: Fake


class Fake:
    """A P or D stand-in: records what arrives, answers with ``respond``."""

    def __init__(self, respond: Respond) -> None:
        self.respond = respond
        self.received: list[Received] = []
        self.arrived = threading.Event()
        self._lock = threading.Lock()
        self._httpd = _FakeHTTPServer(("127.0.0.1", 0), FakeHandler)
        self._httpd.fake = self
        threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def record(self, received: Received) -> None:
        with self._lock:
            self.received.append(received)
        self.arrived.set()

    def only(self) -> Received:
        assert len(self.received) == 1, f"expected one request, got {self.received}"
        return self.received[0]

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def answer(status: int, payload: JSON) -> Respond:
    def respond(handler: FakeHandler, _received: Received) -> None:
        handler.send_json(status, payload)

    return respond


@pytest.fixture
def fakes() -> Iterator[Callable[[Respond], Fake]]:
    made: list[Fake] = []

    def make(respond: Respond) -> Fake:
        made.append(Fake(respond))
        return made[-1]

    yield make
    for fake in made:
        fake.stop()
