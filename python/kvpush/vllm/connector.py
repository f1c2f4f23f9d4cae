"""``KvPushConnector``: kvpush as a vLLM ``KVConnectorBase_V1`` (scheduler and worker roles).

Load it with::

    --kv-transfer-config '{"kv_connector": "KvPushConnector",
                           "kv_connector_module_path": "kvpush.vllm",
                           "kv_role": "kv_producer" | "kv_consumer", "engine_id": "..."}'

or by name alone once kvpush is installed (it registers itself through vLLM's plugin entry
point). This class only translates: vLLM objects in, :mod:`kvpush.vllm._scheduler` and
:mod:`kvpush.vllm._worker` decide and act, and their results go back through vLLM's own
channels (``finished_sending``/``finished_recving``/``failed_recving`` and invalid block ids), so
``kv_load_failure_policy`` applies to every failed receive.

Options (``kv_connector_extra_config``): ``side_channel_host``/``side_channel_port`` (default:
``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT``, as vLLM's NIXL connectors; worker ``r`` listens on
port + r), ``secret`` (or env ``KVPUSH_SECRET``: HMAC-sign every control message),
``kv_lease_duration`` (s P keeps finished KV for D, default 30), ``receive_timeout`` (s D waits
for KV, default 120), ``transport`` (``nixl``, or ``loopback`` for in-process tests).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvpush.vllm._layout import Model, TensorView
from kvpush.vllm._scheduler import PushMetadata, PushScheduler
from kvpush.vllm._worker import PushWorker, WorkerConfig

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

logger = logging.getLogger("kvpush.vllm")


class KvPushMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler ships to every worker each step."""

    def __init__(self, push: PushMetadata) -> None:
        self.push = push


def _worker_config(vllm_config: VllmConfig) -> WorkerConfig:
    transfer = vllm_config.kv_transfer_config
    extra = transfer.kv_connector_extra_config or {}
    secret = extra.get("secret") or os.environ.get("KVPUSH_SECRET")
    model = vllm_config.model_config
    return WorkerConfig(
        engine_id=str(transfer.engine_id),
        side_channel_host=str(
            extra.get("side_channel_host")
            or os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost")
        ),
        side_channel_port=int(
            extra.get("side_channel_port") or os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT") or 5600
        ),
        secret=secret.encode() if isinstance(secret, str) else secret,
        ttl=float(extra.get("kv_lease_duration", 30.0)),
        receive_timeout=float(extra.get("receive_timeout", 120.0)),
        transport=str(extra.get("transport", "nixl")),
        model_fingerprint=f"{model.model}|{model.dtype}|{vllm_config.cache_config.cache_dtype}",
    )


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
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = PushScheduler()
            return
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        parallel = vllm_config.parallel_config
        model = vllm_config.model_config
        self._worker = PushWorker(
            _worker_config(vllm_config),
            Model(
                kv_heads=model.get_num_kv_heads(parallel),
                head_size=model.get_head_size(),
                block_size=vllm_config.cache_config.block_size,
                tp_rank=get_tensor_model_parallel_rank(),
                tp_size=parallel.tensor_parallel_size,
            ),
        )

    # ---- class-level configuration --------------------------------------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # Heads outermost inside a block (HND), so P and D with different tensor parallel sizes
        # exchange contiguous head slices; MLA's latent KV has no heads to slice.
        if vllm_config.model_config is None or vllm_config.model_config.use_mla:
            return None
        return "LBHNC"

    # ---- scheduler role -------------------------------------------------------------------

    @property
    def _sched(self) -> PushScheduler:
        assert self._scheduler is not None, "scheduler-role method called on a worker"
        return self._scheduler

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        prompt = len(request.prompt_token_ids or ())
        return self._sched.external_tokens(request.kv_transfer_params, prompt, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or num_external_tokens <= 0:
            return
        self._sched.allocated(
            request.request_id,
            params,
            blocks.get_unhashed_block_ids_all_groups(),
            request.num_computed_tokens,
            len(request.prompt_token_ids or ()),
            num_external_tokens,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KvPushMetadata(self._sched.take_metadata())

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched.transfers_finished(
            set(connector_output.finished_sending or ()),
            set(connector_output.finished_recving or ()),
        )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        normal = request.status in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        )
        return self._sched.finished(
            request.request_id,
            request.kv_transfer_params,
            normal,
            block_ids,
            len(request.prompt_token_ids or ()),
        )

    def has_pending_push_work(self) -> bool:
        return self._sched.has_pending_work()

    def get_finished_count(self) -> int | None:
        return None  # every worker reports each request

    # ---- worker role ----------------------------------------------------------------------

    @property
    def _work(self) -> PushWorker:
        assert self._worker is not None, "worker-role method called on the scheduler"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # Distinct tensors in layer order; layers that share one cache (aliases) count once.
        seen: dict[int, TensorView] = {}
        for tensor in kv_caches.values():
            view = TensorView.of(tensor)
            seen.setdefault(view.data_ptr, view)
        self._work.register(list(seen.values()))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KvPushMetadata)
        self._work.apply(metadata.push)

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # KV arrives whole before the request is scheduled

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        pass  # P's KV is written by the native writer once the request finishes

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending, recving, _ = self._work.take_finished()
        return sending, recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._work.take_finished()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()


# vLLM dispatches some configuration checks on the connector's class name; an external module
# that wants those (e.g. NIXL's SSM state layout) can load kvpush under the upstream name.
NixlPushConnector = KvPushConnector
