"""kvpush's connector in real vLLM servers: a prefill server (P) and a decode server (D) on
loopback, driven the way vLLM's push router drives them (both legs at once, one transfer_id).

D's greedy continuation must equal a plain single server's (token ids, and log-probabilities
within 1e-3, which catches a wrong block even where the ids do not: see
``test_upstream_smoke.py``), and D's metrics must show that every prompt token came from P.

vLLM's CPU attention keeps K transposed inside a block, so its blocks move whole and P and D
need the same block size there (``KVPUSH_E2E_BLOCKS=P,D`` overrides; the planner's block-size
translation is covered by the unit, property and two-process tests).
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import (
    PrefillEndpoint,
    VllmServer,
    completion_logprobs,
    completion_token_ids,
    metric_value,
    push_completion,
    running,
)
from tests.e2e.test_upstream_smoke import greedy_body, prompt_token_ids

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM not installed: run scripts/setup-vllm VENV and use its python",
    ),
]

PROMPT_LENGTHS = (300, 1000, 2100)
P_BLOCK, D_BLOCK = (int(x) for x in os.environ.get("KVPUSH_E2E_BLOCKS", "128,128").split(","))
LOGPROB_TOLERANCE = 1e-3
PREFILL_ENGINE_ID = "kvpush-e2e-prefill"
SECRET = "kvpush-e2e-shared-secret"


def kvpush_config(role: str, **extra: object) -> dict[str, object]:
    return {
        "kv_connector": "KvPushConnector",
        "kv_connector_module_path": "kvpush.vllm",
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"secret": SECRET, **extra},
    }


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpush.model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen3")


@pytest.fixture
def log_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "logs"
    yield path
    print(f"server logs: {path}")


def test_kvpush_pair_matches_single_server(tiny_model: Path, log_dir: Path) -> None:
    started = time.monotonic()
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    prompts = [prompt_token_ids(n, vocab, seed=n) for n in PROMPT_LENGTHS]

    prefill = VllmServer(
        "prefill",
        tiny_model,
        log_dir,
        cpu="0",
        kv_transfer_config={**kvpush_config("kv_producer"), "engine_id": PREFILL_ENGINE_ID},
        extra_args=["--block-size", str(P_BLOCK)],
    )
    decode = VllmServer(
        "decode",
        tiny_model,
        log_dir,
        cpu="1",
        kv_transfer_config=kvpush_config("kv_consumer"),
        extra_args=["--no-enable-prefix-caching", "--block-size", str(D_BLOCK)],
    )
    with running(prefill, decode):
        endpoint = PrefillEndpoint(prefill, PREFILL_ENGINE_ID)
        disaggregated = []
        for prompt in prompts:
            t0 = time.monotonic()
            result = push_completion(endpoint, decode, greedy_body(tiny_model, prompt))
            print(
                f"{len(prompt)} prompt tokens through kvpush P/D: {time.monotonic() - t0:.2f} s "
                f"(P leg {result.prefill_s:.2f} s, D leg {result.decode_s:.2f} s)"
            )
            disaggregated.append(result.decode)
        d_metrics = decode.metrics()

    single = VllmServer("single", tiny_model, log_dir, cpu="0")
    with running(single):
        reference = [single.post("/v1/completions", greedy_body(tiny_model, p)) for p in prompts]

    prompt_tokens = metric_value(d_metrics, "vllm:prompt_tokens_total")
    from_p2p = metric_value(d_metrics, "vllm:prompt_tokens_cached_by_source_total", source="p2p")
    print(
        f"D: prompt tokens {prompt_tokens:.0f}, from p2p {from_p2p:.0f}; "
        f"test {time.monotonic() - started:.0f} s"
    )
    for prompt, d_response, single_response in zip(prompts, disaggregated, reference, strict=True):
        got, want = completion_token_ids(d_response), completion_token_ids(single_response)
        got_lp, want_lp = completion_logprobs(d_response), completion_logprobs(single_response)
        print(f"{len(prompt)}-token prompt: D {got}\n{'':>19}single {want}")
        assert got == want, f"{len(prompt)}-token prompt: D {got} != single server {want}"
        assert got_lp == pytest.approx(want_lp, abs=LOGPROB_TOLERANCE)
    assert prompt_tokens == sum(PROMPT_LENGTHS)
    assert from_p2p == prompt_tokens, "D computed part of the prompt instead of receiving it"
