"""The fence on real vLLM servers: P killed mid-request, and two D servers behind one P that
share an engine id.

* ``kv_load_failure_policy: recompute``: SIGKILL P while D waits for the KV; D gives up on P only
  once P's write horizon has passed (nothing of P's can land any more), prefills itself, and
  answers exactly what a single server answers.
* ``kv_load_failure_policy: fail``: the same kill; the client gets an HTTP error within the
  horizon (plus D's silence timeout and slack), and D keeps serving.
* Two D replicas with one engine id (as a rolling restart or a copy-pasted config makes them)
  each receive only their own KV: agent names are unique per process, and P counts DONEs and
  registrations per agent. A request whose kv_transfer_params lack P's coordinates is
  prefilled locally, and the engine keeps serving.

Both legs go straight to the servers (``tests.e2e.harness.push_completion``'s shape), not
through ``kvpush proxy``, which aborts D's leg when P's fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from kvpush.router import PrefillInstance, decode_body, prefill_body
from tests.e2e.harness import (
    ON_VLLM,
    PrefillEndpoint,
    VllmServer,
    completion_token_ids,
    push_completion,
    running,
)
from tests.e2e.pairs import greedy_body, kvpush_config, kvpush_env, prompt_token_ids

pytestmark = ON_VLLM

PREFILL_ENGINE_ID = "kvpush-e2e-faults-prefill"
PEER_TIMEOUT = 2.0
WRITE_TIMEOUT = 2.0
# P's advertised horizon on a loopback device: lease (peer timeout) + write timeout + margin.
HORIZON = PEER_TIMEOUT + WRITE_TIMEOUT + 1.0
# The client's error (policy fail) is due once D noticed P is gone and waited out the horizon;
# the rest is slack for a loaded 2-core machine (a step, the HTTP answer).
FAIL_DEADLINE = PEER_TIMEOUT + HORIZON + 10.0
PROMPTS = (1500, 700, 900)


def config(role: str, **extra: Any) -> dict[str, object]:
    """``test_kvpush_pair``'s connector config with short timeouts (a horizon of seconds)."""
    base = kvpush_config(role)
    timeouts = {
        "peer_timeout": PEER_TIMEOUT,
        "heartbeat_interval": 0.4,
        "write_timeout": WRITE_TIMEOUT,
    }
    return {**base, "kv_connector_extra_config": timeouts, **extra}


@pytest.fixture(scope="module")
def prompts(tiny_model: Path) -> dict[int, list[int]]:
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    return {n: prompt_token_ids(n, vocab, seed=n + 7) for n in PROMPTS}


@pytest.fixture(scope="module")
def reference(tiny_model: Path, prompts: dict[int, list[int]], logs: Path) -> dict[int, list[int]]:
    single = VllmServer("single-faults", tiny_model, logs, cpu="0")
    with running(single):
        return {
            n: completion_token_ids(single.post("/v1/completions", greedy_body(tiny_model, p)))
            for n, p in prompts.items()
        }


def start_prefill_leg(prefill: VllmServer, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Sends P's leg (in the background: P is killed under it) and returns the request id and
    D's leg's body, which names P as the push proxy would."""
    request_id, transfer_id = str(uuid.uuid4()), f"xfer-{uuid.uuid4()}"
    instance = PrefillInstance(
        prefill.url, PREFILL_ENGINE_ID, "127.0.0.1", prefill.side_channel_port
    )
    d_body = {**decode_body(body, instance, request_id, transfer_id), "stream": False}
    p_body = {**prefill_body(body, transfer_id), "stream": False}

    def p_leg() -> None:
        with contextlib.suppress(BaseException):  # P's leg dies with P: that is the test
            prefill.post("/v1/completions", p_body, headers={"X-Request-Id": request_id})

    threading.Thread(target=p_leg, daemon=True).start()
    return request_id, d_body


def kill_process_group(server: VllmServer) -> None:
    assert server.process is not None
    os.killpg(server.process.pid, signal.SIGKILL)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_p_killed_mid_request(
    policy: str,
    tiny_model: Path,
    logs: Path,
    prompts: dict[int, list[int]],
    reference: dict[int, list[int]],
) -> None:
    secret = secrets.token_hex(16)
    prefill = VllmServer(
        f"prefill-{policy}",
        tiny_model,
        logs,
        cpu="0",
        kv_transfer_config={**config("kv_producer"), "engine_id": PREFILL_ENGINE_ID},
        extra_env=kvpush_env(secret),
    )
    decode = VllmServer(
        f"decode-{policy}",
        tiny_model,
        logs,
        cpu="1",
        kv_transfer_config=config("kv_consumer", kv_load_failure_policy=policy),
        extra_env=kvpush_env(secret),
        extra_args=["--no-enable-prefix-caching"],
    )
    with running(prefill, decode):
        body = greedy_body(tiny_model, prompts[1500])
        request_id, d_body = start_prefill_leg(prefill, body)
        outcome: dict[str, Any] = {}

        def d_leg() -> None:
            started = time.monotonic()
            try:
                outcome["answer"] = decode.post(
                    "/v1/completions", d_body, headers={"X-Request-Id": request_id}
                )
            except BaseException as error:
                outcome["error"] = error
            outcome["seconds"] = time.monotonic() - started

        leg = threading.Thread(target=d_leg, daemon=True)
        leg.start()
        time.sleep(0.3)  # D has registered; P is computing the prefill
        kill_process_group(prefill)
        killed = time.monotonic()
        leg.join(timeout=120.0)
        assert not leg.is_alive(), "D's leg never answered after P was killed"
        waited = time.monotonic() - killed
        got = "an answer" if "answer" in outcome else f"an error ({outcome.get('error')})"
        print(f"policy {policy}: D gave {got} {waited:.1f}s after P was killed")
        if policy == "recompute":
            assert "answer" in outcome, f"D failed instead of recomputing: {outcome}"
            assert completion_token_ids(outcome["answer"]) == reference[1500]
        else:
            assert "error" in outcome, f"D answered although its KV never came: {outcome}"
            assert waited <= FAIL_DEADLINE, f"the error took {waited:.1f}s (> {FAIL_DEADLINE}s)"
        # D keeps serving: a plain request (no remote prefill) still works.
        plain = decode.post("/v1/completions", greedy_body(tiny_model, prompts[700]))
        assert completion_token_ids(plain) == reference[700]


def test_two_d_replicas_sharing_an_engine_id_each_get_their_own_kv(
    tiny_model: Path, logs: Path, prompts: dict[int, list[int]], reference: dict[int, list[int]]
) -> None:
    secret = secrets.token_hex(16)
    shared_id = "kvpush-e2e-decode-replica"
    prefill = VllmServer(
        "prefill-replicas",
        tiny_model,
        logs,
        cpu="0",
        kv_transfer_config={**config("kv_producer"), "engine_id": PREFILL_ENGINE_ID},
        extra_env=kvpush_env(secret),
    )
    replicas = [
        VllmServer(
            f"decode-replica-{i}",
            tiny_model,
            logs,
            cpu="1",
            kv_transfer_config={**config("kv_consumer"), "engine_id": shared_id},
            extra_env=kvpush_env(secret),
            extra_args=["--no-enable-prefix-caching"],
        )
        for i in range(2)
    ]
    with running(prefill, *replicas):
        endpoint = PrefillEndpoint(prefill, PREFILL_ENGINE_ID)
        results: dict[int, Any] = {}

        def one(replica: VllmServer, n: int) -> None:
            results[n] = push_completion(endpoint, replica, greedy_body(tiny_model, prompts[n]))

        threads = [
            threading.Thread(target=one, args=(replicas[0], 700)),
            threading.Thread(target=one, args=(replicas[1], 900)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300.0)
        for n in (700, 900):
            assert completion_token_ids(results[n].decode) == reference[n], (
                f"the replica that asked for the {n}-token prompt got another request's KV"
            )
        # A router that forwards P's answer as is (llm-d's first, serial request) sends
        # do_remote_prefill without P's coordinates: that request is prefilled locally, and
        # the engine keeps serving (it used to die inside the scheduler's step).
        broken = {
            **greedy_body(tiny_model, prompts[700]),
            "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False},
        }
        answer = replicas[0].post("/v1/completions", broken)
        assert completion_token_ids(answer) == reference[700]
        again = push_completion(endpoint, replicas[0], greedy_body(tiny_model, prompts[900]))
        assert completion_token_ids(again.decode) == reference[900]
