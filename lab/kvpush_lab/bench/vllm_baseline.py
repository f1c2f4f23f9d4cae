"""vLLM's own push-writer code as the baseline of ``kvpush bench control``: the installed
``NixlPushConnectorWorker``, on a stub instance, called the way vLLM's unit tests call it.

vLLM's tests build a ``MagicMock(spec=NixlConnectorWorker)``, set the attributes a method reads
and bind the real method to it. :class:`VllmWriter` does the same with a plain instance of the
real class made without ``__init__`` (no vLLM config, NIXL agent or writer thread), so every
method is vLLM's and attribute reads cost what they cost in a real worker. What stands in for
the world outside the writer:

* ``_ensure_handshake`` returns ``None``: the P→D handshake is done, as for every request after
  a peer's first;
* ``nixl_wrapper`` records what ``make_prepped_xfer`` is given (the descriptor ids) and returns a
  handle; ``transfer`` does nothing. NIXL's own work on those ids (C++) is not measured.

The topology and TP mapping are vLLM's own (``TransferTopology``, ``EngineTransferInfo``,
``compute_tp_mapping``). This is the only module of ``kvpush_lab.bench`` that imports vLLM.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np

P_ENGINE = "prefill-0"
D_ENGINE = "decode-0"


class VllmUnavailableError(RuntimeError):
    """vLLM (with its NIXL push connector) cannot be imported here."""


def _vllm() -> Any:
    try:
        from vllm.distributed.kv_transfer.kv_connector import utils
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import push_worker, tp_mapping
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
            NixlAgentMetadata,
        )
        from vllm.v1.kv_cache_interface import FullAttentionSpec
    except ImportError as error:
        raise VllmUnavailableError(
            f"vLLM's NIXL push connector is not importable ({error}); run with the vLLM stack "
            "(scripts/setup-vllm, then .venv-vllm/bin/python -m kvpush.cli bench control)"
        ) from None

    class Api:
        Worker = push_worker.NixlPushConnectorWorker
        TransferTopology = utils.TransferTopology
        EngineTransferInfo = utils.EngineTransferInfo
        compute_tp_mapping = tp_mapping.compute_tp_mapping
        AgentMetadata = NixlAgentMetadata
        AttentionSpec = FullAttentionSpec

    return Api


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


@dataclass(frozen=True)
class Side:
    """One worker's KV cache as vLLM registers it: one region per layer (K and V packed in a
    block), ``kernel_blocks`` kernel blocks of ``block_bytes`` each per region."""

    base: int
    layers: int
    block_tokens: int
    kernels_per_block: int
    kernel_blocks: int
    block_bytes: int

    @property
    def region_bytes(self) -> int:
        return self.kernel_blocks * self.block_bytes

    def region_bases(self) -> list[int]:
        return [self.base + layer * self.region_bytes for layer in range(self.layers)]


class _RecordingNixl:
    """Stands in for vLLM's ``nixl_wrapper``: keeps the last WRITE's descriptor ids."""

    def __init__(self) -> None:
        self.local_ids: Any = None
        self.remote_ids: Any = None

    def make_prepped_xfer(
        self, op: str, local: int, local_ids: Any, remote: int, remote_ids: Any, notif_msg: bytes
    ) -> int:
        self.local_ids, self.remote_ids = local_ids, remote_ids
        return 1

    def transfer(self, handle: int) -> str:
        return "PROC"


class VllmWriter:
    """P's push writer of vLLM, on a stub worker: ``pending`` D registrations and finished P
    blocks live where vLLM keeps them (``_pending_d_registrations``, ``_push_finished_blocks``).
    """

    def __init__(self, p: Side, d: Side, heads: int) -> None:
        api = _vllm()
        self._api = api
        self.p, self.d = p, d
        w = object.__new__(api.Worker)
        topo = api.TransferTopology(
            tp_rank=0,
            tp_size=1,
            block_size=p.block_tokens,
            engine_id=P_ENGINE,
            is_mla=False,
            is_mamba=False,
            total_num_kv_heads=heads,
            attn_backends=[],
        )
        topo.register_remote_engine(
            D_ENGINE,
            api.EngineTransferInfo(
                remote_tp_size=1,
                remote_block_len=d.block_bytes,
                remote_block_size=d.block_tokens,
                remote_physical_blocks_per_logical=d.kernels_per_block,
            ),
        )
        spec = object.__new__(api.AttentionSpec)
        w.transfer_topo = topo
        w.engine_id = P_ENGINE
        w.world_size = 1
        w.device_id = 0
        w._group_spec_types = (api.AttentionSpec,)
        w.kv_cache_config = _Namespace(transfer_groups=[_Namespace(kv_cache_spec=spec)])
        w.tp_mappings = {D_ENGINE: api.compute_tp_mapping(topo, 1, w._group_spec_types)}
        w._ensure_handshake = lambda *args, **kwargs: None
        w._engine_last_active = {}
        w._physical_blocks_per_logical_kv_block = p.kernels_per_block
        w.use_mla = False
        w._has_mamba = False
        w._is_csa_linear = False
        w._transfer_layer_group_ids = ()
        w._transfer_layer_region_indices = ()
        w._region_is_mla = [False] * p.layers
        w.num_regions = p.layers
        w.block_len_per_layer = [p.block_bytes] * p.layers
        w.block_stride_per_layer = [p.block_bytes] * p.layers
        w.region_num_blocks = [p.kernel_blocks] * p.layers
        w.region_group_ids = [0] * p.layers
        w._uses_region_group_mapping = False
        w.dst_num_blocks = {P_ENGINE: p.kernel_blocks, D_ENGINE: d.kernel_blocks}
        w.dst_region_num_blocks = {
            P_ENGINE: [p.kernel_blocks] * p.layers,
            D_ENGINE: [d.kernel_blocks] * d.layers,
        }
        w.dst_region_group_ids = {P_ENGINE: [0] * p.layers, D_ENGINE: [0] * d.layers}
        w.dst_uses_region_group_mapping = {P_ENGINE: False, D_ENGINE: False}
        w.src_xfer_handles_by_block_size = {d.block_tokens: 11}
        w.dst_xfer_side_handles = {D_ENGINE: {0: 22}}
        w._sending_transfers_lock = threading.Lock()
        w._sending_transfers = defaultdict(list)
        w.nixl_wrapper = _RecordingNixl()
        w._pending_d_registrations = {}
        w._push_finished_blocks = {}
        self.worker = w

    # --- the two halves, as the writer thread keeps them while unmatched -------------------

    def registration(self, d_request: str, d_blocks: list[int]) -> dict[str, Any]:
        """D's PUSH_REG payload, as ``_handle_push_reg_notif`` decodes it."""
        return {
            "request_id": d_request,
            "decode_engine_id": D_ENGINE,
            "decode_host": "127.0.0.1",
            "decode_port": 5600,
            "decode_tp_size": 1,
            "local_block_ids": [d_blocks],
        }

    def park_registration(self, d_request: str, d_blocks: list[int]) -> None:
        """D's registration arrived first and waits (``_handle_push_reg_notif``'s no-match
        branch)."""
        self.worker._pending_d_registrations[d_request] = self.registration(d_request, d_blocks)

    def park_finished(self, p_request: str, p_blocks: list[int]) -> None:
        """P's KV is ready first and waits (the writer loop's no-match branch)."""
        self.worker._push_finished_blocks[p_request] = ([*p_blocks],)

    # --- measured --------------------------------------------------------------------------

    def ready(self, p_request: str, p_blocks: tuple[list[int], ...]) -> bool:
        """P's KV is ready while D's registration waits: the writer loop's step 3, from the
        match to the WRITE posted (``_pop_matching_registration`` + ``_do_start_push_kv``)."""
        matched = self.worker._pop_matching_registration(p_request)
        if matched is None:
            return False
        self.worker._do_start_push_kv(p_request, p_blocks, matched)
        return True

    def match_ready(self, p_request: str) -> bool:
        """Only the matching of :meth:`ready`: ``_pop_matching_registration``."""
        return self.worker._pop_matching_registration(p_request) is not None

    def match_registration(self, d_request: str) -> bool:
        """D's registration arrives while P's blocks wait: ``_pop_matching_finished_blocks``."""
        return self.worker._pop_matching_finished_blocks(d_request) is not None

    def forget_writes(self) -> None:
        self.worker._sending_transfers.clear()

    def pending(self) -> int:
        w = self.worker
        return len(w._pending_d_registrations) + len(w._push_finished_blocks)

    # --- what was posted ---------------------------------------------------------------------

    def posted_descriptors(self) -> int:
        """How many descriptor ids the last WRITE handed ``make_prepped_xfer``."""
        return len(self.worker.nixl_wrapper.local_ids)

    def posted_triples(self) -> np.ndarray:
        """The last WRITE as ``(src, dst, len)`` rows, its ids looked up in the descriptor
        tables vLLM prepares for P and D (``_build_fa_local``, ``_build_fa_remote``)."""
        w, nixl = self.worker, self.worker.nixl_wrapper
        ratio = self.p.block_tokens // self.d.block_tokens
        local = w._build_fa_local(self.p.region_bases(), ratio)
        meta = self._api.AgentMetadata(
            engine_id=D_ENGINE,
            agent_metadata=b"",
            kv_caches_base_addr=self.d.region_bases(),
            device_id=0,
            num_blocks=self.d.kernel_blocks,
            block_lens=[self.d.block_bytes] * self.d.layers,
            block_strides=[self.d.block_bytes] * self.d.layers,
            kv_cache_layout="NHD",
            block_size=self.d.block_tokens,
            ssm_sizes=(0, 0),
            attn_backend_name="CPU_ATTN",
            physical_blocks_per_logical_kv_block=self.d.kernels_per_block,
            region_num_blocks=[self.d.kernel_blocks] * self.d.layers,
        )
        remote = w._build_fa_remote(w.tp_mappings[D_ENGINE], meta, ratio)
        src = local[np.asarray(nixl.local_ids, dtype=np.int64)]
        dst = remote[np.asarray(nixl.remote_ids, dtype=np.int64)]
        if not np.array_equal(src[:, 1], dst[:, 1]):
            raise AssertionError("vLLM paired descriptors of different lengths")
        return np.stack([src[:, 0], dst[:, 0], src[:, 1]], axis=1)


class _Namespace:
    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)
