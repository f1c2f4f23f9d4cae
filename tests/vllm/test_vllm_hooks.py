"""No request can kill vLLM's engine through kvpush's connector hooks.

* Property test (hypothesis): arbitrary kv_transfer_params (JSON-like values, ``Infinity``,
  ``NaN``, huge integers, nesting, long strings, wrong types for every key, and params that are
  not an object) go through vLLM's real :class:`Scheduler` with :class:`KvPushConnector` in its
  scheduler role, beside a good disaggregated request, for a few engine steps; the worker role's
  hooks (the real connector and :class:`PushWorker`, over an endpoint test double that delivers,
  fails or raises per request) answer each step, and their report goes back through
  ``update_from_output``, where vLLM asserts it knows every reported request. Nothing raises;
  every request ends and is freed; a request waits for P's KV only when its params were
  accepted, and then ends normally if the KV came, else as ``kv_load_failure_policy`` says; each
  receive is reported once; each refused request is logged once, with its id.
* The two engine killers of the report (``"remote_port": Infinity``, ``"tp_size": Infinity``)
  through the same loop: each prefills locally, beside a good request that gets its KV.
* The worker role's hooks when the endpoint raises each kvpush error (and unexpected ones), or
  is a real endpoint that was closed: the request alone is reported finished (and failed, for a
  receive, with its blocks as load errors), once.
* The scheduler role's handlers when a hook fails for an unexpected reason.

Needs vLLM (``.venv-vllm``) and hypothesis (both installed there by ``scripts/setup-vllm``).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import kvpush
from kvpush._native import LayerStreams
from kvpush.exceptions import (
    ConfigError,
    KvPushError,
    TransportError,
    UnhealthyError,
)
from kvpush.vllm._layout import CacheLayout, Model, TensorView, layout_from_caches
from kvpush.vllm._params import Refused, RemoteDecode, RemotePrefill, parse_params
from kvpush.vllm._scheduler import PushScheduler
from kvpush.vllm._worker import PushWorker
from kvpush.vllm.config import WorkerConfig
from kvpush.vllm.metadata import PushMetadata, RecvRequest, SendRequest
from kvpush_lab.bench.engine import worker_connector

BLOCK = 16
BLOCKS = 512
HEADS, HEAD = 2, 4
TOKEN = 7  # every sampled token (not an end-of-sequence token: requests end by length)
MAX_TOKENS = 2
STEPS = 16
#: The model's one attention layer, as vLLM names it to the connector's hooks.
LAYER = "model.layers.0.self_attn.attn"
GOOD = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "prefill-0",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
    "pp_size": 1,
    "remote_request_id": "p-req",
    "transfer_id": "xfer-good",
}
LOCAL = "prefilling it locally instead"
DROPPED = "serving it as a request without them"
KEYS = (*GOOD, "do_remote_decode", "transfer_mode", "remote_block_ids")

# ---- vLLM's scheduler, as EngineCore builds it --------------------------------------------


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A ``kv_both`` engine with kvpush's connector, over a one-layer model's config (no
    weights, no tokenizer: the scheduler needs neither), streaming layers (``layerwise``)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model = tmp_path_factory.mktemp("model")
    (model / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3ForCausalLM"],
                "model_type": "qwen3",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 32,
                "vocab_size": 512,
                "max_position_embeddings": 4096,
                "torch_dtype": "float32",
            }
        )
    )
    return VllmConfig(
        model_config=ModelConfig(
            model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=4096
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=1024,
            max_model_len=4096,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvPushConnector",
            kv_connector_module_path="kvpush.vllm",
            kv_role="kv_both",
            engine_id="engine-under-test",
            kv_connector_extra_config={"layerwise": "on"},
        ),
        device_config=DeviceConfig("cpu"),
    )


def new_scheduler(vllm_config: Any, policy: str) -> Any:
    """vLLM's real scheduler (its connector built by vLLM's factory, as EngineCore does)."""
    import torch
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config.kv_transfer_config.kv_load_failure_policy = policy
    vllm_config.cache_config.num_gpu_blocks = BLOCKS
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=32, dtype=torch.float32)
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=KVCacheConfig(
            num_blocks=BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec([LAYER], spec)],
        ),
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
        log_stats=True,
    )


def new_request(request_id: str, prompt: int, params: Any) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    request = Request(
        request_id=request_id,
        prompt_token_ids=list(range(1, prompt + 1)),
        sampling_params=SamplingParams(max_tokens=MAX_TOKENS),
        pooling_params=None,
    )
    # What EngineCore hands the scheduler: whatever the client's JSON held, unchecked.
    request.kv_transfer_params = params
    return request


# ---- the worker role, over an endpoint test double -----------------------------------------


@dataclass
class StandInEvent:
    """A ``kvpush.TransferEvent`` as the worker reads one (the native class has no
    constructor), typed as the native one is."""

    role: kvpush.Role
    request_id: str
    outcome: kvpush.Outcome
    reason: str | None = None
    key: str = ""
    code: kvpush.Reason | None = None
    bytes: int = 0
    runs: int = 0
    streamed_bytes: int = 0
    timeline: kvpush.Timeline = field(default_factory=kvpush.Timeline)


@dataclass
class Behaviour:
    """What the endpoint double does with one request: raise ``error`` from ``ready`` /
    ``expect`` / ``abort``, or end its transfer with ``outcome`` after ``polls`` polls;
    ``abort`` answers ``aborted`` (``IN_FLIGHT``: the send's event follows after ``polls``
    polls)."""

    outcome: str = "done"
    error: BaseException | None = None
    polls: int = 0
    aborted: kvpush.AbortOutcome = kvpush.AbortOutcome.UNKNOWN


class EndpointDouble:
    """Test double of :class:`kvpush.Endpoint`: no side channel, no transport; each request
    gets the :class:`Behaviour` the test chose for it, and every call is recorded."""

    def __init__(self, behaviours: dict[str, Behaviour] | None = None) -> None:
        self.behaviours = behaviours or {}
        self.calls: list[tuple[str, str, Any]] = []
        self._due: list[tuple[int, StandInEvent]] = []

    def _behaviour(self, request_id: str) -> Behaviour:
        return self.behaviours.get(request_id, Behaviour())

    def _start(self, role: str, request_id: str) -> None:
        behaviour = self._behaviour(request_id)
        if behaviour.error is not None:
            raise behaviour.error
        reason = None if behaviour.outcome == "done" else f"double: {behaviour.outcome}"
        event = StandInEvent(
            kvpush.Role.from_code(role),
            request_id,
            kvpush.Outcome.from_code(behaviour.outcome),
            reason,
        )
        self._due.append((behaviour.polls, event))

    def ready(self, request_id: str, blocks: Any, num_tokens: int, **options: Any) -> None:
        # As the native endpoint reads them: lists or tuples alike.
        self.calls.append(("ready", request_id, [list(group) for group in blocks]))
        self._start("send", request_id)

    def streams_ready(self, streams: LayerStreams, start: int, end: int) -> None:
        """One layer of every request streaming: recorded per request, as ``layers_ready``."""
        errors = []
        for request_id, blocks in zip(streams.request_ids, streams.blocks(), strict=True):
            self.calls.append(("layers_ready", request_id, blocks))
            errors.append(self._behaviour(request_id).error)
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise error

    def expect(self, request_id: str, source: Any, blocks: Any, num_tokens: int, **kw: Any) -> None:
        self.calls.append(("expect", request_id, source))
        self._start("receive", request_id)

    def abort(self, request_id: str, transfer_id: str | None = None) -> kvpush.AbortOutcome:
        self.calls.append(("abort", request_id, transfer_id))
        behaviour = self._behaviour(request_id)
        if behaviour.error is not None:
            raise behaviour.error
        if behaviour.aborted == kvpush.AbortOutcome.IN_FLIGHT:
            event = StandInEvent(
                kvpush.Role.SEND, request_id, kvpush.Outcome.CANCELLED, "double: aborted"
            )
            self._due.append((behaviour.polls, event))
        return behaviour.aborted

    def cancel(self, request_id: str) -> None:
        self.calls.append(("cancel", request_id, None))
        self._due = [(0, e) if e.request_id == request_id else (n, e) for n, e in self._due]
        for _, due in self._due:
            if due.request_id == request_id:
                due.outcome, due.reason = kvpush.Outcome.CANCELLED, "double: cancelled"

    def poll(self) -> list[StandInEvent]:
        due = [event for polls, event in self._due if polls <= 0]
        self._due = [(polls - 1, event) for polls, event in self._due if polls > 0]
        return due

    def wait(self, timeout: float) -> list[StandInEvent]:
        return self.poll()

    def close(self) -> None:
        self.calls.append(("close", "", None))


@pytest.fixture(scope="module")
def cache() -> Iterator[CacheLayout]:
    """The layout a worker's registration makes of CPU caches (blocks move whole)."""
    caches = [np.zeros((BLOCKS, HEADS, BLOCK, 2 * HEAD), np.float32)]
    views = [
        TensorView(a.ctypes.data, a.shape, tuple(s // a.itemsize for s in a.strides), a.itemsize)
        for a in caches
    ]
    yield layout_from_caches(views, Model(HEADS, HEAD, BLOCK))
    del caches


WORKER_CONFIG = WorkerConfig(
    engine_id="engine-under-test",
    side_channel_host="127.0.0.1",
    side_channel_port=0,
    secret=None,
    insecure=False,
    ttl=30.0,
    receive_timeout=30.0,
    transport="loopback",
    model_fingerprint="tiny",
)


def push_worker(cache: CacheLayout, endpoint: Any, model: Model | None = None) -> PushWorker:
    """A worker as its registration leaves it, over ``endpoint`` (a double, or a real one)."""
    worker = PushWorker(WORKER_CONFIG, model or Model(HEADS, HEAD, BLOCK))
    worker._cache = cache
    worker._endpoint = endpoint
    # As a registration with layerwise on leaves it: the layer's regions stream.
    worker._layer_regions = {LAYER: cache.layer_regions[0]}
    return worker


class Engine:
    """The module's vLLM config and KV layout, in one argument that hypothesis's failure report
    shows by name (it would print a dataclass field by field, and vLLM's configs refuse)."""

    def __init__(self, vllm_config: Any, cache: CacheLayout) -> None:
        self.vllm_config, self.cache = vllm_config, cache

    def __repr__(self) -> str:
        return "Engine(kv_both, KvPushConnector)"


@pytest.fixture(scope="module")
def engine(vllm_config: Any, cache: CacheLayout) -> Engine:
    return Engine(vllm_config, cache)


class Records(logging.Handler):
    """kvpush's log records at WARNING and above."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def naming(self, request_id: str) -> list[str]:
        return [r.getMessage() for r in self.records if f"request {request_id}" in r.getMessage()]


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    logger = logging.getLogger("vllm.kvpush")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


# ---- the engine loop ------------------------------------------------------------------------


@dataclass
class Run:
    """What happened to each request over an engine run."""

    finish: dict[str, Any] = field(default_factory=dict)
    waited: set[str] = field(default_factory=set)
    recv_reports: Counter[str] = field(default_factory=Counter)
    send_reports: Counter[str] = field(default_factory=Counter)
    failed: set[str] = field(default_factory=set)
    #: Steps each request was in the scheduler's hands (its blocks allocated) at their start.
    held: Counter[str] = field(default_factory=Counter)
    #: The step in which each send was reported finished.
    sent_at: dict[str, int] = field(default_factory=dict)


def run_engine(
    scheduler: Any,
    connector: Any,
    requests: list[Any],
    aborts: dict[int, list[str]] | None = None,
) -> Run:
    """Steps the engine as EngineCore and the model runner do, the model answering
    :data:`TOKEN` for every scheduled request; ``aborts``: requests the client drops before a
    step."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import RequestStatus

    run = Run()
    for request in requests:
        scheduler.add_request(request)
    for step in range(STEPS):
        for request_id in (aborts or {}).get(step, []):
            scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        if not scheduler.requests:
            break
        run.held.update(list(scheduler.requests))
        out = scheduler.schedule()
        run.waited |= {
            r.request_id
            for r in scheduler.requests.values()
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        }
        connector.bind_connector_metadata(out.kv_connector_metadata)
        connector.start_load_kv(None)
        # The forward: the layer runs, then the step's saves end.
        connector.save_kv_layer(LAYER, None, None)
        connector.wait_for_save()
        results = connector.get_transfer_results(out.finished_req_ids)
        assert results.failed_recving <= results.finished_recving
        run.recv_reports.update(results.finished_recving)
        run.send_reports.update(results.finished_sending)
        run.sent_at.update(dict.fromkeys(results.finished_sending, step))
        run.failed |= results.failed_recving
        ids = list(out.num_scheduled_tokens)
        engine_outputs = scheduler.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={request_id: i for i, request_id in enumerate(ids)},
                sampled_token_ids=[[TOKEN] for _ in ids],
                kv_connector_output=KVConnectorOutput(
                    finished_sending=results.finished_sending,
                    finished_recving=results.finished_recving,
                    failed_recving=results.failed_recving,
                    invalid_block_ids=connector.get_block_ids_with_load_errors(),
                    kv_connector_stats=connector.get_kv_connector_stats(),
                ),
            ),
        )
        connector.clear_connector_metadata()
        for outputs in engine_outputs.values():
            for output in outputs.outputs:
                if output.finish_reason is not None:
                    run.finish[output.request_id] = output.finish_reason
    connector.shutdown()
    return run


# ---- kv_transfer_params as a client may send them ------------------------------------------

numbers = st.one_of(
    st.integers(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.sampled_from([0, 1, -1, 5600, 65_535, 65_536, 2**31, 2**63, 2**64, 2**70, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.inf, -math.inf, math.nan, 1e300, -1e300, 5600.0, 5600.5, 1.0, 0.0]),
)
texts = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["", "127.0.0.1", "::1", "a b", "h\x00", "\ud800", "x\n"]),
    st.integers(min_value=200, max_value=20_000).map(lambda n: "h" * n),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.text(max_size=6), inner, max_size=4),
        st.integers(min_value=1000, max_value=50_000).map(lambda n: list(range(n))),  # huge lists
    ),
    max_leaves=8,
)
#: Mostly a remote prefill with a few of its fields replaced; also wholly arbitrary objects,
#: and values that are not an object at all.
kv_params = st.one_of(
    st.dictionaries(st.sampled_from(KEYS), json_values, max_size=3).map(lambda c: {**GOOD, **c}),
    st.dictionaries(st.sampled_from(KEYS), json_values, max_size=3).map(
        lambda c: {**GOOD, "do_remote_decode": True, **c}
    ),
    st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=6)), json_values),
    json_values,
)
errors = st.sampled_from(
    [
        UnhealthyError("writer stalled"),
        ConfigError("request: ttl exceeds the maximum"),
        TransportError("endpoint closed"),
        KvPushError("refused"),
        OverflowError("int too big to convert"),
        RuntimeError("a bug"),
    ]
)
behaviours = st.builds(
    Behaviour,
    outcome=st.sampled_from(["done", "done", "failed", "cancelled"]),
    error=st.one_of(st.none(), st.none(), errors),
    polls=st.integers(min_value=0, max_value=3),
)


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    params=st.lists(kv_params, min_size=1, max_size=4),
    prompts=st.lists(st.integers(min_value=1, max_value=64), min_size=5, max_size=5),
    chosen=st.lists(behaviours, min_size=5, max_size=5),
    aborts=st.dictionaries(
        st.integers(min_value=1, max_value=3),
        st.lists(st.sampled_from([f"bad-{i}" for i in range(4)]), min_size=1, max_size=2),
        max_size=2,
    ),
    policy=st.sampled_from(["fail", "recompute"]),
)
def test_no_kv_transfer_params_kill_the_engine_or_hurt_another_request(
    engine: Engine,
    records: Records,
    params: list[Any],
    prompts: list[int],
    chosen: list[Behaviour],
    aborts: dict[int, list[str]],
    policy: str,
) -> None:
    from vllm.v1.engine import FinishReason

    records.records.clear()
    ids = [f"bad-{i}" for i in range(len(params))]
    # The good request's KV arrives: it must end normally whatever its neighbours carry.
    behaviour = {"good": Behaviour("done", None, 1)} | dict(zip(ids, chosen, strict=False))
    endpoint = EndpointDouble(behaviour)
    scheduler = new_scheduler(engine.vllm_config, policy)
    connector = worker_connector(engine.vllm_config, push_worker(engine.cache, endpoint))
    requests = [new_request("good", 40, dict(GOOD))] + [
        new_request(request_id, prompt, p)
        for request_id, prompt, p in zip(ids, prompts, params, strict=False)
    ]
    raw_params = dict(zip(ids, params, strict=True))
    asked = {request_id: parse_params(p) for request_id, p in raw_params.items()}
    run = run_engine(scheduler, connector, requests, aborts)

    for request_id in ids:
        accepted = isinstance(asked[request_id].remote_prefill, RemotePrefill)
        event(f"remote prefill {'accepted' if accepted else 'not asked or refused'}")
        event(f"{'waited for KV' if request_id in run.waited else 'never waited'}")
        if request_id in run.failed:
            event(f"receive failed (policy {policy})")
    for call, _, _ in endpoint.calls:
        event(f"endpoint {call}")
    assert not scheduler.requests, f"requests never freed: {list(scheduler.requests)}"
    assert run.finish.get("good") == FinishReason.LENGTH
    assert "good" in run.waited
    aborted = {request_id for dropped in aborts.values() for request_id in dropped}
    for request_id in ids:
        prefill = asked[request_id].remote_prefill
        if request_id in run.waited:
            assert isinstance(prefill, RemotePrefill), f"{request_id} waited on {prefill}"
        if request_id in aborted and request_id not in run.finish:
            continue
        delivered = request_id in run.recv_reports and request_id not in run.failed
        if request_id not in run.waited or delivered or policy == "recompute":
            assert run.finish[request_id] == FinishReason.LENGTH, request_id
        else:
            assert run.finish[request_id] == FinishReason.ERROR, request_id
    assert all(n == 1 for n in run.recv_reports.values()), run.recv_reports
    assert all(n == 1 for n in run.send_reports.values()), run.send_reports
    # What was registered with P came from numbers no client can smuggle in.
    for call, request_id, sources in endpoint.calls:
        if call != "expect" or request_id == "good":
            continue
        raw = params[ids.index(request_id)]
        port = raw["remote_port"]
        assert not isinstance(port, bool)
        assert isinstance(port, int) or (math.isfinite(port) and port == int(port))
        assert sources == [f"{raw['remote_host']}:{int(port)}"]
    # Layers stream only for the requests P sends to D.
    for call, request_id, _ in endpoint.calls:
        if call == "layers_ready":
            sent = parse_params(raw_params.get(request_id, GOOD)).remote_decode
            assert isinstance(sent, RemoteDecode), request_id
    # Each refusal is logged once, naming the request (a remote prefill's, and P's when its
    # own fields are wrong too).
    for request_id in ids:
        lines = records.naming(request_id)
        assert len(lines) == len(set(lines)), lines
        prefill = asked[request_id].remote_prefill
        if isinstance(prefill, Refused) and not isinstance(raw_params[request_id], Mapping):
            # No object at all: vLLM's own scheduler would read it as one, so it is dropped.
            assert lines == [f"kvpush: request {request_id}: {prefill.reason}; {DROPPED}"]
        elif isinstance(prefill, Refused):
            local = [line for line in lines if LOCAL in line]
            assert local == [f"kvpush: request {request_id}: {prefill.reason}; {LOCAL}"]


@pytest.mark.parametrize(
    "killer",
    [
        '{"do_remote_prefill": true, "remote_host": "127.0.0.1", "remote_port": Infinity}',
        '{"do_remote_prefill": true, "remote_host": "127.0.0.1", "remote_port": 5600, '
        '"tp_size": Infinity}',
    ],
)
def test_the_reported_engine_killers_prefill_locally(
    vllm_config: Any, cache: CacheLayout, records: Records, killer: str
) -> None:
    """``"remote_port": Infinity`` raised OverflowError inside vLLM's scheduler (EngineCore
    died, the server served nobody afterwards); ``"tp_size": Infinity`` likewise."""
    from vllm.v1.engine import FinishReason

    scheduler = new_scheduler(vllm_config, "fail")
    connector = worker_connector(vllm_config, push_worker(cache, EndpointDouble()))
    bad = new_request("killer", 30, json.loads(killer))
    run = run_engine(scheduler, connector, [bad, new_request("good", 40, dict(GOOD))])
    assert run.finish == {"killer": FinishReason.LENGTH, "good": FinishReason.LENGTH}
    assert run.waited == {"good"}
    (line,) = records.naming("killer")
    assert "must be an integer, not inf (float); prefilling it locally instead" in line


# ---- the worker role when the endpoint raises -----------------------------------------------


def closed_transport_error() -> TransportError:
    error = TransportError("the endpoint is closed")
    error.code = "closed"
    return error


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (UnhealthyError("writer stalled for 30 s"), "the endpoint stopped taking work"),
        (ConfigError("request d: ttl 900s exceeds the maximum"), "ttl 900s exceeds"),
        (closed_transport_error(), "the endpoint is closed"),
        (KvPushError("refused"), "KvPushError: refused"),
        (OverflowError("out of range integral type conversion attempted"), "unexpected"),
        (RuntimeError("a bug"), "please report this"),
    ],
    ids=["unhealthy", "invalid", "closed", "kvpush", "overflow", "unexpected"],
)
def test_an_endpoint_error_fails_that_request_alone_once(
    vllm_config: Any, cache: CacheLayout, records: Records, error: BaseException, said: str
) -> None:
    endpoint = EndpointDouble(
        {
            "d-bad": Behaviour(error=error),
            "p-bad": Behaviour(error=error),
            "p-gone": Behaviour(error=error),
        }
    )
    connector = worker_connector(vllm_config, push_worker(cache, endpoint))
    recv = RecvRequest("d-bad", "x1", "127.0.0.1", 5600, 1, ((3, 4),), 0, 20)
    fine = RecvRequest("d-fine", "x2", "127.0.0.1", 5600, 1, ((5,),), 0, 10)
    send = SendRequest("p-bad", "x3", ((6, 7),), 20)
    metadata = PushMetadata(
        sends=[send], recvs=[recv, fine], aborts=[("p-gone", "x4")], cancels=["d-gone"]
    )
    from kvpush.vllm.connector import KvPushMetadata

    connector.bind_connector_metadata(KvPushMetadata(metadata))
    connector.start_load_kv(None)
    first = connector.get_transfer_results(set())
    assert first.finished_sending == {"p-bad"}
    assert first.finished_recving == {"d-bad", "d-fine"}
    assert first.failed_recving == {"d-bad"}
    assert connector.get_block_ids_with_load_errors() == {3, 4}
    again = connector.get_transfer_results(set())
    assert not again.finished_sending
    assert not again.finished_recving
    assert connector.get_block_ids_with_load_errors() == set()
    for request_id in ("d-bad", "p-bad", "p-gone"):
        (line,) = records.naming(request_id)
        assert said in line, line
    connector.shutdown()


def test_a_closed_endpoint_fails_each_receive_once(
    vllm_config: Any, cache: CacheLayout, records: Records
) -> None:
    """The real endpoint, closed under the worker: its own errors, not a double's. A receive
    registered before the close is failed by the close (the cancel cannot reach P); one after
    it is refused by ``expect``; each is reported once."""
    caches = [np.zeros((8, HEADS, BLOCK, 2 * HEAD), np.float32)]
    views = [
        TensorView(a.ctypes.data, a.shape, tuple(s // a.itemsize for s in a.strides), a.itemsize)
        for a in caches
    ]
    worker = PushWorker(WORKER_CONFIG, Model(HEADS, HEAD, BLOCK))
    worker.register(views)
    connector = worker_connector(vllm_config, worker)
    from kvpush.vllm.connector import KvPushMetadata

    nowhere = 1  # nothing listens on port 1: the registration waits for P
    before = RecvRequest("d-0", None, "127.0.0.1", nowhere, 1, ((1,),), 0, 10)
    connector.bind_connector_metadata(KvPushMetadata(PushMetadata(recvs=[before])))
    assert not connector.get_transfer_results(set()).finished_recving
    worker.endpoint.close()
    after = RecvRequest("d-1", None, "127.0.0.1", nowhere, 1, ((2, 3),), 0, 20)
    metadata = PushMetadata(recvs=[after], aborts=[("p-2", None)], cancels=["d-0"])
    connector.bind_connector_metadata(KvPushMetadata(metadata))
    reported: Counter[str] = Counter()
    failed: set[str] = set()
    for _ in range(50):  # the close's event for d-0 is the endpoint's: bounded wait for it
        results = connector.get_transfer_results(set())
        reported.update(results.finished_recving)
        failed |= results.failed_recving
        if len(reported) == 2:
            break
        time.sleep(0.05)
    assert reported == Counter({"d-0": 1, "d-1": 1})
    assert failed == {"d-0", "d-1"}
    assert "the endpoint is closed" in records.naming("d-1")[0]
    assert any("cancel not sent" in line for line in records.naming("d-0"))
    assert not connector.get_transfer_results(set()).finished_recving
    connector.shutdown()
    del caches


def test_after_shutdown_each_instruction_fails_its_request_once(
    vllm_config: Any, cache: CacheLayout, records: Records
) -> None:
    endpoint = EndpointDouble()
    connector = worker_connector(vllm_config, push_worker(cache, endpoint))
    connector.shutdown()
    connector.shutdown()  # idempotent: vLLM may call it more than once
    from kvpush.vllm.connector import KvPushMetadata

    metadata = PushMetadata(
        sends=[SendRequest("p-1", None, ((1,),), 10)],
        recvs=[RecvRequest("d-1", None, "127.0.0.1", 5600, 1, ((2, 3),), 0, 20)],
    )
    connector.bind_connector_metadata(KvPushMetadata(metadata))
    results = connector.get_transfer_results(set())
    assert results.finished_sending == {"p-1"}
    assert results.finished_recving == results.failed_recving == {"d-1"}
    assert connector.get_block_ids_with_load_errors() == {2, 3}
    assert {call for call, _, _ in endpoint.calls} == {"close"}, "nothing new reached it"
    assert "shut down" in records.naming("d-1")[0]


def test_events_for_requests_the_worker_does_not_track_are_not_reported(
    vllm_config: Any, cache: CacheLayout
) -> None:
    """vLLM asserts it knows every request the workers report: a stray or repeated event
    (a transfer already reported, an abort's) is never passed on."""
    endpoint = EndpointDouble()
    connector = worker_connector(vllm_config, push_worker(cache, endpoint))
    from kvpush.vllm.connector import KvPushMetadata

    recv = RecvRequest("d-1", None, "127.0.0.1", 5600, 1, ((2,),), 0, 10)
    connector.bind_connector_metadata(KvPushMetadata(PushMetadata(recvs=[recv, recv])))
    assert endpoint.calls.count(("expect", "d-1", ["127.0.0.1:5600"])) == 1
    endpoint._due.append(
        (0, StandInEvent(kvpush.Role.RECEIVE, "d-1", kvpush.Outcome.DONE))
    )  # a second event
    endpoint._due.append((0, StandInEvent(kvpush.Role.SEND, "p-unknown", kvpush.Outcome.FAILED)))
    results = connector.get_transfer_results(set())
    assert results.finished_recving == {"d-1"}
    assert not results.finished_sending
    endpoint._due.append((0, StandInEvent(kvpush.Role.RECEIVE, "d-1", kvpush.Outcome.FAILED)))
    assert not connector.get_transfer_results(set()).finished_recving


# ---- the scheduler role when a hook fails ---------------------------------------------------


class Unreadable:
    """Block lists from a vLLM that changed under kvpush: reading them raises."""

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        raise RuntimeError("a vLLM API kvpush did not expect")


def test_a_failing_allocation_hook_fails_the_load_of_that_request_alone(
    vllm_config: Any, records: Records
) -> None:
    scheduler = new_scheduler(vllm_config, "fail")
    connector = scheduler.connector
    request = new_request("d-x", 40, dict(GOOD))
    assert connector.get_num_new_matched_tokens(request, 0) == (40, True)
    connector.update_state_after_alloc(request, Unreadable(), 40)
    metadata = scheduler.schedule().kv_connector_metadata.take()  # the step's, built by vLLM
    (refused,) = metadata.refused
    assert refused.request_id == "d-x"
    assert "a vLLM API kvpush did not expect" in refused.reason
    assert not metadata.recvs
    (line,) = records.naming("d-x")
    assert "its KV load fails" in line


def test_scheduler_handlers_decide_for_the_failing_request() -> None:
    sched = PushScheduler()
    params = dict(GOOD)
    assert sched.match_failed("d-1", params, RuntimeError("x")) == (0, False)
    assert params["do_remote_prefill"] is False
    assert sched.external_tokens("d-1", dict(GOOD), 10, 0) == (0, False), "local from now on"
    # A P request whose finish failed: nothing sent, D told.
    assert sched.finish_failed(
        "p-1", {"do_remote_decode": True, "transfer_id": "t"}, KeyError()
    ) == (
        False,
        None,
    )
    assert sched.take_metadata().aborts == [("p-1", "t")]
    # A D request waiting for its KV whose finish failed: cancelled, not freed.
    sched.allocated("d-2", dict(GOOD), [[1]], 0, 10, 10)
    sched.take_metadata()
    assert sched.finish_failed("d-2", None, KeyError()) == (False, None)
    assert sched.take_metadata().cancels == ["d-2"]


def test_no_assert_guards_an_engine_path() -> None:
    """``python -O`` strips asserts, and an AssertionError in a hook kills the engine: the
    connector's modules decide with explicit handling instead."""
    package = Path(kvpush.__file__).parent / "vllm"
    modules = (
        "connector.py",
        "config.py",
        "metadata.py",
        "_scheduler.py",
        "_worker.py",
        "_params.py",
    )
    for module in modules:
        lines = (package / module).read_text().splitlines()
        assert not [line for line in lines if line.strip().startswith("assert ")], module


def test_a_prompt_computed_in_one_step_streams_its_layers_as_its_send_will_name_them(
    engine: Engine,
) -> None:
    """Layer-wise push through vLLM's real scheduler: a prompt computed in one step streams
    its layer in that step's forward, with the blocks its send names afterwards; one chunked
    over several steps (longer than max_num_batched_tokens) streams in each chunk's forward,
    its KV so far (the blocks of the tokens computed, each chunk's a prefix of the next's),
    the last chunk's as its send names it; a request that is not a remote decode never
    streams."""
    endpoint = EndpointDouble()
    scheduler = new_scheduler(engine.vllm_config, "fail")
    connector = worker_connector(engine.vllm_config, push_worker(engine.cache, endpoint))
    requests = [
        new_request("short", 40, {"do_remote_decode": True}),
        new_request("chunked", 1500, {"do_remote_decode": True}),
        new_request("local", 40, None),
    ]
    run = run_engine(scheduler, connector, requests)
    assert run.send_reports == Counter({"short": 1, "chunked": 1})
    for request_id, chunks in (("short", 1), ("chunked", 2)):
        calls = [(call, blocks) for call, rid, blocks in endpoint.calls if rid == request_id]
        names = [call for call, _ in calls]
        assert names == ["layers_ready"] * chunks + ["ready"], (request_id, names)
        streamed = [blocks for _, blocks in calls]
        for earlier, later in itertools.pairwise(streamed):
            for group, more in zip(earlier, later, strict=True):
                assert more[: len(group)] == group, f"{request_id}: a chunk's blocks moved"
        assert streamed[-2] == streamed[-1], f"{request_id}: streamed other KV than it sent"
    assert not [call for call in endpoint.calls if call[1] == "local"]


@pytest.mark.parametrize(
    "aborted",
    [kvpush.AbortOutcome.IN_FLIGHT, kvpush.AbortOutcome.UNKNOWN, kvpush.AbortOutcome.RELEASED],
)
def test_a_prefill_aborted_mid_stream_keeps_its_blocks_until_no_write_can_read_them(
    engine: Engine, aborted: kvpush.AbortOutcome
) -> None:
    """A chunked prompt streams its first chunk's layers, then the client drops it: vLLM keeps
    its blocks (a layer's WRITE may still read them) until the worker reports the abort
    settled, once: at the send's event when the endpoint answers ``IN_FLIGHT`` (a WRITE in
    flight), at once otherwise. A prompt that never streamed is freed when aborted."""
    polls = 4
    endpoint = EndpointDouble({"chunked": Behaviour(polls=polls, aborted=aborted)})
    scheduler = new_scheduler(engine.vllm_config, "fail")
    connector = worker_connector(engine.vllm_config, push_worker(engine.cache, endpoint))
    requests = [
        new_request("chunked", 1500, {"do_remote_decode": True}),
        new_request("waiting", 1500, {"do_remote_decode": True}),
    ]
    run = run_engine(scheduler, connector, requests, aborts={1: ["chunked", "waiting"]})
    calls = [call for call, request_id, _ in endpoint.calls if request_id == "chunked"]
    assert calls == ["layers_ready", "abort"], calls
    assert run.send_reports == Counter({"chunked": 1})
    # Step 0 computed its first chunk; aborted before step 1, whose metadata has the worker
    # abort it: its blocks are held until vLLM reads the report, in the step it was made.
    assert run.held["chunked"] == run.sent_at["chunked"] + 1, (run.held, run.sent_at)
    if aborted == kvpush.AbortOutcome.IN_FLIGHT:
        assert run.sent_at["chunked"] > 1, "reported before the send's event"
    else:
        assert run.sent_at["chunked"] == 1, "nothing in flight: reported in the abort's step"
    # Behind it in the queue, it never streamed: freed at once, D told.
    assert run.held["waiting"] == 1
    assert [call for call, request_id, _ in endpoint.calls if request_id == "waiting"] == ["abort"]
    assert not scheduler.requests


def test_a_secret_in_the_kv_transfer_config_stops_the_engine_at_startup(
    vllm_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM logs kv_transfer_config at every start and the command line is world-readable: the
    connector refuses a secret there, in its first hook (vLLM's factory building it), before
    any request; the message says where the secret goes instead and never shows it."""
    secret = "do-not-print-0123456789abcdef"
    monkeypatch.setattr(
        vllm_config.kv_transfer_config, "kv_connector_extra_config", {"secret": secret}
    )
    with pytest.raises(ConfigError, match="KVPUSH_SECRET_FILE") as refused:
        new_scheduler(vllm_config, "fail")
    assert secret not in str(refused.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        *(("idle_wait_ms", v) for v in ["soon", -1, 51, None]),
        *(("layerwise", v) for v in ["yes", "ON", True, None]),
    ],
)
def test_a_bad_option_stops_the_engine_at_startup_naming_the_key(
    vllm_config: Any, monkeypatch: pytest.MonkeyPatch, key: str, value: Any
) -> None:
    monkeypatch.setattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", {key: value})
    with pytest.raises(ConfigError, match=rf"kv_connector_extra_config\.{key} must be"):
        new_scheduler(vllm_config, "fail")


def test_with_several_kv_cache_groups_a_failed_receive_is_reported_by_request_alone(
    vllm_config: Any, cache: CacheLayout
) -> None:
    """Block ids are per group, so vLLM raises on block-level load errors when there are
    several groups (``_handle_invalid_blocks``): the failure goes by ``failed_recving`` only."""
    from kvpush.vllm._layout import CacheGroups

    groups = CacheGroups(transfer_ids=(0, 1), total=2, block_size=BLOCK, windowed=(True, False))
    endpoint = EndpointDouble({"d-1": Behaviour(error=UnhealthyError("stalled"))})
    model = Model(HEADS, HEAD, BLOCK, groups=groups)
    connector = worker_connector(vllm_config, push_worker(cache, endpoint, model))
    from kvpush.vllm.connector import KvPushMetadata

    recv = RecvRequest("d-1", None, "127.0.0.1", 5600, 1, ((4,), (4, 5)), 0, 20)
    connector.bind_connector_metadata(KvPushMetadata(PushMetadata(recvs=[recv])))
    results = connector.get_transfer_results(set())
    assert results.finished_recving == results.failed_recving == {"d-1"}
    assert connector.get_block_ids_with_load_errors() == set()


def test_a_quarantined_transfer_holds_its_blocks_until_its_final_event(
    vllm_config: Any, cache: CacheLayout
) -> None:
    """A ``quarantined`` event is a notice (a WRITE may still land): neither the receive nor
    the send is reported until the transfer's final event, which then is, once."""
    endpoint = EndpointDouble(
        {"d-q": Behaviour(outcome="quarantined"), "p-q": Behaviour(outcome="quarantined")}
    )
    connector = worker_connector(vllm_config, push_worker(cache, endpoint))
    from kvpush.vllm.connector import KvPushMetadata

    recv = RecvRequest("d-q", None, "127.0.0.1", 5600, 1, ((2, 3),), 0, 20)
    send = SendRequest("p-q", None, ((4,),), 10)
    connector.bind_connector_metadata(KvPushMetadata(PushMetadata(sends=[send], recvs=[recv])))
    held = connector.get_transfer_results(set())
    assert not held.finished_recving, "held while a WRITE may still land"
    assert not held.finished_sending, "P's source blocks held while NIXL may read them"
    assert connector.get_block_ids_with_load_errors() == set()
    endpoint._due.append(
        (0, StandInEvent(kvpush.Role.RECEIVE, "d-q", kvpush.Outcome.FAILED, "P confirmed"))
    )
    endpoint._due.append((0, StandInEvent(kvpush.Role.SEND, "p-q", kvpush.Outcome.DONE)))
    ended = connector.get_transfer_results(set())
    assert ended.finished_recving == ended.failed_recving == {"d-q"}
    assert ended.finished_sending == {"p-q"}
    assert connector.get_block_ids_with_load_errors() == {2, 3}
    assert not connector.get_transfer_results(set()).finished_recving
