"""``KvPushConnector``: kvpush as a vLLM ``KVConnectorBase_V1`` (scheduler and worker roles).

Load it with::

    --kv-transfer-config '{"kv_connector": "KvPushConnector",
                           "kv_connector_module_path": "kvpush.vllm",
                           "kv_role": "kv_producer" | "kv_consumer", "engine_id": "..."}'

or by name alone once kvpush is installed (it registers itself through vLLM's plugin entry
point). This class only translates: vLLM objects in, :mod:`kvpush.vllm._scheduler` and
:mod:`kvpush.vllm._worker` decide and act (the scheduler's instructions to the workers each
step: :mod:`kvpush.vllm.metadata`), and their results go back through vLLM's own
channels (``finished_sending``/``finished_recving``/``failed_recving`` and invalid block ids), so
``kv_load_failure_policy`` applies to every failed receive. No hook raises into vLLM's engine
for one request's sake: kv_transfer_params are read by :mod:`kvpush.vllm._params`, and a bad
request, or an endpoint call that fails, fails that request alone (a local prefill, a failed
receive, a send reported over).

Options (``kv_connector_extra_config``), the environment variables it reads and their
defaults: :mod:`kvpush.vllm.config`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvpush.exceptions import KvPushError
from kvpush.vllm import _stats
from kvpush.vllm._layout import CacheGroups, Model, views_by_group
from kvpush.vllm._scheduler import PushScheduler
from kvpush.vllm._worker import PushWorker
from kvpush.vllm.config import identity, worker_config
from kvpush.vllm.metadata import PushMetadata

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under vLLM's "vllm" logger, so that the server's log shows kvpush's lines at its level.
logger = logging.getLogger("vllm.kvpush")


class KvPushMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler ships to every worker each step."""

    def __init__(self, push: PushMetadata) -> None:
        self.push: PushMetadata | None = push

    def take(self) -> PushMetadata | None:
        """The step's instructions, once: vLLM hands the metadata over twice a step (it binds
        it, then starts the loads), and the second hand-over gets None, leaving the worker as
        the first left it (the step's idleness and streams included)."""
        push, self.push = self.push, None
        return push


class KvPushStats(KVConnectorStats):  # type: ignore[misc]
    """Transfer statistics of one interval, summed over workers (see ``_stats``)."""

    data: dict[str, Any]

    def __post_init__(self) -> None:
        if not self.data:
            self.data = _stats.empty()

    def reset(self) -> None:
        self.data = _stats.empty()

    def aggregate(self, other: KVConnectorStats) -> KvPushStats:
        _stats.aggregate(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return _stats.reduce(self.data)

    def is_empty(self) -> bool:
        return _stats.is_empty(self.data)


class KvPushPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """``vllm:kvpush_*`` Prometheus metrics, one series per engine."""

    SECONDS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        from vllm.v1.metrics.utils import create_metric_per_engine

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            metric = self._histogram_cls(
                name=f"vllm:kvpush_{name}",
                documentation=doc,
                buckets=list(buckets),
                labelnames=self._labelnames,
            )
            return create_metric_per_engine(metric, self.per_engine_labelvalues)

        def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Any:
            return self._counter_cls(
                name=f"vllm:kvpush_{name}",
                documentation=doc,
                labelnames=[*self._labelnames, *labels],
            )

        self._histograms = {
            "bytes": histogram(
                "bytes", "Bytes per KV transfer.", [2 ** (10 + i) for i in range(1, 25, 2)]
            ),
            "descriptors": histogram(
                "descriptors",
                "Descriptor runs per WRITE (after merging).",
                [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536],
            ),
            "post_seconds": histogram("post_seconds", "P: match to WRITE posted.", self.SECONDS),
            "transfer_seconds": histogram(
                "transfer_seconds",
                "P: WRITE posted to done; D: registered to KV here.",
                self.SECONDS,
            ),
            "registration_wait_seconds": histogram(
                "registration_wait_seconds", "P: KV ready to D's registration.", self.SECONDS
            ),
            "step_wait_seconds": histogram(
                "step_wait_seconds", "Scheduler decision to worker action.", self.SECONDS
            ),
        }
        self._transfers = counter("transfers", "Finished KV transfers.", ["role"])
        self._failures = counter("failures", "Failed KV transfers by reason.", ["reason"])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, per_engine in self._histograms.items():
            for value in transfer_stats_data.get(name, ()):
                per_engine[engine_idx].observe(value)
        for role, key in (("send", "sent"), ("receive", "received")):
            if transfer_stats_data.get(key):
                self._transfers.labels(*labels, role).inc(transfer_stats_data[key])
        for reason, count in transfer_stats_data.get("failures", {}).items():
            self._failures.labels(*labels, reason).inc(count)


class KvPushConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """Push-based KV transfer: D registers its blocks while P computes; P's native writer
    thread WRITEs the moment both halves are present."""

    # D's prompt tokens that arrive through kvpush count as cached from a peer in vLLM's
    # metrics (`vllm:prompt_tokens_cached_by_source_total{source="p2p"}`).
    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._scheduler: PushScheduler | None = None
        self._worker: PushWorker | None = None
        # Both roles read vLLM's KV cache groups and refuse here, at startup, a model whose
        # groups kvpush cannot move (Mamba/SSM state), never one request at a time.
        if role == KVConnectorRole.SCHEDULER:
            groups = None if kv_cache_config is None else CacheGroups.from_vllm(kv_cache_config)
            layerwise = worker_config(vllm_config).layerwise
            self._scheduler = PushScheduler(identity(vllm_config), groups, layerwise)
            return
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        # The KV cache layout vLLM resolved, its attention backends, MLA and the KV cache
        # groups: what the layout reader needs to read the views instead of guessing from their
        # shapes.
        model = Model.from_vllm(
            vllm_config,
            get_tensor_model_parallel_rank(),
            get_pp_group().rank_in_group,
            kv_cache_config,
        )
        self._groups = model.groups
        self._worker = PushWorker(worker_config(vllm_config), model)

    # ---- class-level configuration --------------------------------------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # Heads outermost inside a block (HND), so P and D with different tensor parallel sizes
        # exchange contiguous head slices; MLA's latent KV has no heads to slice.
        if vllm_config.model_config is None or vllm_config.model_config.use_mla:
            return None
        return "LBHNC"

    # ---- scheduler role -------------------------------------------------------------------
    #
    # Every hook below runs inside vLLM's engine step, where an exception kills the engine and
    # every request on it. Each one hands plain values to PushScheduler, and any failure, with
    # its request, to PushScheduler's handler for that hook, which decides what happens to that
    # request alone (prefill it locally, fail its KV load, free its blocks).

    def on_new_request(self, request: Request) -> None:
        sched = self._scheduler
        if sched is None:
            return
        try:
            if not sched.admit(request.request_id, request.kv_transfer_params):
                request.kv_transfer_params = None
        except Exception as error:
            sched.admit_failed(request.request_id, error)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        sched = self._scheduler
        if sched is None:
            return 0, False
        request_id, params = request.request_id, request.kv_transfer_params
        try:
            prompt = len(request.prompt_token_ids or ())
            return sched.external_tokens(request_id, params, prompt, num_computed_tokens)
        except Exception as error:
            return sched.match_failed(request_id, params, error)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        sched = self._scheduler
        if sched is None:
            return
        request_id, params = request.request_id, request.kv_transfer_params
        uncached: Sequence[Sequence[int]] = ()
        try:
            if num_external_tokens > 0:
                uncached = blocks.get_unhashed_block_ids_all_groups()
            sched.allocated(
                request_id,
                params,
                uncached,
                request.num_computed_tokens,
                len(request.prompt_token_ids or ()),
                num_external_tokens,
            )
        except Exception as error:
            sched.alloc_failed(request_id, params, num_external_tokens, error, uncached)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._scheduler is None:
            return KvPushMetadata(PushMetadata())
        idle = getattr(scheduler_output, "total_num_scheduled_tokens", None) == 0
        self._prefills_ending(self._scheduler, scheduler_output)
        return KvPushMetadata(self._scheduler.take_metadata(idle))

    @staticmethod
    def _prefills_ending(sched: PushScheduler, scheduler_output: SchedulerOutput) -> None:
        """Layer-wise push: the step's new and continued requests, for P's streams (see
        ``PushScheduler.prefill_ends``, ``prefill_continues``). A request that fails here just
        goes whole."""
        if not sched.streams_layers:
            return
        scheduled = scheduler_output.num_scheduled_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for index, request_id in enumerate(cached.req_ids):
            try:
                sched.prefill_continues(
                    request_id,
                    cached.new_block_ids[index],
                    request_id in cached.resumed_req_ids,
                    cached.num_computed_tokens[index],
                    scheduled.get(request_id, 0),
                )
            except Exception:
                logger.exception(
                    "kvpush: request %s: its layers will not stream; please report this",
                    request_id,
                )
        for new in scheduler_output.scheduled_new_reqs:
            try:
                sched.prefill_ends(
                    new.req_id,
                    new.block_ids,
                    len(new.prompt_token_ids or ()),
                    new.num_computed_tokens,
                    scheduled.get(new.req_id, 0),
                    getattr(new.sampling_params, "max_tokens", None),
                )
            except Exception:
                logger.exception(
                    "kvpush: request %s: its layers will not stream; please report this",
                    new.req_id,
                )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is None:
            return
        try:
            self._scheduler.transfers_finished(
                set(connector_output.finished_sending or ()),
                set(connector_output.finished_recving or ()),
            )
        except Exception:
            logger.exception("kvpush: update_connector_output failed; please report this")

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        sched = self._scheduler
        if sched is None:
            return False, None
        request_id, params = request.request_id, request.kv_transfer_params
        try:
            from vllm.v1.request import RequestStatus

            normal = request.status in (
                RequestStatus.FINISHED_LENGTH_CAPPED,
                RequestStatus.FINISHED_STOPPED,
            )
            return sched.finished(
                request_id, params, normal, block_ids, len(request.prompt_token_ids or ())
            )
        except Exception as error:
            return sched.finish_failed(request_id, params, error)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvPushStats:
        return KvPushStats(data=data or _stats.empty())

    @classmethod
    def build_prom_metrics(cls, *args: Any) -> KvPushPromMetrics:
        return KvPushPromMetrics(*args)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_work()

    def get_finished_count(self) -> int | None:
        return None  # every worker reports each request

    # ---- worker role ----------------------------------------------------------------------
    #
    # PushWorker never raises for one request's sake (an endpoint's refusal fails that request
    # alone); the guards here catch its bugs, which must not kill the engine either.

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # At startup: a cache kvpush cannot move is refused here, with the reason.
        if self._worker is None:
            raise KvPushError("register_kv_caches called on the scheduler's connector")
        self._worker.register(*views_by_group(kv_caches, self._groups))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # Act on the step's instructions here, before the forward pass, not in start_load_kv:
        # vLLM calls that after the forward is launched, which on a CPU (or any synchronous
        # model runner) is after the whole step has run, so P's WRITE and D's registration
        # would wait for a step they do not depend on. What P sends was computed by an earlier
        # step (the scheduler saw its output), and what D registers is allocated and unused.
        super().bind_connector_metadata(connector_metadata)
        self._apply(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.has_connector_metadata():
            # Normally nothing left: bind_connector_metadata acted.
            self._apply(self._get_connector_metadata())

    def _apply(self, metadata: KVConnectorMetadata) -> None:
        if self._worker is None or not isinstance(metadata, KvPushMetadata):
            return
        push = metadata.take()
        if push is None:
            return  # bound already (start_load_kv after bind_connector_metadata)
        try:
            self._worker.apply(push)
        except Exception:
            logger.exception("kvpush: a step's instructions failed; please report this")

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # KV arrives whole before the request is scheduled

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # Layer-wise push: the layer ran (a CPU forward is synchronous) or its kernels are
        # queued (GPU: a CUDA event recorded here, waited on off this thread); once its KV of
        # the step's streams is final the native writer writes it where D registered.
        # Otherwise P's KV is written once the request finishes.
        if self._worker is not None:
            self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.end_forward()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending, recving, _ = self._take_finished()
        return sending, recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._take_finished()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def _take_finished(self) -> tuple[set[str], set[str], set[str]]:
        if self._worker is None:
            return set(), set(), set()
        try:
            return self._worker.take_finished()
        except Exception:
            logger.exception("kvpush: finished transfers not collected; please report this")
            return set(), set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set() if self._worker is None else self._worker.take_load_errors()

    def get_kv_connector_stats(self) -> KvPushStats | None:
        if self._worker is None:
            return None  # vLLM asks the scheduler too; transfers are counted by the workers
        try:
            stats = self._worker.take_stats()
        except Exception:
            logger.exception("kvpush: transfer statistics lost; please report this")
            return None
        return None if stats is None else KvPushStats(data=stats)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()


# vLLM dispatches some configuration checks on the connector's class name; an external module
# that wants those (e.g. NIXL's SSM state layout) can load kvpush under the upstream name.
NixlPushConnector = KvPushConnector
