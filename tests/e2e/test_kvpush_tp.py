"""Prefill and decode servers of different tensor parallel sizes: a real vLLM prefill server at
``--tensor-parallel-size 2`` (one core per rank, ``VLLM_CPU_OMP_THREADS_BIND="0|1"``) and a
decode server at 1, behind ``kvpush proxy``.

D's one worker receives each request's KV from both of P's workers (each holds half the KV
heads) and starts only once both delivered. Checked against a plain single server (size 1):

* D's greedy continuation: token ids, and log-probabilities within 1e-3 (a head missing or
  written into the wrong slab changes them far more);
* every prompt token came from P (``source="p2p"``), and both of P's workers sent their share;
* P streams by layer (``layerwise: "on"``): both of its workers wrote layers of their heads
  before the prefills ended.

vLLM's own pull connector hangs on this pair on this machine (its P workers stop in
``execute_model``); kvpush's earlier connector refused every such request. The single server
runs before the pair, so at most the pair shares the two cores.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpush_lab.servers import metric_value
from tests.e2e.harness import ON_VLLM, VllmServer
from tests.e2e.pairs import (
    Pair,
    assert_layers_streamed,
    assert_sequential,
    behind_proxy,
    kvpush_config,
    kvpush_env,
    prompt_token_ids,
    single_answers,
    timelines_env,
)

pytestmark = ON_VLLM

# Five requests, the first of 3 blocks, its last one partial (KVPUSH_E2E_TP_PROMPTS sets others).
PROMPTS = os.environ.get("KVPUSH_E2E_TP_PROMPTS", "300,1000,2100,600,1500")
SEQUENTIAL = tuple(int(n) for n in PROMPTS.split(","))
PREFILL_ENGINE_ID = "kvpush-e2e-prefill-tp2"
# P's two ranks spin on both cores through every all-reduce (vLLM CPU's shared-memory
# collectives) while D shares one of them. Under that sustained load this 2-vCPU VM leaves a
# runnable thread unscheduled for tens of seconds at a time (the guest kernel logs "workqueue
# lockup" for its own per-CPU workers; a P rank's WRITE then waits for its writer thread to be
# scheduled, docs/operations.md), past the defaults of 10-30 s.
# What these bound (a stuck WRITE, a dead peer, an abandoned request) is not under test here.
TIMEOUTS = {
    "write_timeout": 120.0,
    "peer_timeout": 60.0,
    "kv_lease_duration": 300.0,
    "receive_timeout": 300.0,
}
# CPU attention moves whole blocks, sliced by head: P and D share the block size.
BLOCK = "128"


def config(role: str, **extra: object) -> dict[str, object]:
    return kvpush_config(role, **TIMEOUTS, **extra)


@pytest.fixture(scope="module")
def prompts(tiny_model: Path) -> dict[int, list[int]]:
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    return {n: prompt_token_ids(n, vocab, seed=n) for n in SEQUENTIAL}


@pytest.fixture(scope="module")
def reference(tiny_model: Path, prompts: dict[int, list[int]], logs: Path) -> dict[int, Any]:
    """What a plain single server (tensor parallel size 1) answers, before the pair starts."""
    single = VllmServer("single", tiny_model, logs, cpu="0", extra_args=["--block-size", BLOCK])
    return single_answers(single, tiny_model, prompts)


@pytest.fixture(scope="module")
def pair(tiny_model: Path, logs: Path, reference: dict[int, Any]) -> Iterator[Pair]:
    secret = secrets.token_hex(16)
    prefill = VllmServer(
        "prefill-tp2",
        tiny_model,
        logs,
        cpu="0|1",
        kv_transfer_config={
            **config("kv_producer", layerwise="on"),
            "engine_id": PREFILL_ENGINE_ID,
        },
        extra_env={**kvpush_env(secret), **timelines_env(logs, "prefill-tp2")},
        extra_args=["--tensor-parallel-size", "2", "--block-size", BLOCK],
    )
    decode = VllmServer(
        "decode-tp1",
        tiny_model,
        logs,
        cpu="1",
        kv_transfer_config=config("kv_consumer"),
        extra_env=kvpush_env(secret),
        extra_args=["--no-enable-prefix-caching", "--block-size", BLOCK],
    )
    with behind_proxy(prefill, decode, PREFILL_ENGINE_ID, tp=2, timeout_s=420.0) as pair:
        yield pair


def test_sequential_requests_match_a_single_server(
    pair: Pair, tiny_model: Path, prompts: dict[int, list[int]], reference: dict[int, Any]
) -> None:
    assert_sequential(pair, tiny_model, prompts, reference, SEQUENTIAL)


def test_both_p_workers_streamed_layers_while_the_prefills_ran(pair: Pair, logs: Path) -> None:
    """P runs layer-wise push (``layerwise: "on"``): each of its workers streams its half of
    every layer's heads."""
    assert_layers_streamed(logs, pair.prefill.name, at_least=2)
    streaming = {
        path.name for path in (logs / "timelines" / pair.prefill.name).glob("*.jsonl")
        if any(json.loads(line)["streamed_bytes"] for line in path.read_text().splitlines())
    }  # fmt: skip
    assert len(streaming) == 2, f"only {sorted(streaming)} streamed"


def test_every_prompt_token_came_from_both_p_workers(pair: Pair) -> None:
    metrics = pair.decode.metrics()
    prompt_tokens = metric_value(metrics, "vllm:prompt_tokens_total")
    from_p2p = metric_value(metrics, "vllm:prompt_tokens_cached_by_source_total", source="p2p")
    print(f"D: prompt tokens {prompt_tokens:.0f}, from p2p {from_p2p:.0f}")
    assert prompt_tokens == sum(SEQUENTIAL)
    assert from_p2p == prompt_tokens, "D computed part of a prompt instead of receiving it"
    # D's one worker counts the bytes of every DONE: both P workers' halves of the heads.
    p_bytes = metric_value(pair.prefill.metrics(), "vllm:kvpush_bytes_sum")
    d_bytes = metric_value(metrics, "vllm:kvpush_bytes_sum")
    print(f"P sent {p_bytes:.0f} bytes, D received {d_bytes:.0f}")
    assert d_bytes > 0
    assert p_bytes == d_bytes, "what both P workers sent is what D's worker received"
