"""Real vLLM servers for end-to-end tests: start, wait, query, stop, clean up.

Owns three things, all standard library only (the tests also run in a venv without vLLM,
where they are skipped):

* :class:`VllmServer`: one ``python -m vllm.entrypoints.openai.api_server`` subprocess with the
  settings this 2-core CPU machine needs (docs/vllm-cpu.md): fp32, eager, a 1 GiB KV cache,
  OpenMP pinned to one core, its own NIXL side-channel port, logs in a file, and on stop the
  whole process group ended and its ``/dev/shm`` leftovers removed.
* The proxy legs of a disaggregated request: :func:`push_completion` sends the prefill (P) and
  decode (D) legs concurrently the way vLLM's push demo proxy does;
  :func:`pull_completion` sends P then D with P's returned ``kv_transfer_params``.
* :meth:`VllmServer.metric`: Prometheus counters from ``/metrics``.

Ports, process groups, ``/dev/shm`` clean-up and metrics parsing are :mod:`kvpush.servers`'
(the demo's launcher), shared rather than copied.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpush.servers import (
    HOST,
    clean_shm,
    free_port,
    metric_value,
    parse_metrics,
    shm_entries,
    signal_group,
)

JSON = dict[str, Any]


@dataclass
class VllmServer:
    """One vLLM OpenAI-compatible server process.

    ``cpu`` is the core its OpenMP threads are bound to (``VLLM_CPU_OMP_THREADS_BIND``): the
    default ``auto`` puts every server on core 0. ``kv_transfer_config`` is passed as
    ``--kv-transfer-config`` JSON; ``side_channel_port`` is its ``VLLM_NIXL_SIDE_CHANNEL_PORT``.
    """

    name: str
    model: Path
    log_dir: Path
    cpu: str = "0"
    port: int = field(default_factory=free_port)
    side_channel_port: int = field(default_factory=free_port)
    kv_transfer_config: JSON | None = None
    max_model_len: int = 4096
    extra_args: Sequence[str] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)
    python: str = sys.executable

    process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    started_at: float = field(default=0.0, init=False, repr=False)
    ready_after_s: float | None = field(default=None, init=False)
    _shm_before: set[str] = field(default_factory=set, init=False, repr=False)

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        args = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            str(self.max_model_len),
            "--disable-uvicorn-access-log",
        ]
        if self.kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return args + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": self.cpu,
                "VLLM_NIXL_SIDE_CHANNEL_HOST": HOST,
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
                "VLLM_HOST_IP": HOST,
                "UCX_NET_DEVICES": "lo",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
            }
        )
        env.update(self.extra_env)
        return env

    def start(self) -> None:
        """Launch the server in its own process group; output goes to :attr:`log_path`."""
        if self.process is not None:
            raise RuntimeError(f"{self.name}: already started (pid {self.process.pid})")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._shm_before = shm_entries()
        with self.log_path.open("wb") as log:
            log.write(
                f"# {' '.join(self.command())}\n# VLLM_CPU_OMP_THREADS_BIND={self.cpu} "
                f"VLLM_NIXL_SIDE_CHANNEL_PORT={self.side_channel_port}\n".encode()
            )
            log.flush()
            self.started_at = time.monotonic()
            self.process = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,
            )
        print(f"[{self.name}] started pid {self.process.pid} on {self.url}, log {self.log_path}")

    def wait_healthy(self, timeout_s: float = 300.0, progress_every_s: float = 15.0) -> float:
        """Poll ``/health`` until 200; returns seconds since start. Raises with the log's tail."""
        process = self._running()
        deadline = self.started_at + timeout_s
        next_progress = time.monotonic() + progress_every_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"{self.name}: exited with {process.returncode} before it was healthy; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            with contextlib.suppress(OSError, http.client.HTTPException):
                status, _ = self._request("GET", "/health", timeout_s=2.0)
                if status == 200:
                    self.ready_after_s = time.monotonic() - self.started_at
                    print(f"[{self.name}] healthy after {self.ready_after_s:.1f} s")
                    return self.ready_after_s
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(
                    f"{self.name}: not healthy within {timeout_s:.0f} s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if now >= next_progress:
                last = self.log_tail(1).strip()
                print(f"[{self.name}] waiting for /health ({now - self.started_at:.0f} s): {last}")
                next_progress = now + progress_every_s
            time.sleep(0.5)

    def stop(self, grace_s: float = 20.0, *, clean: bool = True) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``, then clean ``/dev/shm``.

        ``clean=False`` leaves ``/dev/shm`` alone, for a caller that stops several servers and
        cleans once after the last (one server's files are not "unused" while another of the
        same group still runs).
        """
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            signal_group(process.pid, signal.SIGTERM)
            try:
                process.wait(grace_s)
            except subprocess.TimeoutExpired:
                print(f"[{self.name}] still running {grace_s:.0f} s after SIGTERM: SIGKILL")
                signal_group(process.pid, signal.SIGKILL)
                process.wait(10.0)
        # The engine core and worker children share the group; make sure none outlived it.
        signal_group(process.pid, signal.SIGKILL)
        print(f"[{self.name}] stopped (exit {process.returncode})")
        if clean:
            removed = clean_shm(self._shm_before)
            print(f"[{self.name}] removed from /dev/shm: {removed or 'nothing'}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def post(self, path: str, body: JSON, *, headers: Mapping[str, str] | None = None) -> JSON:
        """POST JSON; returns the decoded response, raising with the body on a non-200."""
        status, payload = self._request("POST", path, body=body, headers=headers)
        if status != 200:
            raise RuntimeError(f"{self.name}: POST {path} -> {status}: {payload[:2000]!r}")
        result: JSON = json.loads(payload)
        return result

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        status, payload = self._request("GET", "/metrics")
        if status != 200:
            raise RuntimeError(f"{self.name}: GET /metrics -> {status}")
        return parse_metrics(payload.decode())

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels`` (0 when none)."""
        return metric_value(self.metrics(), name, **labels)

    def _running(self) -> subprocess.Popen[bytes]:
        if self.process is None:
            raise RuntimeError(f"{self.name}: not started")
        return self.process

    def _request(
        self,
        method: str,
        path: str,
        *,
        body: JSON | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = 300.0,
    ) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout_s)
        try:
            data = None if body is None else json.dumps(body).encode()
            all_headers = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=data, headers=all_headers)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()


@contextlib.contextmanager
def running(*servers: VllmServer, timeout_s: float = 300.0) -> Iterator[tuple[VllmServer, ...]]:
    """Start ``servers`` together, wait until all are healthy, and always stop them.

    The servers are waited for concurrently, so each one's ``ready_after_s`` is its own.
    ``/dev/shm`` is cleaned once, after the last one stopped.
    """
    shm_before = shm_entries()
    try:
        for server in servers:
            server.start()
        _wait_all_healthy(servers, timeout_s)
        yield servers
    finally:
        for server in servers:
            server.stop(clean=False)
        removed = clean_shm(shm_before)
        print(
            f"[{', '.join(s.name for s in servers)}] removed from /dev/shm: {removed or 'nothing'}"
        )


def _wait_all_healthy(servers: Sequence[VllmServer], timeout_s: float) -> None:
    errors: list[BaseException] = []

    def wait(server: VllmServer) -> None:
        try:
            server.wait_healthy(timeout_s)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=wait, args=(s,), name=f"wait-{s.name}") for s in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


# --- the proxy legs --------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillEndpoint:
    """Where D's connector finds P: what a push proxy must know about P up front."""

    server: VllmServer
    engine_id: str
    tp_size: int = 1
    pp_size: int = 1

    @property
    def side_channel_host(self) -> str:
        return HOST

    @property
    def side_channel_port(self) -> int:
        return self.server.side_channel_port


@dataclass(frozen=True)
class Disaggregated:
    """Both legs' responses of one request. ``decode`` is what a client would receive."""

    request_id: str
    transfer_id: str
    prefill: JSON
    decode: JSON
    prefill_s: float
    decode_s: float


def push_completion(prefill: PrefillEndpoint, decode: VllmServer, body: JSON) -> Disaggregated:
    """One ``/v1/completions`` request through a push proxy (reference §2.2).

    Both legs go out concurrently with the same ``X-Request-Id`` and ``transfer_id``: P with
    ``max_tokens=1`` and ``do_remote_decode``; D with ``do_remote_prefill`` and P's
    coordinates (no block ids: in push, D registers its blocks with P).
    """
    request_id = str(uuid.uuid4())
    transfer_id = str(uuid.uuid4())
    headers = {"X-Request-Id": request_id}
    p_body = dict(body)
    p_body["max_tokens"] = 1
    if "max_completion_tokens" in p_body:
        p_body["max_completion_tokens"] = 1
    p_body["stream"] = False
    p_body["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
        "transfer_id": transfer_id,
    }
    d_body = dict(body)
    d_body["stream"] = False
    d_body["kv_transfer_params"] = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": prefill.engine_id,
        "remote_host": prefill.side_channel_host,
        "remote_port": prefill.side_channel_port,
        "tp_size": prefill.tp_size,
        "pp_size": prefill.pp_size,
        "remote_request_id": request_id,
        "transfer_id": transfer_id,
    }
    results: dict[str, JSON] = {}
    seconds: dict[str, float] = {}
    errors: dict[str, BaseException] = {}

    def leg(name: str, server: VllmServer, leg_body: JSON) -> None:
        start = time.monotonic()
        try:
            results[name] = server.post("/v1/completions", leg_body, headers=headers)
        except BaseException as exc:
            errors[name] = exc
        seconds[name] = time.monotonic() - start

    threads = [
        threading.Thread(target=leg, args=("prefill", prefill.server, p_body), name="leg-P"),
        threading.Thread(target=leg, args=("decode", decode, d_body), name="leg-D"),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError(f"request {request_id} (transfer {transfer_id}): {errors}")
    return Disaggregated(
        request_id,
        transfer_id,
        results["prefill"],
        results["decode"],
        seconds["prefill"],
        seconds["decode"],
    )


def pull_completion(prefill: VllmServer, decode: VllmServer, body: JSON) -> Disaggregated:
    """One ``/v1/completions`` request through a pull proxy (``NixlConnector``).

    P first, with ``do_remote_decode`` and ``max_tokens=1``; its response's
    ``kv_transfer_params`` (engine id, block ids, host, port) go to D, which reads the KV.
    """
    request_id = str(uuid.uuid4())
    headers = {"X-Request-Id": request_id}
    p_body = dict(body)
    p_body["max_tokens"] = 1
    p_body["stream"] = False
    p_body["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    start = time.monotonic()
    p_response = prefill.post("/v1/completions", p_body, headers=headers)
    prefill_s = time.monotonic() - start
    params = p_response.get("kv_transfer_params")
    if not params:
        raise RuntimeError(f"request {request_id}: P returned no kv_transfer_params: {p_response}")
    d_body = dict(body)
    d_body["stream"] = False
    d_body["kv_transfer_params"] = params
    start = time.monotonic()
    d_response = decode.post("/v1/completions", d_body, headers=headers)
    decode_s = time.monotonic() - start
    return Disaggregated(request_id, "", p_response, d_response, prefill_s, decode_s)


def completion_token_ids(response: JSON) -> list[int]:
    """The generated token ids of a ``/v1/completions`` response sent with ``return_token_ids``."""
    ids: list[int] = response["choices"][0]["token_ids"]
    return ids


def completion_logprobs(response: JSON) -> list[float]:
    """The generated tokens' log-probabilities of a response sent with ``logprobs``."""
    values: list[float] = response["choices"][0]["logprobs"]["token_logprobs"]
    return values


# --- /metrics --------------------------------------------------------------------------------
