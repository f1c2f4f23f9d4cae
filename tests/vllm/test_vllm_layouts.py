"""KV caches allocated by vLLM's own code, for every ``KVCacheLayout`` and the main backends,
moved between P and D through kvpush's layout reader and planner, and checked byte for byte.

Each worker's cache is built exactly as vLLM's model runner builds it
(``GPUModelRunner.initialize_kv_cache``, ``vllm/v1/worker/gpu_model_runner.py``): the backend's
``customize_attention_spec``, ``get_kv_cache_config_from_groups`` (strides of the backing buffer
for the layout), ``prepare_kernel_block_sizes`` and ``allocate_kv_cache`` (one ``[B, H, N, C]``
view per layer through ``create_kv_cache_views``), all from the installed vLLM, on the CPU.
FlashInfer's module needs the ``flashinfer`` package, so its two class methods used here are
reproduced (see :class:`FlashInferStandIn`). The reference for D's cache is computed from the
logical ``[B, H, N, C]`` indexing of the views, independently of the planner; the whole backing
buffer is compared, so a byte written where it should not be fails as surely as a missing one.

Needs vLLM (``.venv-vllm``); the tests that need none run everywhere.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from importlib.util import find_spec
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvpush._native import lab
from kvpush.exceptions import LayoutError
from kvpush.vllm._layout import (
    KV_CACHE_LAYOUTS,
    CacheLayout,
    Model,
    TensorView,
    layout_from_caches,
)

needs_vllm = pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed")

LAYOUTS = list(KV_CACHE_LAYOUTS)
HEAD_CONTIGUOUS = ["LBHNC", "BLHNC"]  # a block's heads are [H][N][C]: heads can be sliced
LAYERS, BLOCKS, TOTAL_HEADS, HEAD = 3, 32, 4, 4
MLA_HEAD = 12  # kv_lora_rank 8 + rope 4, one latent per token


class FlashInferStandIn:
    """``FlashInferBackend``'s methods that KV cache allocation calls, as in
    ``vllm/v1/attention/backends/flashinfer.py``: ``customize_spec`` returns a non-NVFP4 spec
    unchanged (lines 432-445) and, off Blackwell, the kernel block sizes are 16, 32 and 64
    (lines 460-480)."""

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        return spec

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int]:
        return [16, 32, 64]


def backend(name: str) -> Any:
    if name == "FLASHINFER":
        return FlashInferStandIn
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
    from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    classes = [
        CPUAttentionBackend,
        CPUMLABackend,
        FlashAttentionBackend,
        FlashMLABackend,
        TritonMLABackend,
        TritonAttentionBackend,
    ]
    return next(c for c in classes if c.get_name() == name)


@dataclass
class Worker:
    """One rank's KV cache as vLLM allocated it, and what kvpush reads from it."""

    views: list[Any]  # torch tensors [B, H, N, C], one per layer
    raw: Any  # the whole backing allocation as uint8
    model: Model
    cache: CacheLayout

    def byte_views(self, raw: Any) -> list[Any]:
        """The layers' [B, H, N, C-bytes] views over ``raw`` (this buffer or a copy of it)."""
        import torch

        out = []
        for v in self.views:
            b = v.view(torch.uint8)
            out.append(torch.as_strided(raw, b.shape, b.stride(), b.storage_offset()))
        return out


def allocate(
    backend_name: str,
    layout_name: str,
    block_size: int,
    *,
    tp: tuple[int, int] = (0, 1),
    seed: int | None = None,
) -> Worker:
    """One rank's caches, allocated as vLLM's GPU model runner does (on the CPU)."""
    import torch
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import (
        allocate_kv_cache,
        customize_attention_spec,
        prepare_kernel_block_sizes,
    )

    attn = backend(backend_name)
    use_mla = backend_name.endswith("_MLA") or backend_name == "FLASHMLA"
    heads = 1 if use_mla else TOTAL_HEADS // tp[1]
    if use_mla:
        spec = MLAAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=MLA_HEAD, dtype=torch.float16
        )
    else:
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=heads, head_size=HEAD, dtype=torch.float16
        )
    spec = customize_attention_spec(attn, spec)
    layout = KVCacheLayout[layout_name]
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    # The attributes get_kv_cache_config_from_groups reads (kv_cache_utils.py:1588-1686).
    vllm_config = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: layout,
            num_gpu_blocks_override=BLOCKS,
            prefix_cache_retention_interval=None,
        ),
    )
    config = get_kv_cache_config_from_groups(
        vllm_config, [KVCacheGroupSpec(names, spec)], available_memory=1 << 30
    )
    attn_groups = [[SimpleNamespace(backend=attn, kv_cache_spec=spec)]]
    kernel_block_sizes = prepare_kernel_block_sizes(config, attn_groups)
    caches = allocate_kv_cache(config, torch.device("cpu"), layout, kernel_block_sizes)
    views = [caches[n] for n in names]
    raw = torch.tensor([], dtype=torch.uint8).set_(views[0].untyped_storage())
    rng = np.random.default_rng(seed if seed is not None else 1000 + tp[0])
    raw.copy_(torch.from_numpy(rng.integers(0, 256, raw.numel(), dtype=np.uint8)))
    model = Model(
        kv_heads=heads,
        head_size=MLA_HEAD if use_mla else HEAD,
        block_size=block_size,
        tp_rank=tp[0],
        tp_size=tp[1],
        kv_cache_layout=layout_name,
        backends=(attn.get_name(),),
        use_mla=use_mla,
    )
    cache = layout_from_caches([TensorView.of(v) for v in views], model)
    return Worker(views, raw, model, cache)


@dataclass(frozen=True)
class Request:
    num_tokens: int
    p_blocks: list[int]
    d_blocks: list[int]
    d_first: int  # D's first uncached token (its prefix cache holds the ones before)


def requests(p: Worker, d: Worker) -> list[Request]:
    """Three requests over scattered blocks: partial last blocks, and one D prefix hit."""
    pb, db = p.model.block_size, d.model.block_size
    rng = np.random.default_rng(7)
    p_free, d_free = list(rng.permutation(BLOCKS)), list(rng.permutation(BLOCKS))
    out = []
    for tokens, d_first in ((70, 0), (45, 0), (db + 37, db)):
        p_n, d_n = -(-tokens // pb), -(-(tokens - d_first) // db)
        p_ids, d_ids = p_free[:p_n], d_free[:d_n]
        p_free, d_free = p_free[p_n:], d_free[d_n:]
        out.append(Request(tokens, [int(b) for b in p_ids], [int(b) for b in d_ids], d_first))
    return out


def slot(
    blocks: list[int], first: int, token: int, block_size: int, kernel: int
) -> tuple[int, int]:
    """(kernel block, row) of ``token`` in a list of vLLM blocks: block_table.py's mapping of a
    manager block to its ``block_size // kernel`` kernel blocks."""
    block, offset = divmod(token - first, block_size)
    return blocks[block] * (block_size // kernel) + offset // kernel, offset % kernel


def expected_cache(p: Worker, d: Worker, reqs: list[Request]) -> Any:
    """D's whole buffer as it must be after the requests: its own bytes, but every (token, head)
    the pair shares copied from P by the logical [B, H, N, C] indexing."""
    expected = d.raw.clone()
    p_views, d_views = p.byte_views(p.raw), d.byte_views(expected)
    if p.model.use_mla:
        p_heads = d_heads = slice(None)
    else:
        p_first = p.model.tp_rank * p.model.kv_heads
        d_first = d.model.tp_rank * d.model.kv_heads
        first = max(p_first, d_first)
        end = min(p_first + p.model.kv_heads, d_first + d.model.kv_heads)
        if first >= end:
            return expected
        p_heads = slice(first - p_first, end - p_first)
        d_heads = slice(first - d_first, end - d_first)
    p_kernel, d_kernel = p.views[0].shape[2], d.views[0].shape[2]
    for r in reqs:
        end_token = d.cache.tokens_to_write(r.num_tokens)
        for token in range(r.d_first, end_token):
            pk, pn = slot(r.p_blocks, 0, token, p.model.block_size, p_kernel)
            dk, dn = slot(r.d_blocks, r.d_first, token, d.model.block_size, d_kernel)
            for pv, dv in zip(p_views, d_views, strict=True):
                dv[dk, d_heads, dn] = pv[pk, p_heads, pn]
    return expected


def move(p: Worker, d: Worker, reqs: list[Request]) -> int:
    """Plans every request P -> D and copies the runs; returns the bytes written."""
    planner = lab.Planner(p.cache.layout, d.cache.layout)
    written = 0
    for i, r in enumerate(reqs):
        plan = planner.plan(
            f"req-{i}",
            d.cache.tokens_to_write(r.num_tokens),
            [r.p_blocks],
            [r.d_blocks],
            src_first_tokens=[0],
            dst_first_tokens=[r.d_first],
        )
        for src, dst, n in plan.runs():
            ctypes.memmove(dst, src, n)
        written += plan.bytes
    return written


def assert_same_bytes(actual: Any, expected: Any) -> None:
    differ = (actual != expected).nonzero().flatten()
    assert differ.numel() == 0, (
        f"{differ.numel()} of {actual.numel()} bytes of D's cache differ from the reference, "
        f"first at byte {int(differ[0])}"
    )


def transfer_and_check(p: Worker, d: Worker) -> None:
    reqs = requests(p, d)
    expected = expected_cache(p, d, reqs)
    assert not bool((expected == d.raw).all()), "the requests must change D's cache"
    written = move(p, d, reqs)
    assert written > 0
    assert_same_bytes(d.raw, expected)


# ---- token-level translation: every layout, the backends whose C is one token's cell ---------


@needs_vllm
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend_name", ["FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "TRITON_MLA"])
def test_p16_to_d32_lands_every_token_where_d_expects_it(backend_name: str, layout: str) -> None:
    if backend_name == "FLASHINFER" and layout == "LHBNC":
        pytest.skip("FlashInfer has no LHBNC (get_flashinfer_layout_string, backends/utils.py)")
    p = allocate(backend_name, layout, 16, seed=1)
    d = allocate(backend_name, layout, 32, seed=2)
    assert not p.cache.whole_blocks
    assert not d.cache.whole_blocks
    transfer_and_check(p, d)


@needs_vllm
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
@pytest.mark.parametrize("backend_name", ["FLASHINFER", "FLASHMLA"])
def test_kernel_blocks_smaller_than_vllm_blocks(backend_name: str, layout: str) -> None:
    # FlashInfer's largest kernel block is 64 tokens and FlashMLA's only one is 64: vLLM splits
    # D's 128-token blocks into two kernel blocks (prepare_kernel_block_sizes), which it does
    # for layer-compact layouts only (create_kv_cache_views refuses the others).
    p = allocate(backend_name, layout, 64, seed=1)
    d = allocate(backend_name, layout, 128, seed=2)
    assert d.views[0].shape[2] == 64
    assert d.cache.layout.kernel_block_tokens == 64
    transfer_and_check(p, d)


@needs_vllm
@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_block_outermost_and_layer_compact_pair(layout: str) -> None:
    other = "BLHNC" if layout == "LBHNC" else "LBHNC"
    transfer_and_check(
        allocate("FLASH_ATTN", layout, 16, seed=1), allocate("FLASH_ATTN", other, 32, seed=2)
    )


# ---- head slicing: P at tensor parallel size 1, D at 2 ---------------------------------------


@needs_vllm
@pytest.mark.parametrize("layout", HEAD_CONTIGUOUS)
def test_heads_are_sliced_between_tp_sizes(layout: str) -> None:
    p = allocate("FLASH_ATTN", layout, 16, tp=(0, 1), seed=1)
    assert p.cache.slices_heads
    for rank in range(2):
        d = allocate("FLASH_ATTN", layout, 32, tp=(rank, 2), seed=2 + rank)
        transfer_and_check(p, d)


@needs_vllm
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_latent_is_replicated_across_tp_sizes(layout: str) -> None:
    p = allocate("TRITON_MLA", layout, 16, tp=(0, 1), seed=1)
    for rank in range(2):
        d = allocate("TRITON_MLA", layout, 32, tp=(rank, 2), seed=2 + rank)
        assert (d.cache.layout.tp_rank, d.cache.layout.tp_size) == (0, 1)
        transfer_and_check(p, d)


@needs_vllm
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name not in HEAD_CONTIGUOUS])
def test_layouts_without_contiguous_head_slices_need_equal_tp(layout: str) -> None:
    p = allocate("FLASH_ATTN", layout, 16, tp=(0, 1))
    d = allocate("FLASH_ATTN", layout, 16, tp=(0, 2))
    assert not p.cache.slices_heads
    assert p.cache.agreement() != d.cache.agreement(), "the handshake must tell them apart"
    with pytest.raises(LayoutError, match="P and D cannot exchange KV"):
        lab.Planner(p.cache.layout, d.cache.layout)
    # Equal sizes: rank 1 of each side pairs up.
    transfer_and_check(
        allocate("FLASH_ATTN", layout, 16, tp=(1, 2), seed=1),
        allocate("FLASH_ATTN", layout, 32, tp=(1, 2), seed=2),
    )


# ---- vLLM's CPU MLA backend: the one MLA cache a CPU server runs (tests/e2e/test_kvpush_mla.py)


@needs_vllm
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_cpu_mla_moves_token_by_token(layout: str) -> None:
    # vLLM's CPU platform forces 16-token blocks for CPU_MLA; the latent still moves per token.
    p = allocate("CPU_MLA", layout, 16, seed=1)
    d = allocate("CPU_MLA", layout, 16, seed=2)
    assert p.cache.opaque_because is None
    assert not p.cache.whole_blocks
    assert p.cache.agreement() == d.cache.agreement() == ""
    transfer_and_check(p, d)


@needs_vllm
def test_cpu_mla_writes_each_token_where_the_layout_reads_it() -> None:
    """vLLM's own cache write (``CPUMLAImpl.do_kv_cache_update``) puts token ``slot``'s latent
    and rope into C of ``[slot // 16, 0, slot % 16]``: the cell kvpush moves it from."""
    import torch
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    w = allocate("CPU_MLA", "LBNHC", 16)
    rank, rope = MLA_HEAD - 4, 4
    slots = torch.tensor([0, 5, 16, 37, 16 * (BLOCKS - 1) + 15])
    latent = torch.randn(len(slots), rank, dtype=torch.float16)
    k_pe = torch.randn(len(slots), 1, rope, dtype=torch.float16)
    impl = object.__new__(CPUMLAImpl)  # the update reads nothing of the instance
    impl.do_kv_cache_update(latent, k_pe, w.views[0], slots, "auto", torch.tensor(1.0))
    for i, s in enumerate(slots.tolist()):
        cell = w.views[0][s // 16, 0, s % 16]
        assert torch.equal(cell, torch.cat([latent[i], k_pe[i, 0]])), f"slot {s}"


# ---- opaque blocks: CPU attention moves whole blocks, as before ------------------------------


@needs_vllm
def test_cpu_attention_blocks_move_whole_exactly_as_before() -> None:
    # CPU_ATTN supports LBHNC only (cpu_attn.py:73-75).
    p = allocate("CPU_ATTN", "LBHNC", 32, seed=1)
    d = allocate("CPU_ATTN", "LBHNC", 32, seed=2)
    assert p.cache.whole_blocks
    assert p.cache.opaque_because is not None
    # The layout of vLLM before 0.28 (read by shape) is the same one.
    legacy = layout_from_caches(
        [TensorView.of(v) for v in p.views],
        Model(p.model.kv_heads, HEAD, 32),
    )
    assert legacy.layout.to_dict() == p.cache.layout.to_dict()
    assert legacy.agreement() == p.cache.agreement()
    transfer_and_check(p, d)


@needs_vllm
@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (4, 2)])
def test_cpu_attention_whole_blocks_are_sliced_by_head_between_tp_sizes(
    p_tp: int, d_tp: int
) -> None:
    # Each head's [N][C] slab is whole (K transposed inside it), so a D rank gets, from every P
    # rank holding some of its heads, those heads' slabs of whole blocks.
    for d_rank in range(d_tp):
        d = allocate("CPU_ATTN", "LBHNC", 32, tp=(d_rank, d_tp), seed=10 + d_rank)
        assert d.cache.whole_blocks
        assert d.cache.slices_heads
        for p_rank in range(p_tp):
            p = allocate("CPU_ATTN", "LBHNC", 32, tp=(p_rank, p_tp), seed=20 + p_rank)
            assert p.cache.agreement() == d.cache.agreement(), "only the block size must match"
            heads_of = {
                "p": range(p_rank * p.model.kv_heads, (p_rank + 1) * p.model.kv_heads),
                "d": range(d_rank * d.model.kv_heads, (d_rank + 1) * d.model.kv_heads),
            }
            if set(heads_of["p"]) & set(heads_of["d"]):
                transfer_and_check(p, d)


@needs_vllm
def test_cpu_attention_of_different_block_sizes_cannot_agree() -> None:
    p = allocate("CPU_ATTN", "LBHNC", 32)
    d = allocate("CPU_ATTN", "LBHNC", 64)
    assert p.cache.agreement() != d.cache.agreement()


@needs_vllm
@pytest.mark.parametrize("layout", LAYOUTS)
def test_unknown_backends_move_whole_blocks(layout: str) -> None:
    p = allocate("FLASH_ATTN", layout, 32, seed=1)
    d = allocate("FLASH_ATTN", layout, 32, seed=2)
    for w in (p, d):
        model = Model(**{**w.model.__dict__, "backends": ("SOME_NEW_ATTN",)})
        w.cache = layout_from_caches([TensorView.of(v) for v in w.views], model)
        assert w.cache.whole_blocks
        assert w.cache.opaque_because is not None
        assert "SOME_NEW_ATTN" in w.cache.opaque_because
    transfer_and_check(p, d)


# ---- refused at startup, with the layout named -----------------------------------------------


@needs_vllm
def test_the_layout_is_mirrored_from_vllm() -> None:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    assert {m.name: m.value for m in KVCacheLayout} == KV_CACHE_LAYOUTS


@needs_vllm
def test_a_tensor_not_allocated_for_the_layout_is_refused() -> None:
    w = allocate("FLASH_ATTN", "LBHNC", 16)
    model = Model(**{**w.model.__dict__, "kv_cache_layout": "LBNHC"})
    with pytest.raises(LayoutError, match=r"LBNHC.*do not nest"):
        layout_from_caches([TensorView.of(v) for v in w.views], model)


def vllm_free_view(shape: tuple[int, ...], stride: tuple[int, ...]) -> TensorView:
    return TensorView(0x10000, shape, stride, 2)


def test_unknown_layout_names_and_shapes_are_refused() -> None:
    model = Model(2, 4, 16, kv_cache_layout="NHD", backends=("FLASH_ATTN",))
    view = vllm_free_view((8, 2, 16, 8), (256, 128, 8, 1))
    with pytest.raises(LayoutError, match="KV cache layout NHD: kvpush knows vLLM's LBHNC"):
        layout_from_caches([view], model)
    model = Model(2, 4, 16, kv_cache_layout="LBHNC", backends=("FLASH_ATTN",))
    with pytest.raises(LayoutError, match=r"LBHNC: vLLM's layer caches are \[B, H, N, C\]"):
        layout_from_caches([vllm_free_view((2, 8, 16, 2, 4), (2048, 128, 8, 4, 1))], model)
    with pytest.raises(LayoutError, match="pad the inside of a block"):
        layout_from_caches([vllm_free_view((8, 2, 16, 8), (640, 160, 10, 1))], model)
    with pytest.raises(LayoutError, match="do not divide vLLM's 16-token blocks"):
        layout_from_caches([vllm_free_view((8, 2, 24, 8), (384, 192, 8, 1))], model)


def test_block_outermost_layers_register_one_span() -> None:
    # BLHNC: three layers' [H, N, C] pages side by side in every block (strides in elements).
    page = 2 * 16 * 8
    views = [
        TensorView(0x10000 + layer * page * 2, (8, 2, 16, 8), (3 * page, 128, 8, 1), 2)
        for layer in range(3)
    ]
    model = Model(2, 4, 16, kv_cache_layout="BLHNC", backends=("FLASH_ATTN",))
    cache = layout_from_caches(views, model)
    assert cache.memory == ((0x10000, 8 * 3 * page * 2),)
    assert [r.block_stride for r in cache.layout.regions] == [3 * page * 2] * 3
    assert cache.layout.token_order == "HND"
    assert cache.slices_heads


# ---- two workers through their endpoints (loopback transport) --------------------------------


def push_worker(engine: str, w: Worker, base_port: int = 0) -> Any:
    """The connector's worker over ``w``'s caches, on the loopback transport; rank r of the
    engine listens on ``base_port + r`` (0: any free port, for one rank)."""
    from kvpush.vllm._worker import PushWorker
    from kvpush.vllm.config import WorkerConfig

    config = WorkerConfig(
        engine_id=engine,
        side_channel_host="127.0.0.1",
        side_channel_port=base_port,
        secret=b"layouts-test-secret-0123",
        insecure=False,
        ttl=30.0,
        receive_timeout=30.0,
        transport="loopback",
        model_fingerprint="tiny",
    )
    pw = PushWorker(config, w.model)
    pw.register([TensorView.of(v) for v in w.views])
    return pw


@needs_vllm
def test_two_workers_move_block_outermost_caches_through_endpoints() -> None:
    from kvpush.vllm._scheduler import PushScheduler

    p, d = allocate("FLASH_ATTN", "BLHNC", 16, seed=1), allocate("FLASH_ATTN", "BLHNC", 32, seed=2)
    reqs = requests(p, d)[:1]
    expected = expected_cache(p, d, reqs)

    pw, dw = push_worker("prefill", p), push_worker("decode", d)
    try:
        (r,) = reqs
        port = int(pw.endpoint.address.rsplit(":", 1)[1])
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": "prefill",
            "remote_host": "127.0.0.1",
            "remote_port": port,
            "tp_size": 1,
            "transfer_id": "xfer-layouts",
        }
        d_sched, p_sched = PushScheduler(), PushScheduler()
        d_sched.allocated("d-req", params, [r.d_blocks], 0, r.num_tokens, r.num_tokens)
        dw.apply(d_sched.take_metadata())
        p_params = {"do_remote_decode": True, "transfer_id": "xfer-layouts"}
        p_sched.finished("p-req", p_params, True, [r.p_blocks], r.num_tokens)
        pw.apply(p_sched.take_metadata())
        received: set[str] = set()
        deadline = time.monotonic() + 10.0
        while not received and time.monotonic() < deadline:
            time.sleep(0.01)
            pw.take_finished()
            done, failed = dw.take_finished()[1:]
            assert not failed, f"receive failed: {failed}"
            received |= done
        assert received == {"d-req"}
        assert_same_bytes(d.raw, expected)
    finally:
        pw.close()
        dw.close()


def test_model_from_vllm_reads_the_resolved_layout_and_backends() -> None:
    # The attributes the connector's worker sees once vLLM resolved its layout
    # (CacheConfig.get_resolved_kv_cache_layout, ModelConfig.get_num_kv_heads/get_head_size,
    # the layers' get_attn_backend() in compilation_config.static_forward_context).
    def layer(name: str) -> SimpleNamespace:
        return SimpleNamespace(get_attn_backend=lambda: SimpleNamespace(get_name=lambda: name))

    config = SimpleNamespace(
        model_config=SimpleNamespace(
            get_num_kv_heads=lambda parallel: 8 // parallel.tensor_parallel_size,
            get_head_size=lambda: 128,
            use_mla=False,
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=2),
        cache_config=SimpleNamespace(
            block_size=16, get_resolved_kv_cache_layout=lambda: SimpleNamespace(name="BLHNC")
        ),
        compilation_config=SimpleNamespace(
            static_forward_context={"a": layer("FLASH_ATTN"), "b": layer("FLASH_ATTN"), "c": 3}
        ),
    )
    assert Model.from_vllm(config, tp_rank=1) == Model(
        kv_heads=4,
        head_size=128,
        block_size=16,
        tp_rank=1,
        tp_size=2,
        kv_cache_layout="BLHNC",
        backends=("FLASH_ATTN",),
        use_mla=False,
    )


# ---- which P ranks a D rank receives from ----------------------------------------------------


def _rank_cache(tp: tuple[int, int], *, mla: bool = False, hnd: bool = True) -> tuple[Model, Any]:
    """A D rank of a 4-head model (FlashAttention; HND or NHD blocks), or an MLA rank."""
    heads = 1 if mla else TOTAL_HEADS // tp[1]
    layout = "LBHNC" if hnd else "LBNHC"
    model = Model(
        heads,
        HEAD,
        16,
        tp_rank=tp[0],
        tp_size=tp[1],
        kv_cache_layout=layout,
        backends=("TRITON_MLA" if mla else "FLASH_ATTN",),
        use_mla=mla,
        total_kv_heads=1 if mla else TOTAL_HEADS,
    )
    c = HEAD
    stride = (heads * 16 * c, 16 * c, c, 1) if hnd else (heads * 16 * c, c, heads * c, 1)
    return model, layout_from_caches([vllm_free_view((8, heads, 16, c), stride)], model)


@pytest.mark.parametrize(
    ("p_tp", "d_rank", "d_tp", "ranks", "share"),
    [
        (2, 0, 2, (0,), None),
        (2, 0, 1, (0, 1), None),
        (4, 1, 2, (2, 3), None),
        (1, 1, 2, (0,), (1, 2)),
        (2, 3, 4, (1,), (1, 2)),
        (2, 2, 4, (1,), (0, 2)),
    ],
)
def test_a_d_rank_receives_from_the_p_ranks_holding_its_heads(
    p_tp: int, d_rank: int, d_tp: int, ranks: tuple[int, ...], share: tuple[int, int] | None
) -> None:
    from kvpush.vllm._layout import Sources, sources_of

    model, cache = _rank_cache((d_rank, d_tp))
    assert sources_of(model, cache, p_tp) == Sources(ranks, share)


def test_mla_ranks_receive_from_one_p_rank_each() -> None:
    from kvpush.vllm._layout import Sources, sources_of

    assert sources_of(*_rank_cache((1, 2), mla=True), 4) == Sources((1,))
    assert sources_of(*_rank_cache((3, 4), mla=True), 2) == Sources((1,), (1, 2))
    with pytest.raises(LayoutError, match="multiple of P's"):
        sources_of(*_rank_cache((0, 3), mla=True), 2)


def test_tp_sizes_that_cannot_exchange_kv_are_refused_with_the_reason() -> None:
    from kvpush.vllm._layout import sources_of

    with pytest.raises(LayoutError, match="cannot be split between ranks"):
        sources_of(*_rank_cache((0, 1), hnd=False), 2)
    model, cache = _rank_cache((0, 2))
    replicated = Model(**{**model.__dict__, "total_kv_heads": 2})
    with pytest.raises(LayoutError, match="replicates heads"):
        sources_of(replicated, cache, 1)
    with pytest.raises(LayoutError, match="replicates heads"):
        sources_of(model, cache, 8)


@needs_vllm
@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
def test_workers_of_different_tp_sizes_move_cpu_attention_caches(p_tp: int, d_tp: int) -> None:
    """The connector's workers, each rank its own endpoint (loopback transport): every D rank
    receives its heads from the P ranks holding them, and reports the request done once."""
    from kvpush.vllm._scheduler import PushScheduler
    from kvpush_lab.servers import free_port

    p_base = free_port()
    p = [allocate("CPU_ATTN", "LBHNC", 32, tp=(r, p_tp), seed=1 + r) for r in range(p_tp)]
    d = [allocate("CPU_ATTN", "LBHNC", 32, tp=(r, d_tp), seed=9 + r) for r in range(d_tp)]
    r = requests(p[0], d[0])[0]
    expected = [d_rank.raw.clone() for d_rank in d]
    for i, d_rank in enumerate(d):
        for p_rank in p:
            # Each P rank's heads that D rank i holds (expected_cache copies the shared ones).
            d_rank.raw, saved = expected[i], d_rank.raw
            expected[i] = expected_cache(p_rank, d_rank, [r])
            d_rank.raw = saved

    pws = [push_worker("prefill", w, p_base) for w in p]
    dws = [push_worker("decode", w, free_port()) for w in d]
    try:
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": "prefill",
            "remote_host": "127.0.0.1",
            "remote_port": p_base,
            "tp_size": p_tp,
            "transfer_id": "xfer-tp",
        }
        d_sched, p_sched = PushScheduler(), PushScheduler()
        d_sched.allocated("d-req", params, [r.d_blocks], 0, r.num_tokens, r.num_tokens)
        d_meta = d_sched.take_metadata()
        p_params = {"do_remote_decode": True, "transfer_id": "xfer-tp"}
        p_sched.finished("p-req", p_params, True, [r.p_blocks], r.num_tokens)
        p_meta = p_sched.take_metadata()
        # Every rank of an engine gets the same scheduler output.
        for dw in dws:
            dw.apply(d_meta)
        for pw in pws:
            pw.apply(p_meta)
        received = [set[str]() for _ in dws]
        sent = [set[str]() for _ in pws]
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and not (all(received) and all(sent)):
            time.sleep(0.01)
            for i, pw in enumerate(pws):
                sent[i] |= pw.take_finished()[0]
            for i, dw in enumerate(dws):
                done, failed = dw.take_finished()[1:]
                assert not failed, f"D rank {i}: receive failed: {failed}"
                received[i] |= done
        assert received == [{"d-req"}] * d_tp
        assert sent == [{"p-req"}] * p_tp, "each P rank frees its blocks once"
        for i, d_rank in enumerate(d):
            assert_same_bytes(d_rank.raw, expected[i])
    finally:
        for w in pws + dws:
            w.close()
