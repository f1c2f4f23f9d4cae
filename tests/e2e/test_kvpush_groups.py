"""Several KV cache groups on real vLLM servers: a tiny Gemma 3 whose layers alternate
sliding-window and full attention, which vLLM's hybrid KV cache manager keeps as two KV cache
groups (its log: ``kv cache group sizes (128, 128)``).

* D's greedy continuation equals a plain single server's (token ids, and log-probabilities
  within 1e-3) for prompts shorter and much longer than the sliding window, sequentially and
  concurrently;
* every prompt token reached D from P (``source="p2p"``);
* P wrote exactly the blocks the groups hold: every block of the prompt for the full-attention
  layers, and for the sliding-window layers only the blocks from the one holding the window's
  first token on (vLLM frees the others and lists its null block for them; D never allocates
  them). The bytes P reports are those counts times the layers times a block's bytes;
* P streams by layer (``layerwise: "on"``), each layer its own group's blocks: its timelines
  show layers written before the prefills ended, and the bytes above still hold;
* P computes a prompt in chunks of ``CHUNK`` tokens (vLLM frees the sliding-window group's
  blocks before the window between chunks) and streams it chunk by chunk: each chunk writes the
  full-attention layers' blocks, the sliding-window layers' only from the first block vLLM keeps
  until the prompt's end. What a chunk writes again (D's block holding the chunk before's last
  token) the timelines count apart, and the bytes above are those written once.

The model's window (200 tokens) is not a multiple of the block size (128), so the first block
kept is a partial one of the window.
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpush_lab.servers import metric_value
from tests.e2e.harness import ON_VLLM, VllmServer
from tests.e2e.pairs import (
    Pair,
    assert_layers_streamed,
    assert_same,
    behind_proxy,
    greedy_body,
    kvpush_servers,
    prompt_token_ids,
    sends,
    single_answers,
)

pytestmark = ON_VLLM

WINDOW = 200
BLOCK = 128
LAYERS = 4  # sliding-window, full, sliding-window, full
KV_HEADS, HEAD_DIM, FLOAT32 = 2, 64, 4
SEQUENTIAL = (150, 300, 1000, 2100)
CONCURRENT = (700, 900, 1300)
#: P's token budget per step: the longer prompts are computed in chunks.
CHUNK = 512
PREFILL_ENGINE_ID = "kvpush-e2e-groups-prefill"


def blocks_moved(prompt_tokens: int) -> tuple[int, int]:
    """(full-attention blocks, sliding-window blocks) of one prompt, as vLLM keeps them: the
    sliding-window group drops the blocks wholly before the window of the next token
    (``SlidingWindowManager.get_num_skipped_tokens``)."""
    full = -(-prompt_tokens // BLOCK)
    skipped = max(0, prompt_tokens - WINDOW + 1) // BLOCK
    return full, full - skipped


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpush_lab.model import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("model") / "tiny-gemma3",
        architecture="gemma3",
        layers=LAYERS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        sliding_window=WINDOW,
    )


@pytest.fixture(scope="module")
def prompts(tiny_model: Path) -> dict[int, list[int]]:
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    return {n: prompt_token_ids(n, vocab, seed=n) for n in SEQUENTIAL + CONCURRENT}


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("logs")
    yield path
    print(f"server logs: {path}")


@pytest.fixture(scope="module")
def reference(tiny_model: Path, prompts: dict[int, list[int]], logs: Path) -> dict[int, Any]:
    """What a plain single server answers, before the pair starts."""
    single = VllmServer("single", tiny_model, logs, cpu="0", extra_args=["--block-size", "128"])
    return single_answers(single, tiny_model, prompts)


@pytest.fixture(scope="module")
def pair(tiny_model: Path, logs: Path, reference: dict[int, Any]) -> Iterator[Pair]:
    prefill, decode = kvpush_servers(
        tiny_model,
        logs,
        PREFILL_ENGINE_ID,
        blocks=(BLOCK, BLOCK),
        layerwise="on",
        prefill_args=["--max-num-batched-tokens", str(CHUNK)],
    )
    with behind_proxy(prefill, decode, PREFILL_ENGINE_ID) as pair:
        yield pair


def test_vllm_keeps_the_model_as_two_kv_cache_groups(pair: Pair) -> None:
    for server in (pair.prefill, pair.decode):
        log = server.log_path.read_text(errors="replace")
        assert "kv cache group sizes (128, 128)" in log, f"{server.name}: not two groups"


def test_sequential_requests_match_a_single_server(
    pair: Pair, tiny_model: Path, prompts: dict[int, list[int]], reference: dict[int, Any]
) -> None:
    for n in SEQUENTIAL:
        assert_same(n, pair.complete(greedy_body(tiny_model, prompts[n])), reference[n])


def test_concurrent_requests_match_a_single_server(
    pair: Pair, tiny_model: Path, prompts: dict[int, list[int]], reference: dict[int, Any]
) -> None:
    with concurrent.futures.ThreadPoolExecutor(len(CONCURRENT)) as pool:
        futures = {
            n: pool.submit(pair.complete, greedy_body(tiny_model, prompts[n])) for n in CONCURRENT
        }
        for n, future in futures.items():
            assert_same(n, future.result(), reference[n])


def test_p_streamed_layers_while_its_prefills_ran(pair: Pair, logs: Path) -> None:
    assert_layers_streamed(logs, pair.prefill.name, at_least=1)


def test_every_prompt_token_came_from_p_in_exactly_the_groups_blocks(
    pair: Pair, logs: Path
) -> None:
    metrics = pair.decode.metrics()
    prompt_tokens = metric_value(metrics, "vllm:prompt_tokens_total")
    from_p2p = metric_value(metrics, "vllm:prompt_tokens_cached_by_source_total", source="p2p")
    print(f"D: prompt tokens {prompt_tokens:.0f}, from p2p {from_p2p:.0f}")
    assert prompt_tokens == sum(SEQUENTIAL) + sum(CONCURRENT)
    assert from_p2p == prompt_tokens, "D computed part of a prompt instead of receiving it"

    block_bytes = KV_HEADS * BLOCK * 2 * HEAD_DIM * FLOAT32  # K and V of one layer's block
    full_layers = sliding_layers = LAYERS // 2
    expected = sum(
        (full * full_layers + sliding * sliding_layers) * block_bytes
        for full, sliding in map(blocks_moved, SEQUENTIAL + CONCURRENT)
    )
    every_block = sum(blocks_moved(n)[0] * LAYERS * block_bytes for n in SEQUENTIAL + CONCURRENT)
    lines = sends(logs, pair.prefill.name)
    sent = metric_value(pair.prefill.metrics(), "vllm:kvpush_bytes_sum")
    assert sent == sum(line["bytes"] for line in lines), "P's metrics and timelines disagree"
    again = sum(line["rewritten_bytes"] for line in lines)
    print(
        f"P wrote {sent:.0f} bytes, {again} of them again; the groups' blocks {expected}; "
        f"every block {every_block}"
    )
    assert sent - again == expected
    assert metric_value(pair.decode.metrics(), "vllm:kvpush_failures_total") == 0
    # The prompts longer than a chunk streamed chunk by chunk (a chunk's edge block went
    # twice); which of them did depends on when D's registration reached P.
    assert again > 0, "no prompt streamed chunk by chunk"
    # A prompt computed beside others may start and end in a step's leftover budget: one
    # chunk more than its length needs, so at most ceil(n / CHUNK) chunk ends.
    bound = sum(-(-n // CHUNK) * LAYERS * block_bytes for n in SEQUENTIAL + CONCURRENT)
    assert again <= bound, "more than one block per layer and chunk end was written again"
