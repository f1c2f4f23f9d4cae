"""Smoke test of the ground kvpush's connector will stand on: stock vLLM, a P/D pair, real KV.

vLLM's own NIXL connector moves the whole prompt's KV from a prefill server (P) to a decode
server (D) on loopback. The test checks two things that fail when the KV is wrong or missing:

* D's greedy continuation equals that of a plain single server given the same prompt: the
  same token ids, and the same log-probabilities within 1e-3. The ids alone would not do:
  with the tiny model (``initializer_range=0.1``) zeroing any one block of the first layer
  changes the ids, but zeroing one block of the last layer of the 1000-token prompt does not;
  it moves a log-probability by 0.07 or more (checked with transformers on the same model);
* D computed no prompt token itself: its ``/metrics`` count every prompt token as cached from
  ``p2p``, with no local prefix-cache hit and no failed transfer.

The connector is the pull ``NixlConnector`` by default. Upstream's ``NixlPushConnector`` passes
too, but not reliably on this 2-core machine: P's handshake to D's side channel can time out
(5 s) when D's engine is starved, after which D waits for its registration timeout (480 s) with
no error (docs/vllm-cpu.md). ``KVPUSH_E2E_UPSTREAM_CONNECTOR=NixlPushConnector`` runs it anyway.

The single server runs after the pair has stopped, so at most two servers share the two cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpush_lab.servers import metric_value
from tests.e2e.harness import (
    PrefillEndpoint,
    VllmServer,
    completion_logprobs,
    completion_token_ids,
    pull_completion,
    push_completion,
    running,
)
from tests.e2e.pairs import (
    LOGPROB_TOLERANCE,
    MAX_TOKENS,
    PREFILL_ENGINE_ID,
    greedy_body,
    prompt_token_ids,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None,
        reason="vLLM/NIXL not installed: run scripts/setup-vllm VENV and use its python",
    ),
]

PROMPT_LENGTHS = (300, 1000)
CONNECTOR = os.environ.get("KVPUSH_E2E_UPSTREAM_CONNECTOR", "NixlConnector")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpush_lab.model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen3")


@pytest.fixture
def log_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "logs"
    yield path
    print(f"server logs: {path}")


def test_pair_matches_single_server(tiny_model: Path, log_dir: Path) -> None:
    started = time.monotonic()
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    prompts = [prompt_token_ids(n, vocab, seed=n) for n in PROMPT_LENGTHS]

    prefill = VllmServer(
        "prefill",
        tiny_model,
        log_dir,
        cpu="0",
        kv_transfer_config={
            "kv_connector": CONNECTOR,
            "kv_role": "kv_producer",
            "engine_id": PREFILL_ENGINE_ID,
            "kv_buffer_device": "cpu",
        },
    )
    decode = VllmServer(
        "decode",
        tiny_model,
        log_dir,
        cpu="1",
        kv_transfer_config={
            "kv_connector": CONNECTOR,
            "kv_role": "kv_consumer",
            "kv_buffer_device": "cpu",
        },
        extra_args=["--no-enable-prefix-caching"],
    )
    with running(prefill, decode):
        endpoint = PrefillEndpoint(prefill, PREFILL_ENGINE_ID)
        disaggregated = []
        for prompt in prompts:
            t0 = time.monotonic()
            body = greedy_body(tiny_model, prompt)
            if CONNECTOR == "NixlPushConnector":
                result = push_completion(endpoint, decode, body)
            else:
                result = pull_completion(prefill, decode, body)
            print(
                f"{len(prompt)} prompt tokens through P/D ({CONNECTOR}): "
                f"{time.monotonic() - t0:.2f} s (P leg {result.prefill_s:.2f} s, "
                f"D leg {result.decode_s:.2f} s)"
            )
            disaggregated.append(result.decode)
        d_metrics = decode.metrics()

    single = VllmServer("single", tiny_model, log_dir, cpu="0")
    with running(single):
        reference = [single.post("/v1/completions", greedy_body(tiny_model, p)) for p in prompts]

    prompt_tokens = metric_value(d_metrics, "vllm:prompt_tokens_total")
    from_p2p = metric_value(d_metrics, "vllm:prompt_tokens_cached_by_source_total", source="p2p")
    local_hits = metric_value(d_metrics, "vllm:prefix_cache_hits_total")
    failed = metric_value(d_metrics, "vllm:nixl_num_failed_transfers_total")
    print(
        f"D: prompt tokens {prompt_tokens:.0f}, from p2p {from_p2p:.0f}, local hits "
        f"{local_hits:.0f}, failed transfers {failed:.0f}; "
        f"P ready {prefill.ready_after_s:.0f} s, D {decode.ready_after_s:.0f} s, "
        f"single {single.ready_after_s:.0f} s; test {time.monotonic() - started:.0f} s"
    )

    for prompt, d_response, single_response in zip(prompts, disaggregated, reference, strict=True):
        got, want = completion_token_ids(d_response), completion_token_ids(single_response)
        got_lp, want_lp = completion_logprobs(d_response), completion_logprobs(single_response)
        print(f"{len(prompt)}-token prompt: D {got} {got_lp}\n{'':>19}single {want} {want_lp}")
        assert len(got) == MAX_TOKENS, f"{len(prompt)}-token prompt: D returned {got}"
        assert got == want, f"{len(prompt)}-token prompt: D {got} != single server {want}"
        assert got_lp == pytest.approx(want_lp, abs=LOGPROB_TOLERANCE), (
            f"{len(prompt)}-token prompt: D's log-probabilities differ from the single server's"
        )
    assert prompt_tokens == sum(PROMPT_LENGTHS)
    assert from_p2p == prompt_tokens, "D computed part of the prompt instead of receiving it"
    assert local_hits == 0
    assert failed == 0
