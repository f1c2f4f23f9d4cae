"""Several KV cache groups: a hybrid model's caches allocated by vLLM's own code, moved between a P
and a D worker in two processes over NIXL, and checked byte for byte.

The model has what vLLM's hybrid KV cache manager makes of Gemma-style alternating layers: a
sliding-window group (layers 0 and 2) and a full-attention group (layers 1 and 3), whose layers
share backing tensors pairwise (``get_kv_cache_config_from_groups``: one tensor per layer
position, used by a layer of each group), each group addressing it with its own block ids.
Each worker is the connector's worker (:class:`PushWorker`) over ``allocate_kv_cache``'s views,
fed by the connector's scheduler (:class:`PushScheduler`) with the block lists vLLM hands over:

* P (``request_finished_all_groups``, ``get_block_ids_for_computed_tokens``): every group's
  blocks of the prompt, the sliding-window group's blocks before the window replaced by the null
  block (``remove_skipped_blocks``);
* D (``get_unhashed_block_ids_all_groups``): the blocks allocated for P's tokens, without null
  blocks, so the sliding-window group lists only the blocks from the window on.

D's whole backing buffer is compared with a reference computed from the views' logical
``[B, H, N, C]`` indexing, so a byte that lands in another group's block, in the null block or in
a block before the window fails as surely as a missing one. The refusals (Mamba state, groups
of different block sizes) are read from vLLM's own spec classes.

Needs vLLM (``.venv-vllm``), and NIXL for the two-process tests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from importlib.util import find_spec
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import kvpush
from kvpush._native import lab
from kvpush.exceptions import LayoutError
from kvpush.vllm._layout import NULL_BLOCK, CacheGroups, Model, WindowFree, views_by_group
from kvpush.vllm._scheduler import PushScheduler
from kvpush.vllm._worker import PushWorker
from kvpush.vllm.config import WorkerConfig
from kvpush_lab.peer import RemoteWorker
from tests.support.nixl import nixl_or_skip

pytestmark = pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed")

LAYERS, KV_HEADS, HEAD, BLOCKS = 4, 2, 4, 24
WINDOW = 40  # tokens; not a multiple of any block size used here
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
SLIDING, FULL = [NAMES[0], NAMES[2]], [NAMES[1], NAMES[3]]


def backend(name: str) -> Any:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    return {"CPU_ATTN": CPUAttentionBackend, "FLASH_ATTN": FlashAttentionBackend}[name]


def group_specs(backend_name: str, block_size: int, window_block_size: int | None = None) -> Any:
    """vLLM's KV cache groups of the hybrid model: sliding window, then full attention."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.worker.utils import customize_attention_spec

    attn = backend(backend_name)
    sliding = SlidingWindowSpec(
        block_size=window_block_size or block_size,
        num_kv_heads=KV_HEADS,
        head_size=HEAD,
        dtype=torch.float16,
        sliding_window=WINDOW,
    )
    full = FullAttentionSpec(
        block_size=block_size, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float16
    )
    return [
        KVCacheGroupSpec(SLIDING, customize_attention_spec(attn, sliding)),
        KVCacheGroupSpec(FULL, customize_attention_spec(attn, full)),
    ]


def kv_cache_config(backend_name: str, block_size: int) -> Any:
    """vLLM's KVCacheConfig for the hybrid model (``get_kv_cache_config_from_groups``)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_layout import KVCacheLayout

    groups = group_specs(backend_name, block_size)
    layout = KVCacheLayout["LBHNC"]
    vllm_config = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: layout,
            num_gpu_blocks_override=BLOCKS,
            prefix_cache_retention_interval=None,
        ),
    )
    return get_kv_cache_config_from_groups(vllm_config, groups, available_memory=1 << 30)


@dataclass(frozen=True)
class Request:
    """One prompt's blocks as vLLM hands them to the connector, per group (sliding, full)."""

    request_id: str
    num_tokens: int
    p_blocks: tuple[list[int], list[int]]  # the sliding list holds NULL_BLOCK before the window
    d_blocks: tuple[list[int], list[int]]  # no null blocks: the sliding list is the window's


def skipped_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks vLLM's SlidingWindowManager frees wholly before the next token's window."""
    return max(0, num_tokens - WINDOW + 1) // block_size


def requests(block_size: int) -> list[Request]:
    """A prompt within the window and two beyond it, over blocks shuffled on each side (every
    group drawing from one pool, as vLLM's do; block 0 is the null block)."""
    out = []
    p_free = [int(b) for b in np.random.default_rng(1).permutation(range(1, BLOCKS))]
    d_free = [int(b) for b in np.random.default_rng(2).permutation(range(1, BLOCKS))]
    for i, tokens in enumerate((30, 150, 101)):
        n = -(-tokens // block_size)
        skipped = skipped_blocks(tokens, block_size)
        p_full, p_free = p_free[:n], p_free[n:]
        p_window, p_free = p_free[: n - skipped], p_free[n - skipped :]
        d_full, d_free = d_free[:n], d_free[n:]
        d_window, d_free = d_free[: n - skipped], d_free[n - skipped :]
        out.append(
            Request(
                f"req-{i}",
                tokens,
                ([NULL_BLOCK] * skipped + p_window, p_full),
                (d_window, d_full),
            )
        )
    return out


class GroupsWorker:
    """The connector's worker over a hybrid model's caches as vLLM allocates them; the commands
    the two-process tests send (:class:`kvpush_lab.peer.RemoteWorker` runs it in its own
    process)."""

    def __init__(self, role: str, backend_name: str, block_size: int, seed: int, transport: str):
        import torch
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache, prepare_kernel_block_sizes

        attn = backend(backend_name)
        config = kv_cache_config(backend_name, block_size)
        layout = KVCacheLayout["LBHNC"]
        attn_groups = [
            [SimpleNamespace(backend=attn, kv_cache_spec=g.kv_cache_spec)]
            for g in config.kv_cache_groups
        ]
        kernel_block_sizes = prepare_kernel_block_sizes(config, attn_groups)
        self.caches = allocate_kv_cache(config, torch.device("cpu"), layout, kernel_block_sizes)
        storages = {self.caches[n].untyped_storage().data_ptr() for n in NAMES}
        assert len(storages) == 1, "vLLM allocates one backing buffer"
        self.raw = torch.tensor([], dtype=torch.uint8).set_(self.caches[NAMES[0]].untyped_storage())
        rng = np.random.default_rng(seed)
        self.raw.copy_(torch.from_numpy(rng.integers(0, 256, self.raw.numel(), dtype=np.uint8)))
        self.groups = CacheGroups.from_vllm(config)
        self.model = Model(
            kv_heads=KV_HEADS,
            head_size=HEAD,
            block_size=block_size,
            kv_cache_layout="LBHNC",
            backends=(attn.get_name(),),
            groups=self.groups,
        )
        self.worker = PushWorker(
            WorkerConfig(
                engine_id=f"{role}-engine",
                side_channel_host="127.0.0.1",
                side_channel_port=0,
                secret=b"groups-test-secret-0123456",
                insecure=False,
                ttl=30.0,
                receive_timeout=30.0,
                transport=transport,
                model_fingerprint="tiny-hybrid",
            ),
            self.model,
        )
        self.worker.register(*views_by_group(self.caches, self.groups))
        self.scheduler = PushScheduler(groups=self.groups)

    def address(self) -> str:
        return self.worker.endpoint.address

    def send(self, reqs: list[Request]) -> None:
        """P: the prompts finished; ``all groups`` block lists as vLLM hands them over."""
        for r in reqs:
            params = {"do_remote_decode": True, "transfer_id": f"xfer-{r.request_id}"}
            self.scheduler.finished(f"p-{r.request_id}", params, True, r.p_blocks, r.num_tokens)
        self.worker.apply(self.scheduler.take_metadata())

    def expect(self, source: str, reqs: list[Request]) -> None:
        """D: blocks allocated for P's tokens, registered with P."""
        host, port = source.rsplit(":", 1)
        for r in reqs:
            params = {
                "do_remote_prefill": True,
                "remote_engine_id": "prefill-engine",
                "remote_host": host,
                "remote_port": int(port),
                "tp_size": 1,
                "transfer_id": f"xfer-{r.request_id}",
            }
            self.scheduler.allocated(
                f"d-{r.request_id}", params, r.d_blocks, 0, r.num_tokens, r.num_tokens
            )
        self.worker.apply(self.scheduler.take_metadata())

    def finished(self, count: int, timeout: float = 20.0) -> dict[str, list[str]]:
        """Waits until ``count`` requests finished; returns them (and the failed receives)."""
        sent: set[str] = set()
        received: set[str] = set()
        failed: set[str] = set()
        deadline = time.monotonic() + timeout
        while len(sent) + len(received) < count and time.monotonic() < deadline:
            time.sleep(0.01)
            s, r, f = self.worker.take_finished()
            sent, received, failed = sent | s, received | r, failed | f
        return {"sent": sorted(sent), "received": sorted(received), "failed": sorted(failed)}

    def bytes_written(self) -> int:
        stats: dict[str, Any] = self.worker.take_stats() or {}
        return int(sum(stats.get("bytes", ())))

    def cache(self) -> bytes:
        return bytes(self.raw.numpy().tobytes())

    def expected_after(self, p_cache: bytes, reqs: list[Request]) -> bytes:
        """D's buffer as it must be: its own bytes, but every token of every layer of the
        request that D's group lists copied from P's, by the views' logical indexing."""
        import torch

        expected = self.raw.clone()
        p_raw = torch.frombuffer(bytearray(p_cache), dtype=torch.uint8)
        size = self.model.block_size
        for r in reqs:
            end = -(-r.num_tokens // size) * size  # CPU_ATTN moves whole blocks
            if not self.worker_cache_whole_blocks():
                end = r.num_tokens
            for g, names in enumerate((SLIDING, FULL)):
                d_first = (-(-r.num_tokens // size) - len(r.d_blocks[g])) * size
                for name in names:
                    view = self.caches[name].view(torch.uint8)
                    p_view = torch.as_strided(
                        p_raw, view.shape, view.stride(), view.storage_offset()
                    )
                    d_view = torch.as_strided(
                        expected, view.shape, view.stride(), view.storage_offset()
                    )
                    for token in range(d_first, end):
                        p_block = r.p_blocks[g][token // size]
                        d_block = r.d_blocks[g][(token - d_first) // size]
                        assert p_block != NULL_BLOCK, "D lists a token P dropped"
                        d_view[d_block, :, token % size] = p_view[p_block, :, token % size]
        return bytes(expected.numpy().tobytes())

    def worker_cache_whole_blocks(self) -> bool:
        cache = self.worker._cache
        assert cache is not None
        return cache.whole_blocks

    def close(self) -> None:
        self.worker.close()


def spawn(role: str, backend_name: str, block_size: int, seed: int) -> Any:
    return RemoteWorker(
        # NIXL over UCX on loopback, as tests/two_process/test_transfer.py
        env={"UCX_NET_DEVICES": "lo"},
        worker_class=GroupsWorker,
        role=role,
        backend_name=backend_name,
        block_size=block_size,
        seed=seed,
        transport="nixl",
    )


@pytest.fixture(params=["CPU_ATTN", "FLASH_ATTN"])
def pair(request: pytest.FixtureRequest) -> Any:
    nixl_or_skip()
    block_size = 32
    p = spawn("prefill", request.param, block_size, seed=1)
    try:
        d = spawn("decode", request.param, block_size, seed=2)
    except BaseException:
        p.close()
        raise
    try:
        yield p, d, block_size
    finally:
        p.close()
        d.close()


# ---- two processes over NIXL -----------------------------------------------------------------


def test_both_groups_blocks_land_exactly_where_d_expects_them(pair: Any) -> None:
    p, d, block_size = pair
    reqs = requests(block_size)
    assert any(NULL_BLOCK in r.p_blocks[0] for r in reqs), "a prompt must pass the window"
    expected = d.expected_after(p.cache(), reqs)
    before = d.cache()
    assert expected != before, "the requests must change D's cache"
    d.expect(p.address(), reqs)
    p.send(reqs)
    sent = p.finished(len(reqs))
    received = d.finished(len(reqs))
    assert sent["sent"] == sorted(f"p-{r.request_id}" for r in reqs)
    assert received == {
        "sent": [],
        "received": sorted(f"d-{r.request_id}" for r in reqs),
        "failed": [],
    }
    after = d.cache()
    wrong = sum(a != b for a, b in zip(after, expected, strict=True))
    assert wrong == 0, f"{wrong} of {len(after)} bytes of D's cache differ from the reference"
    # Every group's tokens, and no more: the sliding-window group's only from its first block
    # in the window on (whole blocks with CPU attention, whose blocks are opaque).
    token_bytes = KV_HEADS * 2 * HEAD * 2  # K and V of every head, float16
    whole = p.worker_cache_whole_blocks()
    tokens = 0
    for r in reqs:
        blocks = -(-r.num_tokens // block_size)
        end = blocks * block_size if whole else r.num_tokens
        tokens += sum(end - (blocks - len(group)) * block_size for group in r.d_blocks)
    assert p.bytes_written() == tokens * (LAYERS // 2) * token_bytes


# ---- in one process: what the connector reads of vLLM's groups -------------------------------


def test_a_tensor_shared_by_two_groups_is_a_region_of_each() -> None:
    worker = GroupsWorker("solo", "FLASH_ATTN", 32, seed=3, transport="loopback")
    try:
        cache = worker.worker._cache
        assert cache is not None
        bases = [(r.base, r.group) for r in cache.layout.regions]
        # Layers 0 and 1 share a tensor (as do 2 and 3); one region per layer and its group.
        ptr = {n: worker.caches[n].data_ptr() for n in NAMES}
        assert ptr[NAMES[0]] == ptr[NAMES[1]]
        assert ptr[NAMES[2]] == ptr[NAMES[3]]
        assert sorted(bases) == sorted(
            [(ptr[NAMES[0]], 0), (ptr[NAMES[1]], 1), (ptr[NAMES[2]], 0), (ptr[NAMES[3]], 1)]
        )
        assert worker.groups.windowed == (True, False)
        assert worker.groups.frees == ((WindowFree(sliding_window=WINDOW),), ())
        assert worker.groups.transfer_ids == (0, 1)
        assert cache.windowed
        assert "windowed-blocks-of-32" in cache.agreement()
    finally:
        worker.close()


def test_mamba_state_layers_are_refused_at_startup_naming_them() -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec

    mamba = MambaSpec(
        block_size=4096,
        shapes=((3, 512), (8, 64, 16)),
        dtypes=(torch.float32, torch.float32),
    )
    full = FullAttentionSpec(
        block_size=128, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float32
    )
    config = SimpleNamespace(
        kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.0.mixer"], mamba),
            KVCacheGroupSpec(["model.layers.1.mixer"], full),
        ]
    )
    with pytest.raises(LayoutError, match=r"group 0 \(MambaSpec.*Mamba/SSM state layers"):
        CacheGroups.from_vllm(config)
    # The connector's worker reads the groups with the rest of the model: refused as it starts.
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(
            get_num_kv_heads=lambda parallel: KV_HEADS, get_head_size=lambda: HEAD, use_mla=False
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        cache_config=SimpleNamespace(block_size=128),
        compilation_config=SimpleNamespace(static_forward_context={}),
    )
    with pytest.raises(LayoutError, match="Mamba/SSM state layers"):
        Model.from_vllm(vllm_config, tp_rank=0, kv_cache_config=config)


def test_groups_of_different_block_sizes_are_refused_at_startup() -> None:
    config = SimpleNamespace(kv_cache_groups=group_specs("FLASH_ATTN", 32, window_block_size=16))
    with pytest.raises(LayoutError, match="different block sizes"):
        CacheGroups.from_vllm(config)


def test_a_group_vllm_does_not_transfer_is_left_out() -> None:
    config = kv_cache_config("FLASH_ATTN", 32)
    config.kv_cache_groups[0].enable_kv_transfer = False
    groups = CacheGroups.from_vllm(config)
    assert groups.transfer_ids == (1,)
    assert groups.layers == {name: 0 for name in FULL}
    assert groups.select([[5, 6], [7, 8]]) == ((7, 8),)
    with pytest.raises(LayoutError, match="2 KV cache groups"):
        groups.select([[7, 8]])


def test_planner_refuses_a_window_that_p_dropped_and_d_still_needs() -> None:
    # A D of a larger block size would list the window from an earlier token than P kept:
    # the planner refuses (and the handshake's agreement keeps such a pair apart).
    worker = GroupsWorker("solo", "FLASH_ATTN", 32, seed=3, transport="loopback")
    try:
        cache = worker.worker._cache
        assert cache is not None
        planner = lab.Planner(cache.layout, cache.layout)
        with pytest.raises(kvpush.exceptions.PlanError, match="P's blocks start at token 64"):
            planner.plan(
                "r",
                150,
                [[3, 4, 5], [6, 7, 8, 9, 10]],
                [[11, 12, 13, 14], [15, 16, 17, 18, 19]],
                src_first_tokens=[64, 0],
                dst_first_tokens=[32, 0],
            )
    finally:
        worker.close()
