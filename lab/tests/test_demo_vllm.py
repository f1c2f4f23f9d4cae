"""``kvpush demo``'s bookkeeping without vLLM: timelines joined to the client's requests, the
streamed response read against a fake server, percentiles, log scraping and /dev/shm rules."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvpush_lab import demo_vllm, servers
from kvpush_lab.demo_vllm import RequestResult, Transfer


def timeline_line(role: str, key: str, request_id: str, **wall: float) -> dict[str, object]:
    return {
        "engine": "P" if role == "send" else "D",
        "role": role,
        "request_id": request_id,
        "key": key,
        "outcome": "done",
        "reason": None,
        "bytes": 524288,
        "runs": 2,
        "wall": wall,
    }


def test_timelines_join_by_key_and_match_the_id_d_streamed(tmp_path: Path) -> None:
    lines = [
        timeline_line("send", "t-1", "cmpl-a-0-11111111", ready=100.2, posted=100.21),
        timeline_line("receive", "t-1", "cmpl-a-0-22222222", registered=100.01, completed=100.3),
        timeline_line("receive", "t-2", "cmpl-ab-0-33333333", registered=101.0),
    ]
    (tmp_path / "p-tp0.jsonl").write_text(json.dumps(lines[0]) + "\nnot json\n")
    (tmp_path / "d-tp0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines[1:]))

    transfers = demo_vllm.transfers_by_key(demo_vllm.read_timelines(tmp_path))
    assert set(transfers) == {"t-1", "t-2"}
    assert transfers["t-1"].outcome == "done"
    assert transfers["t-2"].outcome.startswith("incomplete"), "P's line is missing"

    first = RequestResult(1, "1", 256, sent=100.0, first_token=100.4, response_id="cmpl-a")
    second = RequestResult(2, "2", 256, sent=101.0, response_id="cmpl-ab")
    unknown = RequestResult(3, "3", 256, response_id=None)
    matched = demo_vllm.match_requests([first, second, unknown], transfers)
    # "cmpl-a" must not claim "cmpl-ab-0-...": the match is on the id plus its separator.
    assert matched[1].key == "t-1"
    assert matched[2].key == "t-2"
    assert 3 not in matched

    (header, row, *_) = demo_vllm.timeline_table([first], matched)
    assert "D reg" in header
    assert row.split()[3:5] == ["10", "—"], "D registered at +10 ms; P's registration unknown"
    assert "512.0 KiB" in row


def test_a_failed_side_names_its_reason() -> None:
    send = timeline_line("send", "k", "r")
    send.update(outcome="failed", reason="peer_lost")
    transfer = Transfer("k", send, timeline_line("receive", "k", "r"))
    assert transfer.outcome == "send failed: peer_lost"


def test_percentile_interpolates_between_ranks() -> None:
    assert demo_vllm.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert demo_vllm.percentile([1.0, 2.0], 50) == 1.5
    assert demo_vllm.percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert demo_vllm.percentile([], 50) != demo_vllm.percentile([], 50)  # NaN


class _FakeCompletions(BaseHTTPRequestHandler):
    """Streams two events holding three tokens, a usage event and [DONE], chunked."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body.get("fail"):
            payload = b'{"error": {"message": "prefill leg failed"}}'
            self.send_response(502)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = [
            {"id": "cmpl-x", "choices": [{"text": "ab"}]},
            {"id": "cmpl-x", "choices": [{"text": "c"}]},
            {"id": "cmpl-x", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}},
        ]
        for data in [json.dumps(e) for e in events] + ["[DONE]"]:
            chunk = f"data: {data}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def fake_server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _FakeCompletions)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_stream_completion_reads_the_events(fake_server: str) -> None:
    result = demo_vllm.stream_completion(
        fake_server,
        demo_vllm.completion_body(Path("m"), [3, 4, 5, 6, 7], 3),
        RequestResult(1, "1", 5),
        timeout_s=10.0,
    )
    assert result.error is None
    assert result.ok
    assert result.response_id == "cmpl-x"
    assert result.tokens == 3, "counted from usage, not from events"
    assert result.server_prompt_tokens == 5
    assert result.first_token is not None
    assert result.finished is not None
    assert result.sent <= result.first_token <= result.finished


def test_stream_completion_reports_errors_without_raising(fake_server: str) -> None:
    failed = demo_vllm.stream_completion(fake_server, {"fail": True}, RequestResult(1, "1", 1), 10)
    assert not failed.ok
    assert failed.error == 'HTTP 502: {"error": {"message": "prefill leg failed"}}'
    refused = demo_vllm.stream_completion("http://127.0.0.1:1", {}, RequestResult(2, "2", 1), 5.0)
    assert not refused.ok
    assert refused.error is not None
    assert "ConnectionRefusedError" in refused.error


def test_first_error_finds_the_root_cause_in_a_vllm_log(tmp_path: Path) -> None:
    server = servers.VllmServer("P", Path("model"), tmp_path, port=1, side_channel_port=2)
    server.log_path.write_text(
        "WARNING ... fd limit errors like `OSError: [Errno 24] Too many open files`\n"
        "(EngineCore pid=7) ERROR 11-29 [core.py:1512] AssertionError: worker-role method\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    assert server.first_error() == "AssertionError: worker-role method"
    assert server.phase() == servers.IMPORTING


def test_command_pins_the_core_and_passes_the_connector_config(tmp_path: Path) -> None:
    server = servers.VllmServer(
        "D",
        Path("model"),
        tmp_path,
        cpu="1",
        port=8100,
        side_channel_port=8200,
        block_size=128,
        kv_transfer_config={"kv_role": "kv_consumer"},
        extra_env={"KVPUSH_TIMELINE_DIR": "/t"},
    )
    command = server.command()
    assert command[command.index("--block-size") + 1] == "128"
    assert json.loads(command[command.index("--kv-transfer-config") + 1]) == {
        "kv_role": "kv_consumer"
    }
    env = server.environment()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "8200"
    assert env["KVPUSH_TIMELINE_DIR"] == "/t"


def test_clean_shm_keeps_semaphores_and_entries_in_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(servers, "SHM", tmp_path)
    (tmp_path / "old").write_text("")
    before = servers.shm_entries()
    for name in ("psm_leaked", "sem.mp-live", "psm_mapped"):
        (tmp_path / name).write_text("")
    monkeypatch.setattr(servers, "_shm_in_use", lambda: {"psm_mapped"})
    assert servers.clean_shm(before) == ["psm_leaked"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old", "psm_mapped", "sem.mp-live"]


def test_metrics_are_summed_over_matching_labels() -> None:
    samples = servers.parse_metrics(
        "# HELP x\n"
        'vllm:prompt_tokens_cached_by_source_total{engine="0",source="p2p"} 1300.0\n'
        'vllm:prompt_tokens_cached_by_source_total{engine="0",source="local"} 7.0\n'
        'vllm:prompt_tokens_total{engine="0"} 1307.0\n'
    )
    assert servers.metric_value(samples, demo_vllm.CACHED_BY_SOURCE, source="p2p") == 1300
    assert servers.metric_value(samples, demo_vllm.PROMPT_TOKENS) == 1307
    assert servers.metric_value(samples, "absent") == 0


def test_a_servers_log_never_shows_its_secret(tmp_path: Path) -> None:
    """kvpush's secret travels in the environment, which the log redacts; a secret some other
    connector takes in its JSON config is redacted from the logged command line too."""
    secret = "s3cret-value-that-must-not-be-logged"
    token = "t0ken-value-that-must-not-be-logged"
    server = servers.VllmServer(
        "P",
        Path("model"),
        tmp_path,
        port=1,
        side_channel_port=2,
        kv_transfer_config={"kv_connector_extra_config": {"token": token, "ttl": 5}},
        extra_env={"KVPUSH_SECRET": secret},
        extra_args=["--definitely-not-a-vllm-flag"],
    )
    server.start()
    try:
        assert server.process is not None
        server.process.wait(timeout=60)
    finally:
        server.stop()
    logged = server.log_text()
    assert servers.REDACTED in logged
    assert secret not in logged
    assert token not in logged
    # The server itself still gets them, the secret never on its command line.
    assert server.environment()["KVPUSH_SECRET"] == secret
    assert secret not in " ".join(server.command())
    assert token in " ".join(server.command())
