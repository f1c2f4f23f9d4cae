"""``kvpush bench engine``: the engine-thread bill, what a connector costs vLLM's engine per step.

A decode engine (D) whose every request gets its KV from a prefill engine, stepped in this
process the way ``EngineCore`` and the model runner step it, against vLLM's real
:class:`~vllm.v1.core.sched.scheduler.Scheduler` with each connector built by vLLM's own
factory:

* a loop as ``EngineCore.run_busy_loop`` runs it: requests arrive from another thread through a
  queue (the input thread's), are drained before each step, and after a step that computes
  nothing vLLM's own 1 ms sleep (``EngineCore._process_engine_step``, vLLM 0.32);
* each step: ``Scheduler.schedule`` (the connector's scheduler hooks), the worker role's hooks in
  the order ``KVConnectorModelRunnerMixin._get_kv_connector_output`` calls them, then
  ``Scheduler.update_from_output`` (the scheduler hooks again). No model runs: a step's tokens
  are sampled as one fixed token, so the step's time is the scheduler's and the connector's;
* requests in flight held at 1, 64 and 512 (a finished request is replaced by a new one), each a
  64-token prompt whose KV comes from P, then 8 decoded tokens.

Every connector hook is timed on the engine's thread by an independent timer wrapped around the
connector object (wall time and the thread's CPU time, ``time.thread_time_ns``), summed per step;
steps that compute (the scheduler scheduled tokens) are reported apart from steps that compute
nothing (every request waits for its KV). A request's **arrival delay** is the time from its
arrival in the input queue to the scheduler taking it: what a wait on the engine's thread would
add to its TTFT.

The connectors:

* ``kvpush``: :class:`kvpush.vllm.KvPushConnector` in both roles, its worker over a real
  :class:`~kvpush.Endpoint` (loopback transport: the bytes are copied by the endpoint's writer
  thread, off the engine's thread as NIXL's would be), P a real kvpush worker in this process
  whose KV is ready before D registers (nothing of P runs on D's thread);
* ``kvpush idle_wait_ms=2``: the same with the worker's optional wait for a transfer event in
  steps that compute nothing (kvpush's behaviour before it was measured here; ``auto``, the
  default, waits so only in an engine of several workers);
* ``NixlConnector`` (vLLM's pull) and ``NixlPushConnector``: vLLM's scheduler role. Their worker
  role needs a NIXL agent, a handshake with a P engine and vLLM's distributed state, so it is a
  stand-in here that reports each receive done on the step after the request began waiting: the
  rows measure these connectors' scheduler hooks only, and their worker hooks not at all.

Results: terminal tables, ``~/.cache/kvpush/results/engine-<time>.json`` (``--results``), and
the ``## Engine-thread bill`` section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import json
import math
import queue
import random
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpush_lab.bench import engine_servers, report
from kvpush_lab.bench.report import microseconds as _us
from kvpush_lab.bench.report import percentile as _percentile
from kvpush_lab.hooktimer import SCHEDULER_HOOKS, WORKER_HOOKS, Timer

if TYPE_CHECKING:
    from kvpush.vllm._worker import PushWorker

SECTION = "Engine-thread bill (in-process, vLLM's scheduler)"
BLOCK = 16
PROMPT = 64
OUTPUT = 8
HEADS, HEAD = 1, 32
TOKEN = 7
P_ENGINE = "prefill-0"
D_ENGINE = "decode-0"
KVPUSH, KVPUSH_WAIT, PULL, PUSH = (
    "kvpush",
    "kvpush idle_wait_ms=2",
    "NixlConnector",
    "NixlPushConnector",
)
CONNECTORS = (KVPUSH, KVPUSH_WAIT, PULL, PUSH)
IN_FLIGHT = (1, 64, 512)
#: vLLM's engine loop sleeps this long after a step that computes nothing (vLLM 0.32).
ENGINE_IDLE_SLEEP = 0.001
#: Requests arrive this long (uniformly drawn) after the loop asks for them: any phase of a step.
ARRIVAL_SPREAD = 0.004

#: The scheduler hooks vLLM calls once per request (admitted, or ended), not once per step.
PER_REQUEST_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "request_finished",
    "request_finished_all_groups",
)


class HookTimer:
    """The hooks of one connector object, timed on the calling thread
    (:class:`kvpush_lab.hooktimer.Timer`): wall and thread CPU time summed until taken, and
    per hook the calls, their total and the slowest."""

    def __init__(self) -> None:
        self._timer = Timer(self._record)
        self.wall_ns = 0
        self.cpu_ns = 0
        self.calls: Counter[str] = Counter()
        #: Per hook: wall time in all calls, and in the slowest call (ns).
        self.total_ns: Counter[str] = Counter()
        self.max_ns: Counter[str] = Counter()

    def wrap(self, connector: object, names: Sequence[str]) -> None:
        self._timer.wrap_object(connector, names)

    def _record(self, name: str, wall: int, cpu: int, args: Sequence[Any]) -> None:
        self.wall_ns += wall
        self.cpu_ns += cpu
        self.calls[name] += 1
        self.total_ns[name] += wall
        self.max_ns[name] = max(self.max_ns[name], wall)

    def take(self) -> tuple[int, int]:
        taken = (self.wall_ns, self.cpu_ns)
        self.wall_ns = self.cpu_ns = 0
        return taken


@dataclass
class Step:
    """One engine step's connector time on the engine's thread (ns), by role."""

    computing: bool
    in_flight: int
    scheduler_wall: int
    scheduler_cpu: int
    worker_wall: int
    worker_cpu: int
    step_wall: int
    #: Calls of the scheduler's per-request hooks in the step (a request admitted or ended):
    #: a step without any is a steady one, what every running request costs by itself.
    per_request_calls: int = 0

    @property
    def wall(self) -> int:
        return self.scheduler_wall + self.worker_wall

    @property
    def cpu(self) -> int:
        return self.scheduler_cpu + self.worker_cpu


@dataclass
class Run:
    connector: str
    in_flight: int
    requests: int
    seconds: float
    steps: list[Step] = field(default_factory=list)
    #: Seconds from each request's arrival in the input queue to the scheduler taking it.
    arrival_delays: list[float] = field(default_factory=list)
    #: Receives that ended other than done (kvpush), or requests that did not finish.
    failures: int = 0
    worker_measured: bool = True
    #: Per hook (``role.hook``): calls, wall time in all of them and in the slowest (ns).
    hooks: dict[str, tuple[int, int, int]] = field(default_factory=dict)


# ---- vLLM's engine, as EngineCore builds it ------------------------------------------------


def _model_dir(root: Path) -> Path:
    """A one-layer model's config (no weights, no tokenizer: the scheduler needs neither)."""
    model = root / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3ForCausalLM"],
                "model_type": "qwen3",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": HEADS,
                "head_dim": HEAD,
                "vocab_size": 512,
                "max_position_embeddings": 4096,
                "torch_dtype": "float32",
            }
        )
    )
    return model


def _blocks_for(in_flight: int) -> int:
    per_request = -(-(PROMPT + OUTPUT) // BLOCK) + 1
    return max(256, 2 * in_flight * per_request)


def _scheduler(model: Path, connector: str, in_flight: int, extra: dict[str, Any]) -> Any:
    """vLLM's real scheduler with ``connector`` built by vLLM's factory in its scheduler role."""
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    blocks = _blocks_for(in_flight)
    module = {"kv_connector_module_path": "kvpush.vllm"} if connector.startswith(KVPUSH) else {}
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=4096
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max(in_flight, 16),
            max_num_batched_tokens=max(4096, in_flight * PROMPT),
            max_model_len=4096,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvPushConnector" if connector.startswith(KVPUSH) else connector,
            kv_role="kv_consumer",
            engine_id=D_ENGINE,
            kv_connector_extra_config=extra,
            **module,
        ),
        device_config=DeviceConfig("cpu"),
    )
    vllm_config.cache_config.num_gpu_blocks = blocks
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32
    )
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=KVCacheConfig(
            num_blocks=blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
        ),
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
        log_stats=True,
    )


# ---- kvpush's worker role and its P ----------------------------------------------------------


def layer_names(layers: int) -> list[str]:
    """Attention layers' names as vLLM gives them to ``save_kv_layer``."""
    return [f"model.layers.{i}.self_attn.attn" for i in range(layers)]


def caches(blocks: int, layers: int = 1) -> tuple[list[Any], list[Any], Any]:
    """``layers`` KV cache tensors of ``blocks`` blocks each, as vLLM's CPU backend lays them
    out: the arrays (keep them while a worker uses them), their views, and the model they fit."""
    from kvpush.vllm._layout import Model, TensorView

    arrays = [np.zeros((blocks, HEADS, BLOCK, 2 * HEAD), np.float32) for _ in range(layers)]
    views = [
        TensorView(a.ctypes.data, a.shape, tuple(s // a.itemsize for s in a.strides), a.itemsize)
        for a in arrays
    ]
    return arrays, views, Model(HEADS, HEAD, BLOCK)


def push_worker(
    engine: str, views: list[Any], model: Any, *, idle_wait: float = 0.0, layerwise: str = "off"
) -> PushWorker:
    """A kvpush worker registered over ``views``, one layer each (named by :func:`layer_names`),
    on the loopback transport."""
    from kvpush.vllm._worker import PushWorker
    from kvpush.vllm.config import WorkerConfig

    config = WorkerConfig(
        engine_id=engine,
        side_channel_host="127.0.0.1",
        side_channel_port=0,
        secret=None,
        insecure=False,
        ttl=30.0,
        receive_timeout=30.0,
        transport="loopback",
        model_fingerprint="engine-bench",
        idle_wait=idle_wait,
        layerwise=layerwise,
    )
    worker = PushWorker(config, model)
    worker.register(views, layers={name: i for i, name in enumerate(layer_names(len(views)))})
    return worker


def _push_worker(engine: str, blocks: int, idle_wait: float) -> tuple[PushWorker, Any]:
    """A registered kvpush worker of one layer, and the arrays it registered."""
    arrays, views, model = caches(blocks)
    return push_worker(engine, views, model, idle_wait=idle_wait), arrays


def worker_connector(vllm_config: Any, worker: Any) -> Any:
    """The worker role's real :class:`KvPushConnector` around ``worker``: its constructor reads
    TP and PP ranks from vLLM's distributed state, which this process has not set up, so the
    base class is initialised directly and the registered worker handed in."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorRole,
    )

    from kvpush.vllm.connector import KvPushConnector

    connector = KvPushConnector.__new__(KvPushConnector)
    KVConnectorBase_V1.__init__(connector, vllm_config, KVConnectorRole.WORKER, None)
    connector._scheduler = None
    connector._worker = worker
    connector._groups = None
    return connector


class KvPushPrefill:
    """P: a real kvpush worker that finished the prefill of every request before the run starts
    (its KV waits for D's registration: the rendezvous holds either order), so that nothing of P
    runs on D's thread: its endpoint's native threads answer D's registrations and write."""

    def __init__(self, blocks: int, requests: int) -> None:
        from kvpush.vllm._scheduler import PushScheduler

        self.worker, self._arrays = _push_worker(P_ENGINE, blocks, 0.0)
        self.port = int(self.worker.endpoint.address.rsplit(":", 1)[1])
        scheduler = PushScheduler()
        need = -(-PROMPT // BLOCK)
        for index in range(requests):
            first = (index * need) % (blocks - need)
            scheduler.finished(
                f"p-{index}",
                {"do_remote_decode": True, "transfer_id": f"xfer-{index}"},
                True,
                [list(range(first, first + need))],
                PROMPT,
            )
        self.worker.apply(scheduler.take_metadata())

    def close(self) -> None:
        """Closes P (a send that failed fails D's receive, which the run counts)."""
        self.worker.close()


class StandInWorker:
    """The worker role of vLLM's NIXL connectors, stood in for: each receive is done on the step
    after its request began waiting for its KV. Not timed: nothing of it is vLLM's."""

    def __init__(self) -> None:
        self._waiting: set[str] = set()
        self._reported: set[str] = set()

    def results(self, scheduler: Any) -> tuple[set[str], set[str]]:
        """(sends finished, receives finished) of this step, each receive once."""
        from vllm.v1.request import RequestStatus

        waiting = {
            r.request_id
            for r in scheduler.requests.values()
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        }
        done = (self._waiting & waiting) - self._reported
        self._reported = (self._reported | done) & set(scheduler.requests)
        self._waiting = waiting
        return set(), done


# ---- the engine loop -------------------------------------------------------------------------


class Arrivals:
    """The input thread: each request handed to it arrives in the input queue at a moment drawn
    uniformly from the next :data:`ARRIVAL_SPREAD` (any phase of a step), stamped on arrival."""

    def __init__(self, seed: int) -> None:
        self.queue: queue.Queue[tuple[float, Any]] = queue.Queue()
        self._due: list[tuple[float, int, Any]] = []
        self._wake = threading.Condition()
        self._closed = False
        self._random = random.Random(seed)
        self._thread = threading.Thread(target=self._run, name="bench-input", daemon=True)
        self._thread.start()

    def send(self, request: Any) -> None:
        with self._wake:
            due = time.perf_counter() + self._random.uniform(0.0, ARRIVAL_SPREAD)
            heapq.heappush(self._due, (due, id(request), request))
            self._wake.notify()

    def _run(self) -> None:
        with self._wake:
            while not self._closed:
                if not self._due:
                    self._wake.wait()
                    continue
                wait = self._due[0][0] - time.perf_counter()
                if wait > 0:
                    self._wake.wait(wait)
                    continue
                _, _, request = heapq.heappop(self._due)
                self.queue.put((time.perf_counter(), request))

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=5.0)


def _params(connector: str, index: int, p_port: int) -> dict[str, Any]:
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": P_ENGINE,
        "remote_host": "127.0.0.1",
        "remote_port": p_port,
        "tp_size": 1,
        "pp_size": 1,
        "remote_request_id": f"p-{index}",
    }
    if connector.startswith(KVPUSH):
        params["transfer_id"] = f"xfer-{index}"
    elif connector == PULL:
        params["remote_block_ids"] = list(range(-(-PROMPT // BLOCK)))
        params["remote_num_tokens"] = PROMPT
    return params


def _request(index: int, params: dict[str, Any]) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    request = Request(
        request_id=f"req-{index}",
        prompt_token_ids=[1 + (index + i) % 500 for i in range(PROMPT)],
        sampling_params=SamplingParams(max_tokens=OUTPUT, ignore_eos=True),
        pooling_params=None,
    )
    request.kv_transfer_params = params
    return request


def run(connector: str, in_flight: int, requests: int, root: Path, seed: int = 0) -> Run:
    """Steps a D engine with ``connector`` until ``requests`` requests finished, ``in_flight``
    at a time."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    extra = {"idle_wait_ms": 2} if connector == KVPUSH_WAIT else {}
    kvpush = connector.startswith(KVPUSH)
    prefill = KvPushPrefill(_blocks_for(in_flight), requests) if kvpush else None
    d_worker, _d_arrays = (
        _push_worker(D_ENGINE, _blocks_for(in_flight), 0.002 if extra else 0.0)
        if kvpush
        else (None, None)
    )
    scheduler = _scheduler(_model_dir(root), connector, in_flight, extra)
    sched_timer, worker_timer = HookTimer(), HookTimer()
    sched_timer.wrap(scheduler.connector, SCHEDULER_HOOKS)
    worker = worker_connector(scheduler.vllm_config, d_worker) if d_worker else None
    stand_in = None if worker else StandInWorker()
    if worker is not None:
        worker_timer.wrap(worker, WORKER_HOOKS)
    arrivals = Arrivals(seed)
    result = Run(connector, in_flight, requests, 0.0, worker_measured=worker is not None)
    p_port = prefill.port if prefill else 5600
    sent = finished = 0
    started = time.perf_counter()
    deadline = time.monotonic() + 60.0 + requests * 0.05
    try:
        while finished < requests and time.monotonic() < deadline:
            # The client keeps `in_flight` requests in the engine (or on their way to it).
            while sent - finished < in_flight and sent < requests:
                arrivals.send(_request(sent, _params(connector, sent, p_port)))
                sent += 1
            # EngineCore._process_input_queue: block while there is no work, then drain.
            if not scheduler.has_requests():
                stamp, request = arrivals.queue.get(timeout=10.0)
                scheduler.add_request(request)
                result.arrival_delays.append(time.perf_counter() - stamp)
            while not arrivals.queue.empty():
                stamp, request = arrivals.queue.get_nowait()
                scheduler.add_request(request)
                result.arrival_delays.append(time.perf_counter() - stamp)
            step_started = time.perf_counter_ns()
            calls_before = sum(sched_timer.calls[name] for name in PER_REQUEST_HOOKS)
            out = scheduler.schedule()
            computing = out.total_num_scheduled_tokens > 0
            if worker is not None:
                worker.bind_connector_metadata(out.kv_connector_metadata)
                worker.start_load_kv(None)
                worker.wait_for_save()
                results = worker.get_transfer_results(out.finished_req_ids)
                sending, recving = results.finished_sending, results.finished_recving
                failed = results.failed_recving
                invalid = worker.get_block_ids_with_load_errors()
                stats = worker.get_kv_connector_stats()
                worker.get_kv_connector_kv_cache_events()
                worker.build_connector_worker_meta()
                worker.clear_connector_metadata()
            else:
                assert stand_in is not None
                sending, recving = stand_in.results(scheduler)
                failed, invalid, stats = set(), set(), None
            result.failures += len(failed)
            ids = list(out.num_scheduled_tokens)
            engine_outputs = scheduler.update_from_output(
                out,
                ModelRunnerOutput(
                    req_ids=ids,
                    req_id_to_index={request_id: i for i, request_id in enumerate(ids)},
                    sampled_token_ids=[[TOKEN] for _ in ids],
                    kv_connector_output=KVConnectorOutput(
                        finished_sending=sending,
                        finished_recving=recving,
                        failed_recving=failed,
                        invalid_block_ids=invalid,
                        kv_connector_stats=stats,
                    ),
                ),
            )
            step_wall = time.perf_counter_ns() - step_started
            s_wall, s_cpu = sched_timer.take()
            w_wall, w_cpu = worker_timer.take()
            per_request = sum(sched_timer.calls[n] for n in PER_REQUEST_HOOKS) - calls_before
            result.steps.append(
                Step(
                    computing,
                    len(scheduler.requests),
                    s_wall,
                    s_cpu,
                    w_wall,
                    w_cpu,
                    step_wall,
                    per_request,
                )
            )
            for outputs in engine_outputs.values():
                finished += sum(1 for o in outputs.outputs if o.finish_reason is not None)
            if not computing and scheduler.has_requests():
                time.sleep(ENGINE_IDLE_SLEEP)  # EngineCore._process_engine_step
    finally:
        result.seconds = time.perf_counter() - started
        for role, timer in (("scheduler", sched_timer), ("worker", worker_timer)):
            for name, calls in timer.calls.items():
                result.hooks[f"{role}.{name}"] = (calls, timer.total_ns[name], timer.max_ns[name])
        arrivals.close()
        scheduler.connector.shutdown()
        if worker is not None:
            worker.shutdown()
        if prefill is not None:
            prefill.close()
    result.failures += requests - finished
    return result


# ---- the report ------------------------------------------------------------------------------


def summarize(result: Run) -> dict[str, Any]:
    """Per-step connector time (ns) at p50/p99 in steady steps (they compute, and admit or end
    no request), per request overall, and arrival delays (s)."""
    steady = [s for s in result.steps if s.computing and not s.per_request_calls]
    busy = [s for s in result.steps if s.computing and s.per_request_calls]
    idle = [s for s in result.steps if not s.computing]
    finished = max(result.requests - result.failures, 1)
    return {
        "connector": result.connector,
        "in_flight": result.in_flight,
        "in_flight_p50": _percentile([s.in_flight for s in result.steps if s.computing], 50),
        "steps": {"steady": len(steady), "admitting": len(busy), "idle": len(idle)},
        "worker_measured": result.worker_measured,
        "failures": result.failures,
        "steady": {
            "wall_p50": _percentile([s.wall for s in steady], 50),
            "wall_p99": _percentile([s.wall for s in steady], 99),
            "cpu_p50": _percentile([s.cpu for s in steady], 50),
            "cpu_p99": _percentile([s.cpu for s in steady], 99),
            "scheduler_p50": _percentile([s.scheduler_wall for s in steady], 50),
            "worker_p50": _percentile([s.worker_wall for s in steady], 50),
            "step_p50": _percentile([s.step_wall for s in steady], 50),
        },
        "idle": {
            "wall_p50": _percentile([s.wall for s in idle], 50),
            "wall_p99": _percentile([s.wall for s in idle], 99),
        },
        "per_request": {
            "wall": sum(s.wall for s in result.steps) / finished,
            "cpu": sum(s.cpu for s in result.steps) / finished,
            "scheduler_cpu": sum(s.scheduler_cpu for s in result.steps) / finished,
        },
        "arrival_p50": _percentile(result.arrival_delays, 50),
        "arrival_p99": _percentile(result.arrival_delays, 99),
    }


def summarize_rounds(rounds: Sequence[Run]) -> dict[str, Any]:
    """One point's rounds as one sample (their steps and arrivals pooled), with each round's
    steady-step p50 kept for the spread."""
    first = rounds[0]
    pooled = Run(
        first.connector,
        first.in_flight,
        sum(r.requests for r in rounds),
        sum(r.seconds for r in rounds),
        steps=[step for r in rounds for step in r.steps],
        arrival_delays=[delay for r in rounds for delay in r.arrival_delays],
        failures=sum(r.failures for r in rounds),
        worker_measured=first.worker_measured,
    )
    summary = summarize(pooled)
    summary["rounds"] = len(rounds)
    summary["steady"]["round_p50s"] = [summarize(r)["steady"]["wall_p50"] for r in rounds]
    return summary


def _spread(values: Sequence[float | None]) -> str:
    known = [v for v in values if v is not None]
    if len(known) < 2:
        return ""
    return f" ({_us(min(known))} to {_us(max(known))})"


def tables(summaries: Sequence[dict[str, Any]]) -> tuple[report.Table, report.Table]:
    """The connector-time table and the arrival-delay table."""
    steps = report.Table(
        [
            "connector",
            "in flight (held p50)",
            "steps: steady / admitting or ending / idle",
            "steady step: connector wall p50 (rounds' p50s) / p99 (µs)",
            "thread CPU p50 / p99 (µs)",
            "of it scheduler / worker p50 (µs)",
            "connector CPU per request (µs)",
            "of it scheduler (µs)",
            "worker hooks",
        ]
    )
    arrivals = report.Table(
        [
            "connector",
            "in flight",
            "arrival → scheduler p50 / p99 (µs)",
            "idle step: connector p50 / p99 (µs)",
        ]
    )
    for s in summaries:
        st, n = s["steady"], s["steps"]
        held = s["in_flight_p50"]
        steps.add(
            s["connector"],
            f"{s['in_flight']} ({held:.0f})" if held is not None else s["in_flight"],
            f"{n['steady']} / {n['admitting']} / {n['idle']}",
            f"{_us(st['wall_p50'])}{_spread(st.get('round_p50s', []))} / {_us(st['wall_p99'])}",
            f"{_us(st['cpu_p50'])} / {_us(st['cpu_p99'])}",
            f"{_us(st['scheduler_p50'])} / {_us(st['worker_p50'])}",
            _us(s["per_request"]["cpu"]),
            _us(s["per_request"]["scheduler_cpu"]),
            "timed" if s["worker_measured"] else "stand-in, not timed",
        )
        arrivals.add(
            s["connector"],
            s["in_flight"],
            f"{_us(_ns(s['arrival_p50']))} / {_us(_ns(s['arrival_p99']))}",
            f"{_us(s['idle']['wall_p50'])} / {_us(s['idle']['wall_p99'])}",
        )
    return steps, arrivals


def _ns(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e9


def verdicts(summaries: Sequence[dict[str, Any]]) -> list[str]:
    """The issue's goals, each met or not (or not judged, and why), from this run's figures."""
    by = {(s["connector"], s["in_flight"]): s for s in summaries}
    flights = sorted({s["in_flight"] for s in summaries})
    lines = []
    mine = [by[(KVPUSH, n)] for n in flights if (KVPUSH, n) in by]
    if len(mine) >= 2:
        first, last = mine[0]["steady"]["wall_p50"], mine[-1]["steady"]["wall_p50"]
        low, high = mine[0]["in_flight"], mine[-1]["in_flight"]
        if first and last:
            lines.append(
                f"Flat in requests in flight: kvpush's connector time in a steady step (both "
                f"roles), p50 {_us(first)} µs at {low} in flight and {_us(last)} µs at {high}: "
                f"{(last - first) / max(high - low, 1):.0f} ns more per further request in "
                f"flight ({last / first:.2f}x for {high // max(low, 1)}x the requests)"
            )
    for n in flights:
        k = by.get((KVPUSH, n))
        upstream = [by[(c, n)] for c in (PULL, PUSH) if (c, n) in by]
        if not k or not upstream:
            continue
        best = min(upstream, key=lambda u: u["steady"]["scheduler_p50"] or math.inf)
        mine_s, theirs = k["steady"]["scheduler_p50"], best["steady"]["scheduler_p50"]
        per_k, per_u = k["per_request"]["scheduler_cpu"], best["per_request"]["scheduler_cpu"]
        if mine_s and theirs:
            lines.append(
                f"{n} in flight, scheduler role against the better upstream ({best['connector']}):"
                f" steady step p50 {_us(mine_s)} vs {_us(theirs)} µs ({mine_s / theirs:.2f}x), "
                f"CPU per request {_us(per_k)} vs {_us(per_u)} µs ({per_k / per_u:.2f}x)"
            )
        arrival_k = k["arrival_p99"]
        arrival_u = min(u["arrival_p99"] or math.inf for u in upstream)
        if arrival_k is not None and arrival_u < math.inf:
            lines.append(
                f"{n} in flight, arrival → scheduler p99: kvpush {_us(_ns(arrival_k))} µs, the "
                f"better upstream {_us(_ns(arrival_u))} µs ({arrival_k / arrival_u:.2f}x)"
            )
    for n in flights:
        default, waiting = by.get((KVPUSH, n)), by.get((KVPUSH_WAIT, n))
        if n == 1 or not (
            default and waiting and default["arrival_p50"] and waiting["arrival_p50"]
        ):
            continue  # one in flight: the next request arrives after the last one ended
        lines.append(
            f"{n} in flight, a request's arrival delay, kvpush by default against the 2 ms idle "
            f"wait: p50 {_us(_ns(default['arrival_p50']))} vs "
            f"{_us(_ns(waiting['arrival_p50']))} µs, p99 {_us(_ns(default['arrival_p99']))} vs "
            f"{_us(_ns(waiting['arrival_p99']))} µs "
            f"({default['arrival_p50'] / waiting['arrival_p50']:.2f}x / "
            f"{default['arrival_p99'] / waiting['arrival_p99']:.2f}x); what remains is the step "
            "in progress, its registrations included (an `expect` per request D admits, work "
            "vLLM's connectors do too, in their worker role, not timed here)"
        )
    lines.append(
        "Not judged here: the goal of issue 18 (in steps that compute, kvpush's connector time "
        f"<= {engine_servers.SHARE_GOAL:.2f} of the better upstream's) counts both roles, and "
        "vLLM's connectors' worker role does not run in this process (their rows time the "
        "scheduler role only): it is judged on real servers, `kvpush bench engine --servers`"
    )
    return lines


def markdown(summaries: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    steps, arrivals = tables(summaries)
    lines = [
        "Produced by `kvpush bench engine` (`lab/kvpush_lab/bench/engine.py`): a decode engine "
        "stepped in-process as `EngineCore` steps it, vLLM's real `Scheduler` with each connector "
        "built by vLLM's factory, every connector hook timed on the engine's thread per step "
        "(wall and thread CPU time). Each request: a 64-token prompt whose KV comes from P, then "
        "8 tokens; the in-flight count held by replacing finished requests as they end. No model "
        "runs, so a step's own time is the scheduler's and the connector's. A *steady* step "
        "computes and admits or ends no request: its connector time is what running requests "
        "cost by themselves; what admitting and ending them costs is in the per-request column. "
        "vLLM's NIXL connectors run their scheduler role only (their worker role needs a NIXL "
        "agent, a P engine and vLLM's distributed state; a stand-in reports each receive done "
        "one step after it began waiting), so only the scheduler columns compare across "
        "connectors; kvpush runs both roles over real endpoints (loopback transport, P a real "
        "kvpush worker in the same process whose KV is ready before D registers).",
        "",
        f"Run: {meta['date']}, vLLM {meta['vllm']}, {meta['cpu']}, load {meta['load']}; "
        f"{meta['rounds']} rounds, the connectors interleaved within each.",
        "",
        steps.markdown(),
        "",
        "A request's arrival delay, from the engine's input queue to the scheduler (vLLM's loop "
        "drains the queue before every step, and sleeps 1 ms after a step that computes nothing "
        "whatever the connector), and the connector's time in a step that computes nothing "
        "(`kvpush idle_wait_ms=2`: the worker waits for a transfer event in such a step, what "
        "kvpush did before this benchmark; the default, `auto`, waits only in an engine of "
        "several workers):",
        "",
        arrivals.markdown(),
        "",
        "Goals (issue 18, item 2):",
        "",
        *[f"- {line}" for line in verdicts(summaries)],
        "",
        "A GPU host runs the same Python on the engine's threads: these figures carry over, "
        "scaled by its CPU's speed; what they leave out is the forward pass, and the NIXL calls "
        "of kvpush's writer thread, which run off the engine's threads.",
    ]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--in-flight",
        default=",".join(str(n) for n in IN_FLIGHT),
        help="comma-separated requests in flight (default 1,64,512)",
    )
    parser.add_argument(
        "--connectors",
        help=f"comma-separated connectors (default: all of {', '.join(CONNECTORS)}; with "
        f"--servers, all of {', '.join(engine_servers.CONNECTORS)})",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds, the connectors interleaved within each (default 3; --quick: 1)",
    )
    parser.add_argument("--quick", action="store_true", help="1 and 16 in flight, few requests")
    parser.add_argument(
        "--servers",
        action="store_true",
        help="on real vLLM server pairs instead (kvpush_lab.bench.engine_servers): upstream's "
        "worker hooks timed too",
    )
    engine_servers.add_arguments(parser)
    parser.add_argument("--markdown", metavar="PATH", help="write the section into this document")
    parser.add_argument(
        "--results",
        metavar="DIR",
        help="JSON results here (default: results/ beside the serving benchmark's runs, "
        "~/.cache/kvpush/results)",
    )


def results_dir(args: argparse.Namespace) -> Path:
    from kvpush_lab.demo_vllm import default_home

    return Path(args.results) if args.results else default_home() / "results"


def requests_for(in_flight: int, quick: bool) -> int:
    """Enough requests for every in-flight count to turn over many times (a step's percentiles
    need hundreds of steps: at 512 in flight one step decodes 512 requests)."""
    if quick:
        return max(16, 4 * in_flight)
    return max(300, 20 * in_flight)


@contextmanager
def _quiet_vllm() -> Iterator[None]:
    import logging

    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        vllm_logger.setLevel(level)


def main(args: argparse.Namespace) -> int:
    if args.servers:
        return engine_servers.main(args)
    try:
        import vllm
    except ImportError as error:
        print(f"kvpush bench engine needs vLLM ({error}): run it in .venv-vllm (scripts/dev bench)")
        return 2
    flights = (1, 16) if args.quick else tuple(int(n) for n in args.in_flight.split(",") if n)
    connectors = [c.strip() for c in (args.connectors or ",".join(CONNECTORS)).split(",")]
    connectors = [c for c in connectors if c]
    unknown = [c for c in connectors if c not in CONNECTORS]
    if unknown:
        print(f"kvpush bench engine: unknown connector(s) {unknown}; known: {list(CONNECTORS)}")
        return 2
    rounds = 1 if args.quick else args.rounds
    by_point: dict[tuple[str, int], list[Run]] = {}
    failed = False
    with tempfile.TemporaryDirectory(prefix="kvpush-engine-") as tmp, _quiet_vllm():
        # Connectors interleaved within each round, so that a slow spell of the host falls on
        # all of them; each round's figures are kept for the spread.
        for round_ in range(rounds):
            for n in flights:
                for connector in connectors:
                    count = requests_for(n, args.quick)
                    print(
                        f"  round {round_ + 1}/{rounds}: {connector:<22} {n:>4} in flight, "
                        f"{count} requests ...",
                        flush=True,
                    )
                    result = run(connector, n, count, Path(tmp), seed=round_)
                    print(
                        f"    {len(result.steps)} steps in {result.seconds:.1f} s; steady steps: "
                        f"connector p50 {_us(summarize(result)['steady']['wall_p50'])} µs; "
                        f"failures {result.failures}; busiest hooks: "
                        + ", ".join(
                            f"{name} {_us(total / calls)} µs avg, max {_us(most)}"
                            for name, (calls, total, most) in sorted(
                                result.hooks.items(), key=lambda item: -item[1][1]
                            )[:2]
                        ),
                        flush=True,
                    )
                    failed |= result.failures > 0
                    by_point.setdefault((connector, n), []).append(result)
    runs = [r for point in by_point.values() for r in point]
    summaries = [summarize_rounds(point) for point in by_point.values()]
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "vllm": vllm.__version__,
        "cpu": report.cpu_model(),
        "load": report.load_average(),
        "rounds": rounds,
    }
    steps, arrivals = tables(summaries)
    print()
    print(steps.text())
    print()
    print(arrivals.text())
    print()
    for line in verdicts(summaries):
        print(f"  {line}")
    results = results_dir(args)
    results.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = results / f"engine-{stamp}.json"
    out.write_text(
        json.dumps(
            {
                "meta": meta,
                "summaries": summaries,
                "runs": [
                    {
                        **{k: v for k, v in asdict(r).items() if k != "steps"},
                        "steps": [asdict(s) for s in r.steps],
                    }
                    for r in runs
                ],
            }
        )
    )
    print(f"\n  results: {out}")
    if args.markdown:
        report.replace_section(Path(args.markdown), SECTION, markdown(summaries, meta))
        print(f"  section '{SECTION}' written to {args.markdown}")
    if failed:
        print("  some requests failed or did not finish: the figures above are not a clean run")
    return 1 if failed else 0
