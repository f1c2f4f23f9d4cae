"""``kvpush demo``: kvpush between a real vLLM prefill server and a real decode server.

On one machine, with nothing downloaded: a tiny random-weight Qwen3 with a locally trained
tokenizer (:mod:`kvpush_lab.model`), a prefill server P (``kv_producer``) and a decode server D
(``kv_consumer``) started with :class:`kvpush.vllm.KvPushConnector` (:mod:`kvpush_lab.servers`),
and kvpush's proxy in this process. Streaming completions go through the proxy, a few one at a
time and then a few at once; the client times each one (request sent, first token received).

The connector's workers append one JSON line per finished transfer to ``KVPUSH_TIMELINE_DIR``
(set here for both servers): P's send and D's receive of a request share its transfer key, and
D's line carries D's request id, which starts with the id D streamed to the client. Joined,
they give each request's timeline relative to its start: D registered its blocks, the
registration reached P, P's prefill finished, the WRITE was posted and completed, D received
DONE, the first token arrived. D's ``/metrics`` say where its prompt tokens came from: computed
by D, or received over p2p (kvpush). The demo succeeds when every request does and every
prompt token came over p2p.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import json
import math
import os
import random
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO
from urllib.parse import urlsplit

import kvpush
from kvpush.router import PrefillInstance
from kvpush.router.http import ProxyServer
from kvpush_lab.servers import (
    HOST,
    Metrics,
    ServerError,
    StartupState,
    VllmServer,
    metric_value,
    shm_entries,
    stop_all,
    wait_healthy,
)

PREFILL_ENGINE = "kvpush-demo-prefill"
DECODE_ENGINE = "kvpush-demo-decode"
# vLLM's CPU attention keeps K transposed inside a block, so blocks move whole and P and D
# must use the same size (docs/vllm-cpu.md); 128 is the CPU default.
BLOCK_SIZE = 128
DEFAULT_LENGTHS = (256, 1024, 2048)
FIRST_TOKEN_ID = 3  # ids 0-2 are the tiny tokenizer's special tokens
START_TIMEOUT_S = 420.0
REQUEST_TIMEOUT_S = 300.0
TIMELINE_WAIT_S = 10.0

PROMPT_TOKENS = "vllm:prompt_tokens_total"
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"


def default_home() -> Path:
    """Where the demo keeps its model and runs: ``$XDG_CACHE_HOME/kvpush`` (~/.cache/kvpush)."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvpush"


@dataclass(frozen=True)
class DemoOptions:
    """What ``kvpush demo`` was asked to do."""

    requests: int = 8
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    max_tokens: int = 16
    keep_running: bool = False
    run_dir: Path | None = None
    model_dir: Path | None = None
    seed: int = 0


# --- the client --------------------------------------------------------------------------------


@dataclass
class RequestResult:
    """One streamed completion as the client saw it (unix times)."""

    index: int
    label: str
    prompt_tokens: int
    concurrent: bool = False
    sent: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    tokens: int = 0
    response_id: str | None = None
    server_prompt_tokens: int | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token is not None


def stream_completion(
    base_url: str, body: Mapping[str, Any], result: RequestResult, timeout_s: float
) -> RequestResult:
    """POST a streaming ``/v1/completions`` and read its server-sent events into ``result``.

    Every error (connection, HTTP status, an error event, a stream that ends early) ends up in
    ``result.error``; nothing raises.
    """
    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname or HOST, url.port or 80, timeout=timeout_s)
    started = time.monotonic()
    result.sent = time.time()
    try:
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
        )
        response = conn.getresponse()
        if response.status != 200:
            text = response.read().decode(errors="replace")
            result.error = f"HTTP {response.status}: {text[:500]}"
            return result
        done = False
        for raw in _lines(response):
            if not raw.startswith("data:"):
                continue
            data = raw[len("data:") :].strip()
            if data == "[DONE]":
                done = True
                response.read()  # the chunked body's end: closing with it unread resets the peer
                break
            event = json.loads(data)
            if "error" in event:
                result.error = f"error event: {json.dumps(event['error'])[:500]}"
                return result
            result.response_id = result.response_id or event.get("id")
            if event.get("choices") and result.first_token is None:
                result.first_token = result.sent + (time.monotonic() - started)
            usage = event.get("usage")
            if usage:  # the last event (stream_options.include_usage); an event may hold tokens
                result.server_prompt_tokens = usage.get("prompt_tokens")
                result.tokens = int(usage.get("completion_tokens") or 0)
        result.finished = result.sent + (time.monotonic() - started)
        if not done:
            result.error = "the stream ended without [DONE]"
        elif result.first_token is None:
            result.error = "no token streamed"
    except (OSError, http.client.HTTPException, ValueError) as error:
        result.error = f"{type(error).__name__}: {error}"
    finally:
        conn.close()
    return result


def _lines(response: http.client.HTTPResponse) -> Iterator[str]:
    while True:
        line = response.readline()
        if not line:
            return
        yield line.decode(errors="replace").rstrip("\r\n")


def prompt_token_ids(length: int, vocab: int, rng: random.Random) -> list[int]:
    """Random ordinary token ids: each prompt differs, so no prefix cache can serve it."""
    return [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(length)]


def completion_body(model: Path, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {
        "model": str(model),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,  # random weights: the end-of-text token may come at any point
        "skip_special_tokens": False,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


# --- the timelines -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Transfer:
    """One request's transfer: P's send line and D's receive line (either may be missing)."""

    key: str
    send: Mapping[str, Any] | None
    receive: Mapping[str, Any] | None

    def p_at(self, step: str) -> float | None:
        return _wall(self.send, step)

    def d_at(self, step: str) -> float | None:
        return _wall(self.receive, step)

    @property
    def outcome(self) -> str:
        """``done`` when both sides say so, else the first failure with its reason."""
        for line in (self.send, self.receive):
            if line is None:
                continue
            if line.get("outcome") != "done":
                reason = line.get("reason") or "no reason given"
                return f"{line.get('role')} {line.get('outcome')}: {reason}"
        if self.send is None or self.receive is None:
            return "incomplete (one side has no line yet)"
        return "done"

    @property
    def bytes(self) -> int:
        line = self.send or self.receive or {}
        return int(line.get("bytes") or 0)

    @property
    def runs(self) -> int:
        return int((self.send or {}).get("runs") or 0)


def _wall(line: Mapping[str, Any] | None, step: str) -> float | None:
    if line is None:
        return None
    value = line.get("wall", {}).get(step)
    return float(value) if value is not None else None


def read_timelines(directory: Path) -> list[dict[str, Any]]:
    """Every line of every ``*.jsonl`` in ``directory`` (unreadable lines skipped)."""
    lines: list[dict[str, Any]] = []
    for path in sorted(directory.glob("*.jsonl")):
        with contextlib.suppress(OSError):
            for text in path.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    line = json.loads(text)
                    if isinstance(line, dict):
                        lines.append(line)
    return lines


def transfers_by_key(lines: Sequence[Mapping[str, Any]]) -> dict[str, Transfer]:
    """P's send lines and D's receive lines, joined by transfer key."""
    sends = {line["key"]: line for line in lines if line.get("role") == "send" and "key" in line}
    receives = {
        line["key"]: line for line in lines if line.get("role") == "receive" and "key" in line
    }
    return {key: Transfer(key, sends.get(key), receives.get(key)) for key in sends | receives}


def match_requests(
    results: Sequence[RequestResult], transfers: Mapping[str, Transfer]
) -> dict[int, Transfer]:
    """Each request's transfer: the one whose D request id extends the id D streamed back
    (vLLM names a request ``cmpl-<id>-<prompt index>-<8 random hex>`` inside the engine)."""
    matched: dict[int, Transfer] = {}
    for result in results:
        if not result.response_id:
            continue
        prefix = f"{result.response_id}-"
        for transfer in transfers.values():
            request_id = str((transfer.receive or {}).get("request_id", ""))
            if request_id.startswith(prefix):
                matched[result.index] = transfer
                break
    return matched


# --- the report --------------------------------------------------------------------------------

# (header, where) for each timeline column: P's or D's wall step, or the client's first token.
TIMELINE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("D reg", "d", "registered"),
    ("at P", "p", "registered"),
    ("P done", "p", "ready"),
    ("posted", "p", "posted"),
    ("written", "p", "completed"),
    ("D DONE", "d", "completed"),
)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (``q`` in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:.0f}"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def timeline_table(results: Sequence[RequestResult], matched: Mapping[int, Transfer]) -> list[str]:
    """One row per request: its timeline in ms after the client sent it."""
    header = f"  {'#':>3} {'tokens':>6} |"
    header += "".join(f" {name:>7}" for name, _, _ in TIMELINE_COLUMNS)
    header += f" {'1st tok':>7} | {'KV':>9} {'runs':>4}  outcome"
    rows = [header]
    for result in results:
        transfer = matched.get(result.index)
        row = f"  {result.label:>3} {result.prompt_tokens:>6} |"
        for _, side, step in TIMELINE_COLUMNS:
            at = None
            if transfer is not None:
                at = transfer.p_at(step) if side == "p" else transfer.d_at(step)
            row += f" {_ms(None if at is None else at - result.sent):>7}"
        row += f" {_ms(result.ttft):>7} |"
        if transfer is None:
            row += f" {'—':>9} {'—':>4}  {result.error or 'no timeline line'}"
        else:
            row += f" {_size(transfer.bytes):>9} {transfer.runs:>4}  {transfer.outcome}"
        rows.append(row)
    return rows


# --- the run -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _interrupt_on_signals(received: list[str]) -> Iterator[None]:
    """SIGTERM and SIGHUP unwind like Ctrl-C (so every server is stopped); their names go to
    ``received``."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        received.append(signal.Signals(signum).name)
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """A second Ctrl-C must not cut the servers' shutdown short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@dataclass
class Console:
    """Lines to ``out``; progress lines rewrite themselves in place on a terminal."""

    out: TextIO
    tty: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _partial: bool = False

    def say(self, text: str = "") -> None:
        with self._lock:
            self._end_progress()
            self.out.write(text + "\n")
            self.out.flush()

    def progress(self, text: str) -> None:
        """On a terminal, replace the current progress line; elsewhere, print it."""
        with self._lock:
            if self.tty:
                self.out.write("\r\x1b[K" + text)
                self._partial = True
            else:
                self.out.write(text + "\n")
            self.out.flush()

    def _end_progress(self) -> None:
        if self._partial:
            self.out.write("\n")
            self._partial = False


def _startup_reporter(console: Console) -> Callable[[float, Sequence[StartupState]], None]:
    """A progress line when a server's phase changes, and every second (terminal) or 15 s."""
    shown: tuple[str, ...] = ()
    shown_at = -math.inf
    every_s = 1.0 if console.tty else 15.0

    def report(elapsed: float, states: Sequence[StartupState]) -> None:
        nonlocal shown, shown_at
        phases = tuple(s.phase for s in states)
        if phases == shown and elapsed - shown_at < every_s:
            return
        shown, shown_at = phases, elapsed
        parts = [
            f"{s.name}: {s.phase}" + (f" after {s.after_s:.0f} s" if s.healthy else "")
            for s in states
        ]
        console.progress(f"  starting {elapsed:4.0f} s   " + "   ".join(parts))

    return report


def _check_environment() -> str | None:
    missing = [
        name for name in ("vllm", "nixl", "transformers") if not importlib.util.find_spec(name)
    ]
    if missing:
        return (
            f"this Python ({sys.executable}) lacks {', '.join(missing)}: the demo needs the "
            "vLLM CPU stack. Run `scripts/dev demo`, or `scripts/setup-vllm .venv-vllm` and "
            "`.venv-vllm/bin/python -m kvpush.cli demo`."
        )
    return None


def run(options: DemoOptions, out: TextIO | None = None) -> int:
    """Runs the demo; returns the exit code (0: every request succeeded over p2p)."""
    stream = out or sys.stdout
    console = Console(stream, tty=stream.isatty())
    problem = _check_environment()
    if problem:
        console.say(f"kvpush demo: {problem}")
        return 2
    if options.requests < 1 or not options.lengths or min(options.lengths) < 1:
        console.say("kvpush demo: --requests and every --lengths value must be at least 1")
        return 2
    received: list[str] = []
    with _interrupt_on_signals(received):
        try:
            return _run(options, console)
        except KeyboardInterrupt:
            cause = received[0] if received else "Ctrl-C"
            console.say(f"\nkvpush demo: interrupted ({cause}); servers and proxy stopped")
            return 130


def _run(options: DemoOptions, console: Console) -> int:
    from kvpush_lab.model import make_tiny_model

    demo_started = time.monotonic()
    home = default_home()
    run_dir = options.run_dir or home / "runs" / time.strftime("%Y%m%d-%H%M%S")
    timeline_dir = run_dir / "timelines"
    run_dir.mkdir(parents=True, exist_ok=True)
    console.say(
        f"kvpush {kvpush.__version__} demo: vLLM prefill (P) and decode (D) servers on "
        f"localhost, KV pushed P -> D by kvpush over NIXL (UCX on loopback)"
    )
    console.say(f"  run directory {run_dir}")

    model_dir = options.model_dir or home / "tiny-qwen3"
    reused = (model_dir / "kvpush-tiny-model.json").is_file()
    started = time.monotonic()
    model = make_tiny_model(model_dir)
    config = json.loads((model / "config.json").read_text())
    vocab = int(config["vocab_size"])
    console.say(
        f"  model {model}: Qwen3, {config['num_hidden_layers']} layers, random weights, "
        f"local BPE tokenizer ({vocab} tokens); "
        + (
            "reused"
            if reused and time.monotonic() - started < 1
            else f"made in {time.monotonic() - started:.1f} s"
        )
    )

    common = {
        "kv_connector": "KvPushConnector",
        "kv_connector_module_path": "kvpush.vllm",
        "kv_buffer_device": "cpu",
    }
    # The secret goes in the environment: kvpush refuses it in the connector's config, which
    # vLLM logs and any user can read on the command line (/proc/*/cmdline).
    env = {"KVPUSH_TIMELINE_DIR": str(timeline_dir), "KVPUSH_SECRET": secrets.token_hex(16)}
    max_model_len = max(4096, max(options.lengths) + options.max_tokens)
    prefill = VllmServer(
        "P",
        model,
        run_dir,
        cpu="0",
        max_model_len=max_model_len,
        block_size=BLOCK_SIZE,
        kv_transfer_config={**common, "kv_role": "kv_producer", "engine_id": PREFILL_ENGINE},
        extra_env=env,
    )
    decode = VllmServer(
        "D",
        model,
        run_dir,
        cpu="1",
        max_model_len=max_model_len,
        block_size=BLOCK_SIZE,
        kv_transfer_config={**common, "kv_role": "kv_consumer", "engine_id": DECODE_ENGINE},
        extra_args=["--no-enable-prefix-caching"],
        extra_env=env,
    )
    servers = (prefill, decode)
    shm_before = shm_entries()
    proxy: ProxyServer | None = None
    try:
        for server in servers:
            server.start()
        console.say(
            f"  P {prefill.url} (kv_producer, engine {PREFILL_ENGINE}, core 0, log "
            f"{prefill.log_path.name})\n  D {decode.url} (kv_consumer, no prefix cache, core 1, "
            f"log {decode.log_path.name}); both with KvPushConnector, {BLOCK_SIZE}-token blocks, "
            "an HMAC secret for this run"
        )
        console.say("  starting vLLM (a minute or so on 2 cores) ...")
        try:
            wait_healthy(servers, START_TIMEOUT_S, progress=_startup_reporter(console))
        except ServerError as error:
            console.say(f"\nkvpush demo: {error}")
            return 1
        console.say(
            f"  P healthy after {prefill.ready_after_s:.0f} s, D after {decode.ready_after_s:.0f} s"
        )

        coordinates = PrefillInstance(
            prefill.url, PREFILL_ENGINE, HOST, prefill.side_channel_port, tp=1, pp=1
        )
        proxy = ProxyServer([coordinates], [decode.url], host=HOST, port=0)
        proxy.start()
        proxy_url = proxy.url
        console.say(f"  proxy {proxy_url} (kvpush, in this process): both legs at once\n")

        code = _exercise(options, console, model, vocab, proxy_url, decode, timeline_dir)
        if code != 0:
            for server in servers:
                logged = server.first_error()
                if logged is not None:
                    state = "running" if server.exit_code() is None else "exited"
                    console.say(f"  {server.name} ({state}) logged: {logged}")
        console.say(
            f"\n  demo wall time {time.monotonic() - demo_started:.0f} s; logs in {run_dir}"
        )
        if options.keep_running:
            console.say(
                f"\n  still running (Ctrl-C stops all three):\n    proxy {proxy_url}\n"
                f"    P     {prefill.url}\n    D     {decode.url}\n  try:\n"
                f"    curl -s {proxy_url}/v1/completions -H 'Content-Type: application/json' "
                f"""-d '{{"model": "{model}", "prompt": "Hello", "max_tokens": 8}}'"""
            )
            while all(s.exit_code() is None for s in servers):
                time.sleep(1.0)
            console.say("kvpush demo: a server exited; stopping")
        return code
    finally:
        with _sigint_ignored():
            if proxy is not None:
                proxy.stop()
            stop_all(servers, shm_before)


def _exercise(
    options: DemoOptions,
    console: Console,
    model: Path,
    vocab: int,
    proxy_url: str,
    decode: VllmServer,
    timeline_dir: Path,
) -> int:
    """Send the requests, then print the timelines and the summary; returns the exit code."""
    rng = random.Random(options.seed)
    lengths = [options.lengths[i % len(options.lengths)] for i in range(options.requests)]
    # Half one at a time, then the rest at once (when that is at least two).
    sequential = (options.requests + 1) // 2
    if options.requests - sequential < 2:
        sequential = options.requests
    results = [
        RequestResult(i + 1, str(i + 1), n, concurrent=i >= sequential)
        for i, n in enumerate(lengths)
    ]
    prompts = [prompt_token_ids(n, vocab, rng) for n in lengths]
    total = len(results)

    def send(result: RequestResult, prompt: list[int]) -> None:
        body = completion_body(model, prompt, options.max_tokens)
        stream_completion(proxy_url, body, result, REQUEST_TIMEOUT_S)
        console.say(_request_line(result, total, options.max_tokens))

    before = _metrics_or_none(decode)
    console.say(f"  {_count(sequential, 'request')} one at a time:")
    for result, prompt in zip(results[:sequential], prompts[:sequential], strict=True):
        send(result, prompt)
    if total > sequential:
        console.say(f"  {_count(total - sequential, 'request')} at once:")
        threads = [
            threading.Thread(target=send, args=(r, p), name=f"request-{r.index}", daemon=True)
            for r, p in zip(results[sequential:], prompts[sequential:], strict=True)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    transfers, lines = _collect_timelines(timeline_dir, results)
    after = _metrics_or_none(decode)

    console.say()
    if lines:
        matched = match_requests(results, transfers)
        console.say("  timeline (ms after the client sent the request)")
        for row in timeline_table(results, matched):
            console.say(row)
        console.say(
            "  D reg: D registered its blocks with P; at P: the registration reached P; "
            "P done: P's prefill\n  finished (KV ready); posted/written: P's WRITE into D's "
            "blocks; D DONE: D got the DONE\n  notification; 1st tok: the client got the first "
            "token (= TTFT). runs: descriptor runs after merging."
        )
    else:
        matched = {}
        console.say(
            f"  timeline unavailable: no kvpush timeline lines in {timeline_dir} (this "
            "kvpush's connector does not write them); client-side figures only"
        )
    return _summary(console, options, results, matched, transfers, before, after)


def _request_line(result: RequestResult, total: int, max_tokens: int) -> str:
    head = f"  [{result.label}/{total}] {result.prompt_tokens:>5} tokens"
    if result.error is not None or result.first_token is None or result.finished is None:
        return f"{head}  FAILED: {result.error}"
    decode_s = result.finished - result.first_token
    return (
        f"{head}  TTFT {result.ttft or 0.0:5.2f} s  "
        f"{result.tokens}/{max_tokens} tokens in {result.finished - result.sent:5.2f} s "
        f"({decode_s / max(result.tokens - 1, 1) * 1000:.0f} ms/token after the first)"
    )


def _metrics_or_none(server: VllmServer) -> Metrics | None:
    try:
        return server.metrics()
    except (OSError, http.client.HTTPException, ServerError):
        return None


def _collect_timelines(
    directory: Path, results: Sequence[RequestResult]
) -> tuple[dict[str, Transfer], list[dict[str, Any]]]:
    """The timelines once every request's transfer has both lines, or after a bounded wait.

    P writes its line when it learns the WRITE completed, which can be just after D's first
    token; a timeline-less connector writes nothing, and then the wait is short.
    """
    deadline = time.monotonic() + TIMELINE_WAIT_S
    while True:
        lines = read_timelines(directory)
        transfers = transfers_by_key(lines)
        matched = match_requests(results, transfers)
        complete = all(
            r.index in matched and matched[r.index].send is not None for r in results if r.ok
        )
        waited = TIMELINE_WAIT_S - (deadline - time.monotonic())
        if complete or waited > TIMELINE_WAIT_S or (not lines and waited > 2.0):
            return transfers, lines
        time.sleep(0.25)


def _summary(
    console: Console,
    options: DemoOptions,
    results: Sequence[RequestResult],
    matched: Mapping[int, Transfer],
    transfers: Mapping[str, Transfer],
    before: Metrics | None,
    after: Metrics | None,
) -> int:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    console.say()
    console.say(
        f"  requests   {len(ok)}/{len(results)} succeeded "
        f"({', '.join(str(n) for n in sorted({r.prompt_tokens for r in results}))}-token "
        f"prompts, "
        f"{options.max_tokens} tokens each, greedy)"
    )
    if ttfts:
        console.say(
            f"  TTFT       p50 {percentile(ttfts, 50) * 1000:.0f} ms   "
            f"p99 {percentile(ttfts, 99) * 1000:.0f} ms   (client side, through the proxy)"
        )
        for concurrent, name in ((False, "one at a time"), (True, "at once")):
            group = [r.ttft for r in ok if r.concurrent == concurrent and r.ttft is not None]
            if group and len(group) < len(ttfts):
                console.say(
                    f"             {name}: p50 {percentile(group, 50) * 1000:.0f} ms, "
                    f"max {max(group) * 1000:.0f} ms ({_count(len(group), 'request')})"
                )
    handovers = [
        r.first_token - ready
        for r in ok
        if r.first_token is not None
        and r.index in matched
        and (ready := matched[r.index].p_at("ready")) is not None
    ]
    if handovers:
        console.say(
            f"  handover   p50 {percentile(handovers, 50) * 1000:.0f} ms   "
            "(first token minus P's prefill done)"
        )
    if transfers:
        done = [t for t in transfers.values() if t.outcome == "done"]
        bad = [t for t in transfers.values() if t.outcome != "done"]
        moved = sum(t.bytes for t in done)
        console.say(
            f"  kvpush     {len(done)} transfers done, {len(bad)} failed; "
            f"{_size(moved)} moved in {sum(t.runs for t in done)} descriptor runs"
        )
        for transfer in bad:
            console.say(f"             {transfer.key}: {transfer.outcome}")
    else:
        console.say("  kvpush     timeline unavailable: transfer counts unknown")

    p2p_ok = False
    if before is None or after is None:
        console.say("  KV source  D's /metrics unreadable: where the KV came from is unknown")
    else:
        prompt = metric_value(after, PROMPT_TOKENS) - metric_value(before, PROMPT_TOKENS)
        p2p = metric_value(after, CACHED_BY_SOURCE, source="p2p") - metric_value(
            before, CACHED_BY_SOURCE, source="p2p"
        )
        share = f"{p2p / prompt:.0%}" if prompt else "—"
        console.say(
            f"  KV source  D's /metrics: {prompt:.0f} prompt tokens, {p2p:.0f} received over p2p "
            f"({share}), {prompt - p2p:.0f} computed by D"
        )
        p2p_ok = prompt > 0 and p2p == prompt

    success = not failed and p2p_ok
    if success:
        console.say("  result     OK: every request succeeded and every prompt token came from P")
    else:
        why = []
        if failed:
            why.append(f"{len(failed)} request(s) failed")
        if not p2p_ok:
            why.append("not every prompt token came over p2p")
        console.say(f"  result     FAILED: {'; '.join(why)}")
    return 0 if success else 1
