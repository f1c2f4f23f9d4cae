"""What the end-to-end modules share: prompts and request bodies, kvpush's connector config and
environment for a P/D pair, the pair behind a proxy, and the checks of its answers against a
single server's."""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import os
import random
import secrets
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvpush_lab.servers import HOST
from tests.e2e.harness import (
    VllmServer,
    completion_logprobs,
    completion_token_ids,
    running,
)

MAX_TOKENS = 8
#: Block sizes of P and D in tokens (``KVPUSH_E2E_BLOCKS=P,D``).
P_BLOCK, D_BLOCK = (int(x) for x in os.environ.get("KVPUSH_E2E_BLOCKS", "128,128").split(","))


def prompt_token_ids(length: int, vocab: int, seed: int) -> list[int]:
    """A prompt of random ordinary token ids (0-2 are the tokenizer's special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def greedy_body(model: Path, prompt: list[int]) -> dict[str, object]:
    return {
        "model": str(model),
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "skip_special_tokens": False,
        "return_token_ids": True,
        # The runner-up too: where D and the single server part, it tells a tie from an error.
        "logprobs": 2,
    }


LOGPROB_TOLERANCE = 1e-3


PREFILL_ENGINE_ID = "kvpush-e2e-prefill"


def kvpush_config(role: str, **extra: object) -> dict[str, object]:
    """kvpush's ``--kv-transfer-config`` for ``role``; ``extra``: its connector options."""
    return {
        "kv_connector": "KvPushConnector",
        "kv_connector_module_path": "kvpush.vllm",
        "kv_role": role,
        "kv_buffer_device": "cpu",
        **({"kv_connector_extra_config": extra} if extra else {}),
    }


def timelines_env(logs: Path, server: str) -> dict[str, str]:
    """Where a server's workers write their transfer timelines (``KVPUSH_TIMELINE_DIR``)."""
    return {"KVPUSH_TIMELINE_DIR": str(logs / "timelines" / server)}


def sends(logs: Path, server: str) -> list[dict[str, Any]]:
    """The send lines of a P server's timelines (one per request and P worker)."""
    lines = []
    for path in sorted((logs / "timelines" / server).glob("*.jsonl")):
        lines += [json.loads(line) for line in path.read_text().splitlines() if line]
    return [line for line in lines if line["role"] == "send"]


def assert_layers_streamed(logs: Path, server: str, at_least: int) -> None:
    """Layer-wise push on P: at least ``at_least`` sends wrote layers before P's scheduler
    saw their prefill end (posted during the forward), and never more than their bytes."""
    streamed = [line for line in sends(logs, server) if line["streamed_bytes"]]
    shares = [line["streamed_bytes"] / line["bytes"] for line in streamed]
    print(f"{server}: {len(streamed)} sends streamed layers, shares {shares}")
    assert len(streamed) >= at_least, f"{len(streamed)} sends streamed layers"
    for line in streamed:
        wall = line["wall"]
        assert line["streamed_bytes"] <= line["bytes"], line
        assert wall["streamed"] < wall["scheduled"], f"streamed after the prefill ended: {line}"


def kvpush_env(secret: str) -> dict[str, str]:
    """The shared secret where kvpush takes it: the environment (the connector refuses it in
    its config, which vLLM logs and every user can read on the command line)."""
    return {"KVPUSH_SECRET": secret}


class Pair:
    def __init__(self, prefill: VllmServer, decode: VllmServer, proxy: Any) -> None:
        self.prefill, self.decode, self.proxy = prefill, decode, proxy
        self.host, self.port = proxy.address

    def complete(self, body: dict[str, Any], timeout: float = 300.0) -> Any:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            connection.request(
                "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            response = connection.getresponse()
            payload = response.read()
            assert response.status == 200, f"proxy answered {response.status}: {payload!r}"
            return json.loads(payload)
        finally:
            connection.close()


@contextlib.contextmanager
def behind_proxy(
    prefill: VllmServer,
    decode: VllmServer,
    engine_id: str,
    *,
    tp: int = 1,
    timeout_s: float = 300.0,
) -> Iterator[Pair]:
    """Starts P (engine ``engine_id``, ``tp`` ranks) and D with ``kvpush proxy`` in front of
    them, and always stops all three."""
    from kvpush.router import PrefillInstance
    from kvpush.router.http import ProxyServer

    with running(prefill, decode, timeout_s=timeout_s):
        instance = PrefillInstance(prefill.url, engine_id, HOST, prefill.side_channel_port, tp=tp)
        proxy = ProxyServer(prefill=[instance], decode=[decode.url], host="127.0.0.1", port=0)
        proxy.start()
        try:
            yield Pair(prefill, decode, proxy)
        finally:
            proxy.stop()


def single_answers(
    single: VllmServer, model: Path, prompts: dict[int, list[int]]
) -> dict[int, Any]:
    """What a plain single server answers to each prompt (greedy), started and stopped here."""
    with running(single):
        return {
            n: single.post("/v1/completions", greedy_body(model, p)) for n, p in prompts.items()
        }


def kvpush_servers(
    model: Path,
    logs: Path,
    engine_id: str,
    *,
    names: tuple[str, str] = ("prefill", "decode"),
    blocks: tuple[int, int] = (P_BLOCK, D_BLOCK),
    layerwise: str = "off",
    prefill_args: Sequence[str] = (),
) -> tuple[VllmServer, VllmServer]:
    """P (engine ``engine_id``, core 0, layer-wise push as ``layerwise`` says, its timelines
    in ``logs``, ``prefill_args`` added to its command line) and D (core 1) with kvpush's
    connector and one fresh shared secret, D without prefix caching (so every prompt token must
    come from P)."""
    secret = secrets.token_hex(16)
    prefill = VllmServer(
        names[0],
        model,
        logs,
        cpu="0",
        kv_transfer_config={
            **kvpush_config("kv_producer", layerwise=layerwise),
            "engine_id": engine_id,
        },
        extra_env={**kvpush_env(secret), **timelines_env(logs, names[0])},
        extra_args=["--block-size", str(blocks[0]), *prefill_args],
    )
    decode = VllmServer(
        names[1],
        model,
        logs,
        cpu="1",
        kv_transfer_config=kvpush_config("kv_consumer"),
        extra_env=kvpush_env(secret),
        extra_args=["--no-enable-prefix-caching", "--block-size", str(blocks[1])],
    )
    return prefill, decode


def assert_same(n: int, got: Any, want: Any) -> None:
    """D's greedy continuation is the single server's: the same tokens with the same
    log-probabilities (a wrong or missing KV block moves them), up to a near tie.

    Where the two first differ, the single server's own runner-up must be D's token, within
    ``LOGPROB_TOLERANCE`` of its choice, and D must give it the same log-probability: two
    batches of other sizes round differently, and greedy decoding then parts at a tie (after
    which nothing can be compared). Any other difference fails."""
    ids, want_ids = completion_token_ids(got), completion_token_ids(want)
    lps, want_lps = completion_logprobs(got), completion_logprobs(want)
    assert len(ids) == len(want_ids), f"{n}-token prompt: D {ids} != single server {want_ids}"
    pairs = enumerate(zip(ids, want_ids, strict=True))
    same = next((i for i, (a, b) in pairs if a != b), len(want_ids))
    assert lps[:same] == pytest.approx(want_lps[:same], abs=LOGPROB_TOLERANCE), (
        f"{n}-token prompt: D's log-probabilities differ from the single server's"
    )
    if same == len(want_ids):
        return
    token = got["choices"][0]["logprobs"]["tokens"][same]
    runner_up = want["choices"][0]["logprobs"]["top_logprobs"][same].get(token)
    tie = (
        runner_up is not None
        and want_lps[same] - runner_up <= LOGPROB_TOLERANCE
        and abs(lps[same] - runner_up) <= LOGPROB_TOLERANCE
    )
    print(
        f"{n}-token prompt: D parts from the single server at token {same}: D {ids[same]} "
        f"({lps[same]:.6f}), single server {want_ids[same]} ({want_lps[same]:.6f}, gives D's "
        f"{runner_up})"
    )
    assert tie, f"{n}-token prompt: D {ids} != single server {want_ids}, not at a near tie"


def assert_sequential(
    pair: Pair, model: Path, prompts: dict[int, list[int]], reference: dict[int, Any],
    lengths: tuple[int, ...],
) -> None:  # fmt: skip
    """Each prompt of ``lengths`` through the pair, one at a time, equals the reference."""
    for n in lengths:
        started = time.monotonic()
        got = pair.complete(greedy_body(model, prompts[n]))
        print(f"{n} prompt tokens through kvpush: {time.monotonic() - started:.2f} s")
        assert_same(n, got, reference[n])


def assert_concurrent(
    pair: Pair, model: Path, prompts: dict[int, list[int]], reference: dict[int, Any],
    lengths: tuple[int, ...],
) -> None:  # fmt: skip
    """The prompts of ``lengths`` through the pair at once each equal the reference."""
    with concurrent.futures.ThreadPoolExecutor(len(lengths)) as pool:
        futures = {n: pool.submit(pair.complete, greedy_body(model, prompts[n])) for n in lengths}
        for n, future in futures.items():
            assert_same(n, future.result(), reference[n])
