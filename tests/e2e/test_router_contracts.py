"""kvpush driven, unchanged, by two third-party push routers' contracts on real vLLM servers.

The routers are small re-implementations of their documented behaviour (``routers.py``):

* vLLM's push demo proxy: P's coordinates configured up front, both legs at once;
* llm-d's push dispatch: nothing configured, P's identity learned from its first (serial)
  answer's kv_transfer_params, later requests in parallel with ``transfer_id = xfer-<uuid>``.

Through each, greedy completions equal a plain single server's (token ids, and
log-probabilities within 1e-3), sequentially and concurrently, and every prompt token reaches D
from P (D's ``source="p2p"`` prompt-token counter).

A router's bad kv_transfer_params fail alone: sent straight to D with ``do_remote_prefill`` and
no, malformed or contradictory coordinates (``Infinity`` as a port or TP size included, which
once killed D's engine; or kv_transfer_params that are not an object), each
request gets either the single server's answer from a local prefill (vLLM's contract lets a
connector match nothing) or an HTTP error of its own, while a good disaggregated request runs
beside them; afterwards D still serves disaggregated requests, answers ``/health``, and its log
shows no engine death.

One P/D pair (``test_kvpush_pair``'s options) serves the whole module, after the single server.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvpush_lab.servers import HOST, free_port, metric_value
from tests.e2e.harness import ON_VLLM, VllmServer, running
from tests.e2e.pairs import (
    assert_same,
    greedy_body,
    kvpush_servers,
    prompt_token_ids,
    single_answers,
)
from tests.e2e.routers import (
    JSON,
    LegError,
    LlmdPushDispatch,
    Routed,
    VllmPushDemoProxy,
)

pytestmark = ON_VLLM

PREFILL_ENGINE_ID = "kvpush-e2e-router-prefill"
DEMO_SEQUENTIAL = (300, 1000, 2100)
DEMO_CONCURRENT = (500, 700, 900)
LLMD_FIRST = 1100
LLMD_CONCURRENT = (400, 600, 800, 1200)
LLMD_LATER = 1500
BAD = 650  # the prompt of every bad request (D has no prefix cache: each prefills afresh)
BESIDE = 1700  # the good request sent beside the bad ones
AFTER = 1300  # the good request after them
#: Lines in a server's log that mean its engine died.
ENGINE_DEATH = ("EngineCore encountered a fatal error", "EngineDeadError")
TIMEOUT = aiohttp.ClientTimeout(total=300)


@pytest.fixture(scope="module")
def prompts(tiny_model: Path) -> dict[int, list[int]]:
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    lengths = (
        *DEMO_SEQUENTIAL, *DEMO_CONCURRENT, LLMD_FIRST, *LLMD_CONCURRENT, LLMD_LATER,
        BAD, BESIDE, AFTER,
    )  # fmt: skip
    assert len(set(lengths)) == len(lengths), "the reference is keyed by prompt length"
    return {n: prompt_token_ids(n, vocab, seed=n + 11) for n in lengths}


@pytest.fixture(scope="module")
def reference(tiny_model: Path, prompts: dict[int, list[int]], logs: Path) -> dict[int, Any]:
    """What a plain single server answers, before the pair starts."""
    single = VllmServer("single-routers", tiny_model, logs, cpu="0")
    return single_answers(single, tiny_model, prompts)


@dataclass(frozen=True)
class Pair:
    prefill: VllmServer
    decode: VllmServer

    def demo_proxy(self, *, tp_size: int = 1) -> VllmPushDemoProxy:
        return VllmPushDemoProxy(
            self.prefill.url,
            self.decode.url,
            prefill_engine_id=PREFILL_ENGINE_ID,
            prefill_kv_host=HOST,
            prefill_side_channel_port=self.prefill.side_channel_port,
            prefill_tp_size=tp_size,
        )


@pytest.fixture(scope="module")
def pair(tiny_model: Path, logs: Path, reference: dict[int, Any]) -> Iterator[Pair]:
    """P and D as ``test_kvpush_pair`` starts them, with no router of kvpush's in front."""
    prefill, decode = kvpush_servers(
        tiny_model, logs, PREFILL_ENGINE_ID, names=("prefill-routers", "decode-routers")
    )
    with running(prefill, decode):
        yield Pair(prefill, decode)


class PromptTokens:
    """D's prompt tokens since this was made: all of them, and those that came from P."""

    def __init__(self, decode: VllmServer) -> None:
        self._decode = decode
        self._start = self._now()

    def _now(self) -> tuple[float, float]:
        metrics = self._decode.metrics()
        return (
            metric_value(metrics, "vllm:prompt_tokens_total"),
            metric_value(metrics, "vllm:prompt_tokens_cached_by_source_total", source="p2p"),
        )

    def since(self) -> tuple[float, float]:
        total, p2p = self._now()
        return total - self._start[0], p2p - self._start[1]


def assert_all_from_p(tokens: PromptTokens, lengths: list[int]) -> None:
    total, p2p = tokens.since()
    print(f"D: prompt tokens {total:.0f}, from p2p {p2p:.0f}")
    assert total == sum(lengths), f"D saw {total:.0f} prompt tokens, not {sum(lengths)}"
    assert p2p == total, "D computed part of a prompt instead of receiving it from P"


async def through(
    router: VllmPushDemoProxy | LlmdPushDispatch,
    session: aiohttp.ClientSession,
    model: Path,
    prompts: dict[int, list[int]],
    lengths: tuple[int, ...],
) -> dict[int, Routed]:
    """The prompts of ``lengths`` through ``router`` at once."""
    routed = await asyncio.gather(
        *(router.complete(session, greedy_body(model, prompts[n])) for n in lengths)
    )
    return dict(zip(lengths, routed, strict=True))


def test_vllm_push_demo_proxy_drives_kvpush(
    pair: Pair, tiny_model: Path, prompts: dict[int, list[int]], reference: dict[int, Any]
) -> None:
    router = pair.demo_proxy()
    tokens = PromptTokens(pair.decode)

    async def requests() -> dict[int, Routed]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            answers = {}
            for n in DEMO_SEQUENTIAL:
                started = time.monotonic()
                answers[n] = await router.complete(session, greedy_body(tiny_model, prompts[n]))
                print(
                    f"{n} prompt tokens through the demo proxy: {time.monotonic() - started:.2f} s"
                )
            answers |= await through(router, session, tiny_model, prompts, DEMO_CONCURRENT)
            return answers

    for n, routed in asyncio.run(requests()).items():
        assert_same(n, routed.decode, reference[n])
    assert_all_from_p(tokens, [*DEMO_SEQUENTIAL, *DEMO_CONCURRENT])


def test_llmd_push_dispatch_learns_p_from_its_answer(
    pair: Pair, tiny_model: Path, prompts: dict[int, list[int]], reference: dict[int, Any]
) -> None:
    router = LlmdPushDispatch(pair.prefill.url, pair.decode.url)
    tokens = PromptTokens(pair.decode)

    async def requests() -> dict[int, Routed]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            first = await router.complete(session, greedy_body(tiny_model, prompts[LLMD_FIRST]))
            answers = {LLMD_FIRST: first}
            answers |= await through(router, session, tiny_model, prompts, LLMD_CONCURRENT)
            answers |= await through(router, session, tiny_model, prompts, (LLMD_LATER,))
            return answers

    answers = asyncio.run(requests())
    # P's answer named P completely, so only the first request went serially.
    assert router.identities == {
        pair.prefill.url: {
            "remote_engine_id": PREFILL_ENGINE_ID,
            "remote_host": HOST,
            "remote_port": pair.prefill.side_channel_port,
            "tp_size": 1,
            "pp_size": 1,
            "transfer_mode": "push",
        }
    }
    assert answers[LLMD_FIRST].mode == "serial"
    assert dict(router.dispatches) == {"serial": 1, "parallel": len(LLMD_CONCURRENT) + 1}
    first_params = answers[LLMD_FIRST].prefill["kv_transfer_params"]
    assert first_params["transfer_id"] == answers[LLMD_FIRST].transfer_id
    for n, routed in answers.items():
        assert routed.transfer_id.startswith("xfer-")
        assert_same(n, routed.decode, reference[n])
    assert_all_from_p(tokens, [LLMD_FIRST, *LLMD_CONCURRENT, LLMD_LATER])


def remote_prefill(**fields: Any) -> JSON:
    """D-leg kv_transfer_params naming P's real side channel, with ``fields`` on top."""
    return {"do_remote_prefill": True, "do_remote_decode": False, **fields}


#: (what is wrong, D's kv_transfer_params, what D's log says about it). Each of these is
#: prefilled by D itself: ``{port}`` is P's real side-channel port.
LOCAL_PREFILL_CASES: tuple[tuple[str, JSON, str], ...] = (
    (
        "no P coordinates (P's bare answer forwarded)",
        remote_prefill(transfer_mode="push", transfer_id="xfer-bare"),
        "lack remote_host, remote_port",
    ),
    (
        "null coordinates",
        remote_prefill(remote_engine_id=None, remote_host=None, remote_port=None),
        "lack remote_host, remote_port",
    ),
    (
        "remote_port 'abc'",
        remote_prefill(remote_host=HOST, remote_port="abc"),
        "remote_port must be an integer",
    ),
    ("tp_size 0", remote_prefill(remote_host=HOST, remote_port="{port}", tp_size=0), "tp_size 0"),
    (
        "tp_size 'two'",
        remote_prefill(remote_host=HOST, remote_port="{port}", tp_size="two"),
        "tp_size must be an integer",
    ),
    ("pp_size 2", remote_prefill(remote_host=HOST, remote_port="{port}", pp_size=2), "pp_size 2"),
    ("remote_port 70000", remote_prefill(remote_host=HOST, remote_port=70_000), "TCP port"),
    ("remote_host a list", remote_prefill(remote_host=[HOST], remote_port="{port}"), "host name"),
    # The two that killed D's EngineCore (an OverflowError inside vLLM's scheduler): Infinity is
    # valid JSON to Python's parser, and straight_to_d sends it as that text.
    (
        "remote_port Infinity",
        remote_prefill(remote_host=HOST, remote_port=math.inf),
        "remote_port must be an integer, not inf (float)",
    ),
    (
        "tp_size Infinity",
        remote_prefill(remote_host=HOST, remote_port="{port}", tp_size=math.inf),
        "tp_size must be an integer, not inf (float)",
    ),
)
#: kv_transfer_params vLLM itself refuses (its request model wants an object).
REFUSED_CASES: tuple[tuple[str, Any], ...] = (
    ("a string", "do_remote_prefill"),
    ("a list", [remote_prefill(remote_host=HOST, remote_port=5600)]),
    ("a number", 1),
)
FALLBACK_LINE = "prefilling it locally instead"
RECEIVE_FAILED_LINE = "not received: "


def with_port(params: JSON, port: int) -> JSON:
    return {k: port if v == "{port}" else v for k, v in params.items()}


async def straight_to_d(session: aiohttp.ClientSession, decode: VllmServer, body: JSON) -> Any:
    """D's answer to ``body``, or the :class:`LegError` it answered with. The body goes as the
    JSON text Python writes, ``Infinity`` and ``NaN`` included (any client can send them, and
    vLLM's parser reads them)."""
    text = json.dumps(body, allow_nan=True)
    headers = {"Content-Type": "application/json"}
    async with session.post(f"{decode.url}/v1/completions", data=text, headers=headers) as answer:
        payload = await answer.text()
        if answer.status != 200:
            return LegError(decode.url, answer.status, payload)
        return json.loads(payload)


def test_bad_router_params_fail_alone_and_d_keeps_serving(
    pair: Pair, tiny_model: Path, prompts: dict[int, list[int]], reference: dict[int, Any]
) -> None:
    decode = pair.decode
    body = greedy_body(tiny_model, prompts[BAD])
    port = pair.prefill.side_channel_port
    bad = [
        {**body, "kv_transfer_params": with_port(params, port)}
        for _, params, _ in LOCAL_PREFILL_CASES
    ] + [{**body, "kv_transfer_params": params} for _, params in REFUSED_CASES]
    fallbacks_before = decode.log_text().count(FALLBACK_LINE)
    tokens = PromptTokens(decode)

    async def beside_a_good_one() -> tuple[list[Any], Routed]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            good = pair.demo_proxy().complete(session, greedy_body(tiny_model, prompts[BESIDE]))
            *answers, routed = await asyncio.gather(
                *(straight_to_d(session, decode, b) for b in bad), good
            )
            return answers, routed

    answers, routed = asyncio.run(beside_a_good_one())
    assert_same(BESIDE, routed.decode, reference[BESIDE])
    local = answers[: len(LOCAL_PREFILL_CASES)]
    for (what, _, _), answer in zip(LOCAL_PREFILL_CASES, local, strict=True):
        assert not isinstance(answer, LegError), f"{what}: D refused the request: {answer}"
        assert_same(BAD, answer, reference[BAD])
    for (what, _), answer in zip(REFUSED_CASES, answers[len(local) :], strict=True):
        assert isinstance(answer, LegError), f"{what}: D answered {answer}"
        assert answer.status in (400, 422), f"kv_transfer_params {what}: {answer}"
        assert "kv_transfer_params" in answer.text, f"{what}: the error does not name the field"
    # D prefilled each locally-served request itself, and said why in its log.
    total, p2p = tokens.since()
    assert p2p == BESIDE, f"{p2p:.0f} prompt tokens came from P, not only the good request's"
    assert total == BESIDE + BAD * len(LOCAL_PREFILL_CASES)
    log = decode.log_text()
    assert log.count(FALLBACK_LINE) - fallbacks_before == len(LOCAL_PREFILL_CASES)
    for what, _, reason in LOCAL_PREFILL_CASES:
        assert reason in log, f"{what}: D's log does not say {reason!r}"
    assert_still_serving(pair, tiny_model, prompts, reference)


def test_coordinates_contradicting_p_fail_that_request_only(
    pair: Pair, tiny_model: Path, prompts: dict[int, list[int]], reference: dict[int, Any]
) -> None:
    """Coordinates that parse but contradict P: a TP size P does not have (D would expect
    writes from a rank that does not exist), and a side-channel port nobody listens on. Each
    request gets an answer equal to the single server's or an error; nothing else is hurt."""
    closed = free_port()  # nobody listens there
    body = greedy_body(tiny_model, prompts[BAD])
    nobody = {
        **body,
        "kv_transfer_params": remote_prefill(
            remote_engine_id="nobody", remote_host=HOST, remote_port=closed, tp_size=1,
            pp_size=1, transfer_id="xfer-nobody",
        ),
    }  # fmt: skip

    failures_before = pair.decode.log_text().count(RECEIVE_FAILED_LINE)

    async def contradicting() -> tuple[Any, Any, float]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            started = time.monotonic()
            results: tuple[Any, ...] = await asyncio.gather(
                pair.demo_proxy(tp_size=2).complete(session, body),
                straight_to_d(session, pair.decode, nobody),
                return_exceptions=True,
            )
            return results[0], results[1], time.monotonic() - started

    wrong_tp, nobody_there, seconds = asyncio.run(contradicting())
    print(f"contradicting P: tp 2 -> {outcome(wrong_tp)}; closed port -> {outcome(nobody_there)}")
    print(f"both answered within {seconds:.2f} s")
    for what, answer in (("tp_size 2", wrong_tp), ("a closed port", nobody_there)):
        if isinstance(answer, Routed):
            answer = answer.decode
        if isinstance(answer, BaseException):
            assert isinstance(answer, LegError), f"{what}: {answer!r}"
            assert answer.status >= 400
        else:
            assert_same(BAD, answer, reference[BAD])
    # D's log says why each receive failed (the client of a failed KV load gets vLLM's "500
    # Internal server error" under kv_load_failure_policy "fail", recompute answers instead).
    failures = pair.decode.log_text().count(RECEIVE_FAILED_LINE) - failures_before
    errors = sum(isinstance(a, BaseException) for a in (wrong_tp, nobody_there))
    assert failures == errors, f"{errors} requests failed, D's log explains {failures}"
    assert_still_serving(pair, tiny_model, prompts, reference)


def outcome(answer: Any) -> str:
    if isinstance(answer, BaseException):
        return f"error {answer}"[:300]
    return "an answer"


def assert_still_serving(
    pair: Pair, tiny_model: Path, prompts: dict[int, list[int]], reference: dict[int, Any]
) -> None:
    """A disaggregated request still succeeds, both servers answer /health, and D's engine
    never died."""

    async def after() -> Routed:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            return await pair.demo_proxy().complete(
                session, greedy_body(tiny_model, prompts[AFTER])
            )

    tokens = PromptTokens(pair.decode)
    assert_same(AFTER, asyncio.run(after()).decode, reference[AFTER])
    assert_all_from_p(tokens, [AFTER])
    for server in (pair.prefill, pair.decode):
        assert server.exit_code() is None, f"{server.name} exited: {server.first_error()}"
        assert server.is_healthy(), f"{server.name} is unhealthy"
        log = server.log_text()
        for line in ENGINE_DEATH:
            assert line not in log, f"{server.name}'s engine died: {server.first_error()}"
