"""kvpush's connector in real vLLM servers: a prefill server (P) and a decode server (D) on
loopback behind ``kvpush proxy``, which sends both legs at once with one transfer_id.

* D's greedy continuation equals a plain single server's: token ids, and log-probabilities
  within 1e-3 (which catches a wrong block even where the ids do not: see
  ``test_upstream_smoke.py``), sequentially and with concurrent requests;
* P streams layer by layer (``layerwise: "on"``): its timelines show layers written before its
  prefills ended, and the answers are still exact;
* D's metrics show that every prompt token came from P (``source="p2p"``);
* a client that hangs up mid-way (while D still waits for the KV, or mid-stream) leaves both
  servers healthy: nothing stays running, no KV block stays held, and the next request is
  still exact.

vLLM's CPU attention keeps K transposed inside a block, so its blocks move whole and P and D
need the same block size there (``KVPUSH_E2E_BLOCKS=P,D`` overrides; block-size translation is
covered by the unit, property and two-process tests). The single server runs before the pair,
so at most two servers share the two cores.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpush_lab.servers import HOST, metric_value
from tests.e2e.harness import (
    ON_VLLM,
    VllmServer,
)
from tests.e2e.pairs import (
    PREFILL_ENGINE_ID,
    Pair,
    assert_concurrent,
    assert_layers_streamed,
    assert_same,
    assert_sequential,
    behind_proxy,
    greedy_body,
    kvpush_servers,
    prompt_token_ids,
    single_answers,
)

pytestmark = ON_VLLM

SEQUENTIAL = (300, 1000, 2100)
CONCURRENT = (500, 700, 900, 1100)


@pytest.fixture(scope="module")
def prompts(tiny_model: Path) -> dict[int, list[int]]:
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    return {n: prompt_token_ids(n, vocab, seed=n) for n in SEQUENTIAL + CONCURRENT}


@pytest.fixture(scope="module")
def reference(tiny_model: Path, prompts: dict[int, list[int]], logs: Path) -> dict[int, Any]:
    """What a plain single server answers, before the pair starts."""
    single = VllmServer("single", tiny_model, logs, cpu="0")
    return single_answers(single, tiny_model, prompts)


@pytest.fixture(scope="module")
def pair(tiny_model: Path, logs: Path, reference: dict[int, Any]) -> Iterator[Pair]:
    prefill, decode = kvpush_servers(tiny_model, logs, PREFILL_ENGINE_ID, layerwise="on")
    with behind_proxy(prefill, decode, PREFILL_ENGINE_ID) as pair:
        yield pair


def test_sequential_requests_match_a_single_server(
    pair: Pair, tiny_model: Path, prompts: dict[int, list[int]], reference: dict[int, Any]
) -> None:
    assert_sequential(pair, tiny_model, prompts, reference, SEQUENTIAL)


def test_concurrent_requests_match_a_single_server(
    pair: Pair, tiny_model: Path, prompts: dict[int, list[int]], reference: dict[int, Any]
) -> None:
    assert_concurrent(pair, tiny_model, prompts, reference, CONCURRENT)


def test_p_streamed_layers_while_its_prefills_ran(pair: Pair, logs: Path) -> None:
    """P runs layer-wise push: the prompts wrote layers before their prefill ended, the 2,100
    token one (vLLM chunks it) chunk by chunk; one may go whole where D registered late."""
    assert_layers_streamed(logs, pair.prefill.name, at_least=len(SEQUENTIAL) - 1)


def test_every_prompt_token_came_from_p(pair: Pair) -> None:
    metrics = pair.decode.metrics()
    prompt_tokens = metric_value(metrics, "vllm:prompt_tokens_total")
    from_p2p = metric_value(metrics, "vllm:prompt_tokens_cached_by_source_total", source="p2p")
    print(f"D: prompt tokens {prompt_tokens:.0f}, from p2p {from_p2p:.0f}")
    assert prompt_tokens == sum(SEQUENTIAL) + sum(CONCURRENT)
    assert from_p2p == prompt_tokens, "D computed part of a prompt instead of receiving it"


def abandon(pair: Pair, body: dict[str, Any], after_chunks: int) -> None:
    """Sends a streaming request and hangs up after ``after_chunks`` SSE lines (0: at once)."""
    connection = http.client.HTTPConnection(pair.host, pair.port, timeout=120)
    connection.request(
        "POST", "/v1/completions", json.dumps({**body, "stream": True}),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    if after_chunks:
        response = connection.getresponse()
        assert response.status == 200
        received = 0
        while received < after_chunks:
            line = response.fp.readline()
            assert line, "the stream ended before the client hung up"
            received += line.startswith(b"data:")
    connection.close()


def running_requests(server: VllmServer) -> float:
    metrics = server.metrics()
    return metric_value(metrics, "vllm:num_requests_running") + metric_value(
        metrics, "vllm:num_requests_waiting"
    )


def kv_cache_usage(server: VllmServer) -> float:
    """The share of the server's KV blocks that requests hold (a cached free block is free)."""
    return metric_value(server.metrics(), "vllm:kv_cache_usage_perc")


def healthy(server: VllmServer) -> bool:
    connection = http.client.HTTPConnection(HOST, server.port, timeout=10)
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()


def test_client_hanging_up_leaves_both_servers_healthy(
    pair: Pair, tiny_model: Path, prompts: dict[int, list[int]], reference: dict[int, Any]
) -> None:
    long_answer = {**greedy_body(tiny_model, prompts[2100]), "max_tokens": 400}
    abandon(pair, long_answer, after_chunks=0)  # while D still waits for P's KV
    abandon(pair, long_answer, after_chunks=3)  # mid-stream
    deadline = time.monotonic() + 60.0
    while running_requests(pair.decode) or running_requests(pair.prefill):
        assert time.monotonic() < deadline, "aborted requests are still running after 60 s"
        time.sleep(0.5)
    for server in (pair.prefill, pair.decode):
        assert healthy(server), f"{server.name} is unhealthy after the aborts"
    # Each side held the aborted requests' blocks only while a WRITE could still touch them
    # (P's stream, D's wait for P's word): then every block is free again, none leaked.
    while held := [s.name for s in (pair.prefill, pair.decode) if kv_cache_usage(s) > 0]:
        assert time.monotonic() < deadline, f"{held} still hold KV blocks 60 s after the aborts"
        time.sleep(0.5)
    got = pair.complete(greedy_body(tiny_model, prompts[1000]))
    assert_same(1000, got, reference[1000])
