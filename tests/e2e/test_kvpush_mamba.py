"""A hybrid Mamba/attention model on real vLLM servers: a tiny NemotronH (a Mamba-2 layer, an
attention layer, an MLP layer), which vLLM's hybrid KV cache manager keeps as a Mamba group
(one SSM state per request) and an attention group.

* vLLM's CPU build serves the model on its own (``--no-enable-prefix-caching``: Mamba's prefix
  caching checkpoints fail on this build), so what follows is kvpush's doing;
* a server with kvpush's connector refuses to start, and says why (Mamba/SSM state layers):
  kvpush moves per-token KV blocks of one block size, and a Mamba group is neither. No request
  ever reaches a connector that would fail it.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import ON_VLLM, VllmServer, completion_token_ids, running
from tests.e2e.pairs import MAX_TOKENS, greedy_body, kvpush_config, kvpush_env, prompt_token_ids

pytestmark = ON_VLLM

SERVER_ARGS = ["--no-enable-prefix-caching", "--block-size", "128"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpush_lab.model import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("model") / "tiny-nemotron-h", architecture="nemotron_h", layers=3
    )


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("logs")
    yield path
    print(f"server logs: {path}")


def test_vllm_serves_the_hybrid_model_on_its_own(tiny_model: Path, logs: Path) -> None:
    single = VllmServer("single", tiny_model, logs, cpu="0", extra_args=SERVER_ARGS)
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    with running(single):
        answer = single.post(
            "/v1/completions", greedy_body(tiny_model, prompt_token_ids(300, vocab, seed=300))
        )
    assert len(completion_token_ids(answer)) == MAX_TOKENS
    sizes = re.search(r"kv cache group sizes \(([^)]*)\)", single.log_text())
    assert sizes is not None, "vLLM did not log its KV cache groups"
    assert len(sizes.group(1).split(",")) == 2, f"not a Mamba and an attention group: {sizes[0]}"


@pytest.fixture(scope="module")
def refused(tiny_model: Path, logs: Path) -> dict[str, VllmServer]:
    """A P and a D server with kvpush's connector, started together (a core each) and waited
    for until both exited (neither may start), by role."""
    secret = secrets.token_hex(16)
    servers = {
        role: VllmServer(
            f"refused-{role}",
            tiny_model,
            logs,
            cpu=cpu,
            kv_transfer_config={**kvpush_config(role), "engine_id": role},
            extra_env=kvpush_env(secret),
            extra_args=SERVER_ARGS,
        )
        for role, cpu in (("kv_producer", "0"), ("kv_consumer", "1"))
    }
    with pytest.raises(RuntimeError, match="exited"), running(*servers.values(), timeout_s=240):
        pass
    return servers


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_kvpush_refuses_mamba_state_at_startup_with_the_reason(
    refused: dict[str, VllmServer], role: str
) -> None:
    server = refused[role]
    assert server.ready_after_s is None, f"{server.name} started"
    log = server.log_text()
    assert "LayoutError" in log, server.log_tail()
    assert "Mamba/SSM state layers" in log, server.log_tail()
