"""From vLLM's per-layer KV cache tensors to a :class:`kvpush.KvLayout`.

kvpush describes memory as regions of kernel blocks whose heads are in NHD or HND order (see
``rust/core/src/layout.rs``). This module maps what vLLM says about its cache onto that model.

**vLLM >= 0.28** describes its cache itself. ``allocate_kv_cache`` / ``create_kv_cache_views``
(``vllm/v1/worker/utils.py``, ``vllm/v1/kv_cache_interface.py``) carve every layer out of one
backing buffer as a ``[B, H, N, C]`` view (kernel blocks, head slots, tokens, one head's bytes of
one token) whose strides follow the resolved ``KVCacheLayout``, a permutation of the logical
``[L, B, H, N, C]`` (``vllm/v1/kv_cache_layout.py``). :class:`Model` carries that layout's name
and the attention backends; :func:`layout_from_caches` checks each view against the permutation
and refuses, naming the layout, a tensor that does not follow it. Then:

* **C is one token's cell** (K then V; MLA's latent and rope as one cell) for the backends in
  :data:`TOKEN_CELL_BACKENDS`, whose kernels split C per token (FlashAttention and Triton:
  ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``; FlashInfer: ``split(hs, dim=-1)``;
  vLLM CPU's ``CPU_MLA``: one row of latent and rope per slot).
  Tokens move one by one, so P and D may use different block sizes. Heads are sliced between
  different tensor parallel sizes when a block holds ``[H][N][C]`` (``LBHNC``, ``BLHNC``: the
  planner's HND); ``[N][H][C]`` (``LBNHC``, ``BLNHC``: NHD) and layouts that put blocks or layers
  between a layer's heads (``LHBNC``, ``BHLNC``: one region per layer and head) need equal tensor
  parallel sizes, which :meth:`CacheLayout.agreement` makes part of the handshake. MLA's single
  latent is replicated on every rank, so its layout is rank-independent.
* **Blocks are opaque** otherwise: CPU attention (``CPU_ATTN``) keeps, per head, K *transposed*
  (``[head_size][block_size]``) and then V inside C's block (measured with
  ``cpu_attn_reshape_and_cache``), so no token range of a block is a byte range; a backend not
  listed, or head slots that are not KV heads (FlashInfer's NVFP4 keeps K and V as separate
  slots), is treated the same way. Such blocks move whole, between P and D of the same block
  size (``whole_blocks``); each block unit the permutation keeps contiguous is one region.
  CPU attention's heads are still whole slabs side by side (``[H][N][C]``, K transposed only
  inside a head's slab), so its whole blocks are sliced by head between tensor parallel sizes.

**KV cache groups.** vLLM's hybrid KV cache manager keeps layers of different attention types
(sliding-window and full attention, as Gemma 2/3 alternate them) as KV cache groups, each with
its own block table over one shared pool: a layer of each group may even share one tensor,
whose blocks the groups' tables hand out disjointly. :class:`CacheGroups` reads the groups from
vLLM's ``KVCacheConfig``; every layer's region carries its group (``Region.group``), so the
planner addresses it with that group's block ids. A sliding-window group's table holds vLLM's
null block (id 0) in place of the blocks before the window, so only its blocks from the window
on are listed and moved, on both sides (:func:`window_start`). Groups that hold no per-token KV,
such as Mamba's SSM state, are refused at startup.

**Older vLLM** gave no layout; :class:`Model` without one falls back to the shapes it used (the
CPU shape above, FlashAttention's ``[2, B, N, H, D]``, FlashInfer's ``[B, 2, N, H, D]``).

Only shapes, strides, element sizes and addresses are read (:class:`TensorView`), so this module
needs neither torch nor vLLM and is tested without them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise

import kvpush
from kvpush._native import tp_sources
from kvpush.exceptions import LayoutError

#: vLLM's ``KVCacheLayout`` members (``vllm/v1/kv_cache_layout.py``): for each, the physical
#: (memory) order, outermost first, of the logical axes ``[L, B, H, N, C]`` numbered 0..4.
KV_CACHE_LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}

#: Attention backends (``AttentionBackend.get_name()``) whose C holds one token's state of one
#: head slot and nothing of other tokens: their blocks can be split by token.
TOKEN_CELL_BACKENDS = frozenset(
    {
        "FLASH_ATTN",
        "FLASHINFER",
        "TRITON_ATTN",
        "FLEX_ATTENTION",
        "FLASHMLA",
        "FLASH_ATTN_MLA",
        "FLASHINFER_MLA",
        "CUTLASS_MLA",
        "TRITON_MLA",
        "ROCM_AITER_MLA",
        # vLLM's CPU build: ``CPUMLAImpl.do_kv_cache_update`` writes each token's latent and rope
        # as one row of ``kv_cache.view(-1, kv_lora_rank + rope)`` (``cpu_mla.py``). AMX_MLA's
        # cache is written by a C++ op (``amx_mla_concat_and_cache``) not read here: opaque.
        "CPU_MLA",
    }
)

# Axes of a layer view [B, H, N, C].
_B, _H, _N, _C = range(4)


@dataclass(frozen=True)
class TensorView:
    """What the layout needs of a tensor: address, shape and strides (in elements), and the GPU
    it lives on (``None``: host memory)."""

    data_ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    element_size: int
    cuda_device: int | None = None

    @classmethod
    def of(cls, tensor: object) -> TensorView:
        """From a torch tensor (duck-typed: ``data_ptr()``, ``shape``, ``stride()``,
        ``element_size()``, ``device.type``/``device.index``). A tensor on ``cuda`` is VRAM of
        its device; any other device type is host memory (vLLM's CPU caches, pinned buffers)."""
        t = tensor
        device = getattr(t, "device", None)
        on_gpu = getattr(device, "type", "cpu") == "cuda"
        return cls(
            t.data_ptr(),  # type: ignore[attr-defined]
            tuple(t.shape),  # type: ignore[attr-defined]
            tuple(t.stride()),  # type: ignore[attr-defined]
            t.element_size(),  # type: ignore[attr-defined]
            (getattr(device, "index", None) or 0) if on_gpu else None,
        )

    @property
    def nbytes(self) -> int:
        """Bytes spanned from the first to one past the last element."""
        span = sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True)) + 1
        return span * self.element_size


@dataclass(frozen=True)
class Model:
    """What vLLM's config says about one rank's KV cache."""

    kv_heads: int
    head_size: int
    #: Tokens per block of vLLM's scheduler (``cache_config.block_size``).
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1
    #: The resolved ``KVCacheLayout`` name (``cache_config.get_resolved_kv_cache_layout()``);
    #: None for a vLLM before 0.28, whose tensors are read by shape.
    kv_cache_layout: str | None = None
    #: The attention backends' names (``get_name()``) of the layers with a KV cache.
    backends: tuple[str, ...] = ()
    #: MLA: one latent "head" per token, the same on every tensor parallel rank.
    use_mla: bool = False
    #: This worker's pipeline-parallel stage and the number of stages.
    pp_rank: int = 0
    pp_size: int = 1
    #: The model's KV heads over all ranks (``get_total_num_kv_heads``); None: ``kv_heads`` *
    #: ``tp_size``. Fewer than that means vLLM replicates heads across ranks.
    total_kv_heads: int | None = None
    #: vLLM's KV cache groups (None: one group, every layer).
    groups: CacheGroups | None = None

    @property
    def worker_index(self) -> int:
        """This worker's index among its engine's workers (stage-major): its side-channel port
        is the engine's base port plus this, so that the stages on one host never clash."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @classmethod
    def from_vllm(
        cls,
        vllm_config: object,
        tp_rank: int,
        pp_rank: int = 0,
        kv_cache_config: object | None = None,
    ) -> Model:
        """From a worker's ``VllmConfig`` once the layout is resolved (the connector's
        construction, ``initialize_from_config``), and the ``KVCacheConfig`` vLLM gives the
        connector (its groups; refused here, at startup, if kvpush cannot move them).
        Duck-typed: this module imports no vLLM."""
        cfg = vllm_config
        model = cfg.model_config  # type: ignore[attr-defined]
        parallel = cfg.parallel_config  # type: ignore[attr-defined]
        cache = cfg.cache_config  # type: ignore[attr-defined]
        compilation = cfg.compilation_config  # type: ignore[attr-defined]
        backends = {
            layer.get_attn_backend().get_name()
            for layer in compilation.static_forward_context.values()
            if callable(getattr(layer, "get_attn_backend", None))
        }
        resolved = getattr(cache, "get_resolved_kv_cache_layout", None)  # vLLM >= 0.28
        return cls(
            kv_heads=model.get_num_kv_heads(parallel),
            head_size=model.get_head_size(),
            block_size=cache.block_size,
            tp_rank=tp_rank,
            tp_size=parallel.tensor_parallel_size,
            kv_cache_layout=resolved().name if resolved is not None else None,
            backends=tuple(sorted(backends)),
            use_mla=bool(model.use_mla),
            pp_rank=pp_rank,
            pp_size=int(getattr(parallel, "pipeline_parallel_size", 1)),
            total_kv_heads=_total_kv_heads(model),
            groups=None if kv_cache_config is None else CacheGroups.from_vllm(kv_cache_config),
        )


#: vLLM's null block: the placeholder a group's block table holds for blocks it freed (a
#: sliding window's tokens before the window); ``BlockPool`` reserves block 0 for it.
NULL_BLOCK = 0

#: KV cache specs (class names in ``vllm/v1/kv_cache_interface.py``, subclasses included) whose
#: caches kvpush cannot move, and why.
REFUSED_SPECS = {
    "MambaSpec": (
        "Mamba/SSM state layers (hybrid Mamba/attention models) keep one running state per "
        "request instead of per-token KV blocks, which kvpush's connector does not move"
    ),
    "CrossAttentionSpec": "cross-attention layers (encoder-decoder models) are not moved",
    "EncoderOnlyAttentionSpec": "encoder-only attention layers hold no KV to move",
    "CircularBufferSpec": "circular-buffer layers reuse one block per request as a ring",
}


def _spec_names(spec: object) -> list[str]:
    return [cls.__name__ for cls in type(spec).__mro__]


def _layer_specs(spec: object) -> list[object]:
    """A group's per-layer specs (``UniformTypeKVCacheSpecs`` wraps one per layer)."""
    inner = getattr(spec, "kv_cache_specs", None)
    return list(inner.values()) if isinstance(inner, Mapping) else [spec]


@dataclass(frozen=True)
class WindowFree:
    """How vLLM's manager of a layer spec frees a request's blocks before its window while the
    request still runs (``remove_skipped_blocks``, counting as ``get_num_skipped_tokens``
    does): a sliding window (``SlidingWindowSpec``) or local attention chunks
    (``ChunkedLocalAttentionSpec``)."""

    sliding_window: int | None = None
    #: Tokens a sliding window keeps past its trailing edge (speculative decoding's re-prefill).
    extra_retained_tokens: int = 0
    attention_chunk_size: int | None = None

    @classmethod
    def of(cls, spec: object) -> WindowFree | None:
        """The freeing of one layer spec; None where its manager frees nothing early (a full
        attention spec that carries a window, as vLLM makes one without its hybrid manager)."""
        names = _spec_names(spec)
        if "SlidingWindowSpec" in names:
            window = int(spec.sliding_window)  # type: ignore[attr-defined]
            extra = int(getattr(spec, "extra_retained_tokens", 0) or 0)
            return cls(sliding_window=window, extra_retained_tokens=extra)
        if "ChunkedLocalAttentionSpec" in names:
            chunk = int(spec.attention_chunk_size)  # type: ignore[attr-defined]
            return cls(attention_chunk_size=chunk)
        return None

    def skipped(self, computed: int) -> int:
        """The tokens before the window once ``computed`` tokens are: their blocks are freed."""
        if self.sliding_window is not None:
            # The window of the next token reaches back sliding_window - 1 tokens.
            return max(0, computed - self.sliding_window + 1 - self.extra_retained_tokens)
        if self.attention_chunk_size:
            return computed // self.attention_chunk_size * self.attention_chunk_size
        return 0


@dataclass(frozen=True)
class CacheGroups:
    """vLLM's KV cache groups as kvpush moves them: the groups that take part in KV transfer
    (``KVCacheGroupSpec.enable_kv_transfer``), numbered 0.. in vLLM's order (kvpush's
    ``Region.group``), and which of them drop the blocks before a window."""

    #: Indices into ``kv_cache_groups`` of the groups kvpush moves, in kvpush's group order.
    transfer_ids: tuple[int, ...] = (0,)
    #: ``len(kv_cache_groups)``: how many block lists vLLM hands over per request.
    total: int = 1
    #: Tokens per block, the same in every moved group.
    block_size: int = 16
    #: Per moved group: whether its blocks before a window are vLLM's null block (sliding
    #: window, chunked local attention).
    windowed: tuple[bool, ...] = (False,)
    #: Layer name to its moved group; layers of other groups are absent.
    layers: Mapping[str, int] = field(default_factory=dict)
    #: Per moved group: how its layers' specs free blocks before a window while a request runs
    #: (empty: never, or not known for a windowed group).
    frees: tuple[tuple[WindowFree, ...], ...] = ((),)

    @classmethod
    def from_vllm(cls, kv_cache_config: object) -> CacheGroups:
        """From vLLM's ``KVCacheConfig`` (duck-typed); refuses, with the reason, what kvpush
        cannot move (:class:`LayoutError`)."""
        groups = list(kv_cache_config.kv_cache_groups)  # type: ignore[attr-defined]
        if not groups:
            raise LayoutError("vLLM's KV cache config has no KV cache groups")
        transfer_ids: list[int] = []
        windowed: list[bool] = []
        frees: list[tuple[WindowFree, ...]] = []
        block_sizes: dict[int, list[int]] = {}
        layers: dict[str, int] = {}
        for index, group in enumerate(groups):
            specs = _layer_specs(group.kv_cache_spec)
            for spec in specs:
                names = _spec_names(spec)
                refused = next((why for name, why in REFUSED_SPECS.items() if name in names), None)
                if refused is None and "AttentionSpec" not in names:
                    refused = f"{names[0]} layers hold no attention KV blocks kvpush knows"
                if refused is not None:
                    layers_named = ", ".join(group.layer_names[:3])
                    if len(group.layer_names) > 3:
                        layers_named += ", ..."
                    raise LayoutError(
                        f"KV cache group {index} ({names[0]}, layers {layers_named}): "
                        f"{refused}; serve this model without disaggregation, or with vLLM's "
                        "NixlConnector"
                    )
            if not getattr(group, "enable_kv_transfer", True):
                continue
            moved = len(transfer_ids)
            transfer_ids.append(index)
            windowed.append(
                any(
                    getattr(spec, "sliding_window", None) is not None
                    or getattr(spec, "attention_chunk_size", None) is not None
                    for spec in specs
                )
            )
            frees.append(tuple(free for free in map(WindowFree.of, specs) if free is not None))
            block_sizes.setdefault(int(group.kv_cache_spec.block_size), []).append(index)
            layers.update((name, moved) for name in group.layer_names)
        if not transfer_ids:
            raise LayoutError("vLLM marked no KV cache group for transfer")
        if len(block_sizes) > 1:
            raise LayoutError(
                "KV cache groups of different block sizes (tokens: groups "
                f"{dict(sorted(block_sizes.items()))}): kvpush moves one block size per worker"
            )
        (block_size,) = block_sizes
        return cls(
            tuple(transfer_ids), len(groups), block_size, tuple(windowed), layers, tuple(frees)
        )

    @property
    def any_windowed(self) -> bool:
        return any(self.windowed)

    def kept_from(self, computed: int) -> tuple[int, ...] | None:
        """P, layer-wise push: per moved group, the first token of the first block vLLM keeps
        for a request until it finishes, where the request computes at most ``computed``
        tokens before it does: a window's earlier blocks are freed as the prompt's chunks go,
        so a WRITE that may outlive its step reads only blocks from here on. 0 for a group that
        frees nothing; None where a windowed group's freeing is not known."""
        kept = []
        for group, windowed in enumerate(self.windowed):
            frees = self.frees[group] if group < len(self.frees) else ()
            if windowed and not frees:
                return None
            skipped = max((free.skipped(computed) for free in frees), default=0)
            kept.append(skipped // self.block_size * self.block_size)
        return tuple(kept)

    def select(self, block_ids: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
        """The moved groups' lists of the lists vLLM hands over (one per KV cache group)."""
        if len(block_ids) != self.total:
            raise LayoutError(
                f"vLLM handed {len(block_ids)} block lists for {self.total} KV cache groups"
            )
        return tuple(tuple(block_ids[index]) for index in self.transfer_ids)


def views_by_group(
    kv_caches: Mapping[str, object], groups: CacheGroups | None
) -> tuple[list[TensorView], list[int], dict[str, int]]:
    """The tensors vLLM registers with the connector (layer name to tensor, in layer order) as
    :func:`layout_from_caches` takes them: distinct ``(tensor, group)`` pairs and their groups;
    and each moved layer's index among them (layer-wise push streams a layer's regions).

    Layers of one group that share a cache (aliases) count once, but the hybrid manager's layers
    of different groups that share a tensor each address it with their own group's blocks, so
    each is a region. Layers of groups that take no part in transfer are left out. The views go
    in the order the forward pass runs the layers (by the layer index in their names; vLLM may
    hand a hybrid model's layers group by group), so that layer-wise push streams regions in
    layout order; P and D order them the same way.
    """
    seen: dict[tuple[int, int], TensorView] = {}
    index: dict[tuple[int, int], int] = {}
    layers: dict[str, int] = {}
    for name, tensor in sorted(kv_caches.items(), key=lambda item: _layer_index(item[0])):
        group = 0 if groups is None else groups.layers.get(name)
        if group is None:
            continue
        view = TensorView.of(tensor)
        key = (view.data_ptr, group)
        seen.setdefault(key, view)
        layers[name] = index.setdefault(key, len(index))
    return list(seen.values()), [group for _, group in seen], layers


def _layer_index(name: str) -> int:
    """The layer index in a layer's name (``model.layers.12.self_attn.attn``: 12), as vLLM's
    ``extract_layer_index`` reads it; -1 when it names none (such layers keep their order)."""
    digits = re.search(r"\d+", name)
    return int(digits.group()) if digits else -1


def window_start(blocks: Sequence[int], block_size: int) -> tuple[int, tuple[int, ...]]:
    """P: a group's blocks of a finished prompt without the null blocks vLLM left for the
    tokens before a sliding window, and the first token of the first one kept."""
    skipped = 0
    while skipped < len(blocks) and blocks[skipped] == NULL_BLOCK:
        skipped += 1
    return skipped * block_size, tuple(blocks[skipped:])


def _total_kv_heads(model_config: object) -> int | None:
    total = getattr(model_config, "get_total_num_kv_heads", None)
    return int(total()) if callable(total) else None


@dataclass(frozen=True)
class Sources:
    """The P ranks a D rank receives a request's KV from (by tensor parallel rank)."""

    ranks: tuple[int, ...]
    #: ``(slot, of)`` when the one P rank writes the request into ``of`` D ranks (D runs the
    #: larger tensor parallel size), this rank being slot ``slot`` of them.
    share: tuple[int, int] | None = None


def sources_of(model: Model, cache: CacheLayout, p_tp: int) -> Sources:
    """Which of P's ``p_tp`` ranks hold this D rank's KV heads (the core's arithmetic, which
    D's receive path checks P against: ``kvpush._native.tp_sources``).

    Equal sizes pair rank with rank. P larger: every P rank holding some of D's heads writes
    them (one DONE each). D larger: the one P rank holding D's heads writes into each of its D
    ranks, which then names its share. MLA's latent is on every rank: one P rank per D rank.
    Raises :class:`LayoutError` when the two sizes cannot exchange KV.
    """
    ranks, share = tp_sources(
        model.tp_rank,
        model.tp_size,
        model.kv_heads,
        p_tp,
        total_kv_heads=model.total_kv_heads or None,
        mla=model.use_mla,
        slices_heads=cache.slices_heads,
    )
    return Sources(tuple(ranks), share)


@dataclass(frozen=True)
class CacheLayout:
    """A worker's layout, whether its blocks may only move whole, and whether its heads can be
    sliced between different tensor parallel sizes (see the module docs)."""

    layout: kvpush.KvLayout
    whole_blocks: bool
    #: The memory the regions address: the views' spans, overlaps merged (layers interleaved in
    #: one buffer by the block-outermost layouts overlap), as ``(address, bytes)``.
    memory: tuple[tuple[int, int], ...] = ()
    #: Whether P and D may hold different head shares (tensor parallel sizes).
    slices_heads: bool = False
    #: Why blocks are opaque, for the startup log; None when tokens move one by one.
    opaque_because: str | None = None
    #: A group drops the blocks before a window: P lists its blocks from the first block its
    #: window keeps, which starts at D's first listed token only with equal block sizes.
    windowed: bool = False
    #: Per view (layer), in order: the range ``(start, end)`` of its regions in ``layout``.
    layer_regions: tuple[tuple[int, int], ...] = ()

    def tokens_to_write(self, num_tokens: int) -> int:
        """Tokens to ask the planner for: whole blocks when blocks are opaque. The slots past
        the prompt carry P's scratch, which D overwrites as it decodes."""
        if not self.whole_blocks:
            return num_tokens
        block = self.layout.block_tokens
        return -(-num_tokens // block) * block

    def agreement(self) -> str:
        """What P and D must share beyond the model's geometry, for the handshake: the block
        size when blocks move whole, the tensor parallel size when heads cannot be sliced."""
        terms = []
        if self.whole_blocks:
            terms.append(f"whole-blocks-of-{self.layout.block_tokens}")
        elif self.windowed:
            terms.append(f"windowed-blocks-of-{self.layout.block_tokens}")
        if not self.slices_heads:
            terms.append(f"tp-{self.layout.tp_size}")
        return "|".join(terms)


def layout_from_caches(
    views: Sequence[TensorView], model: Model, groups: Sequence[int] | None = None
) -> CacheLayout:
    """The layout of one worker's KV caches (one view per layer, in layer order); ``groups``
    names each view's KV cache group as :class:`CacheGroups` numbers them (default: all 0)."""
    if not views:
        raise LayoutError("vLLM registered no KV cache tensors with the connector")
    if groups is None:
        groups = [0] * len(views)
    if len(groups) != len(views):
        raise LayoutError(f"{len(groups)} KV cache groups named for {len(views)} tensors")
    if model.kv_cache_layout is not None:
        cache = _from_kv_cache_layout(views, model, model.kv_cache_layout, groups)
    else:
        cache = _from_shapes(views, model, groups)
    if model.groups is not None and model.groups.any_windowed:
        cache = replace(cache, windowed=True)
    return cache


def _from_kv_cache_layout(
    views: Sequence[TensorView], model: Model, name: str, groups: Sequence[int]
) -> CacheLayout:
    order = KV_CACHE_LAYOUTS.get(name)
    if order is None:
        raise LayoutError(
            f"KV cache layout {name}: kvpush knows vLLM's {', '.join(KV_CACHE_LAYOUTS)}; "
            "set VLLM_KV_CACHE_LAYOUT to one of them"
        )
    # The view's axes in memory order, outermost first (KVCacheLayout.layer_view_order).
    view_order = tuple(axis - 1 for axis in order if axis != 0)
    geometry = {(v.shape[1:], v.element_size) for v in views if len(v.shape) == 4}
    if len(geometry) > 1:
        raise LayoutError(
            f"KV cache layout {name}: layers of different [H, N, C] {sorted(geometry)}; kvpush "
            "moves KV cache groups of one geometry (head count, head size, block size and "
            "dtype) per worker"
        )
    for v in views:
        _check_view(v, name, view_order)
    v0 = views[0]
    _, heads, kernel_tokens, cell = v0.shape
    e = v0.element_size
    cell_bytes = cell * e
    if model.block_size % kernel_tokens:
        raise LayoutError(
            f"KV cache layout {name}: kernel blocks of {kernel_tokens} tokens do not divide "
            f"vLLM's {model.block_size}-token blocks"
        )
    expected_heads = 1 if model.use_mla else model.kv_heads
    opaque_because = _opaque_because(model, heads, expected_heads)
    # Where a layer's heads sit: [H][N][C] or [N][H][C] innermost (one region per layer), or
    # blocks or layers between a head and its tokens (one region per layer and head).
    inner = tuple(axis - 1 for axis in order[-3:])
    heads_in_block = inner in ((_H, _N, _C), (_N, _H, _C))
    for v in views:
        _check_dense(v, name, inner if heads_in_block else (_N, _C))
    regions: list[kvpush.Region] = []
    layer_regions: list[tuple[int, int]] = []
    for v, group in zip(views, groups, strict=True):
        start = len(regions)
        block_stride = v.stride[_B] * e
        if heads_in_block:
            regions.append(kvpush.Region(v.data_ptr, block_stride, v.shape[_B], group))
        else:
            regions.extend(
                kvpush.Region(v.data_ptr + h * v.stride[_H] * e, block_stride, v.shape[_B], group)
                for h in range(heads)
            )
        layer_regions.append((start, len(regions)))
    whole_blocks = opaque_because is not None
    tp_rank, tp_size = (0, 1) if model.use_mla else (model.tp_rank, model.tp_size)
    # CPU attention scrambles tokens inside a head's [N][C] slab but keeps each KV head's slab
    # whole and apart: whole blocks still split by head (HND rows of one C cell).
    head_slabs = (
        whole_blocks
        and "CPU_ATTN" in model.backends
        and inner == (_H, _N, _C)
        and heads == expected_heads
        and not model.use_mla
    )
    if head_slabs:
        layout_heads, head_bytes, token_order = heads, cell_bytes, "HND"
    elif whole_blocks:
        # A block unit as `kernel_tokens` equal rows: exact for whole blocks, which is all an
        # opaque block may be copied as.
        layout_heads = 1
        head_bytes = heads * cell_bytes if heads_in_block else cell_bytes
        token_order = "NHD"
    elif heads_in_block and not model.use_mla:
        layout_heads, head_bytes = heads, cell_bytes
        token_order = "HND" if inner == (_H, _N, _C) else "NHD"
    else:
        # One head per region, or MLA's one latent in any layout: both orders are the same
        # bytes, so P and D agree whichever of them their layouts name.
        layout_heads, head_bytes, token_order = 1, cell_bytes, "HND"
    layout = kvpush.KvLayout(
        regions,
        block_tokens=model.block_size,
        kernel_block_tokens=kernel_tokens,
        heads=layout_heads,
        head_bytes=head_bytes,
        token_order=token_order,  # type: ignore[arg-type]
        tp_rank=tp_rank,
        tp_size=tp_size,
    )
    slices_heads = model.use_mla or head_slabs or (not whole_blocks and inner == (_H, _N, _C))
    return CacheLayout(
        layout,
        whole_blocks=whole_blocks,
        memory=_merged_spans(views),
        slices_heads=slices_heads,
        opaque_because=opaque_because,
        layer_regions=tuple(layer_regions),
    )


def _opaque_because(model: Model, heads: int, expected_heads: int) -> str | None:
    if not model.backends:
        return "vLLM named no attention backend"
    if "CPU_ATTN" in model.backends:
        return "CPU_ATTN keeps each head's K transposed inside a block"
    others = sorted(set(model.backends) - TOKEN_CELL_BACKENDS)
    if others:
        return f"backend {', '.join(others)} is not known to keep one token per C cell"
    if heads != expected_heads:
        return f"{heads} head slots per token where the model has {expected_heads} KV heads"
    return None


def _check_view(v: TensorView, name: str, view_order: tuple[int, ...]) -> None:
    """The view is [B, H, N, C] with C contiguous and its axes nested as the layout says."""
    if len(v.shape) != 4:
        raise LayoutError(
            f"KV cache layout {name}: vLLM's layer caches are [B, H, N, C] views, but a tensor "
            f"has shape {v.shape}"
        )
    if v.stride[_C] != 1:
        raise LayoutError(
            f"KV cache layout {name}: the C axis of a [B, H, N, C] view is not contiguous "
            f"(strides {v.stride})"
        )
    for outer, inner in pairwise(view_order):
        if v.stride[outer] < v.stride[inner] * v.shape[inner]:
            raise LayoutError(
                f"KV cache layout {name}: a tensor of shape {v.shape} has strides {v.stride}, "
                f"which do not nest [B, H, N, C] in {name}'s order; the tensor was not "
                "allocated for this layout"
            )


def _check_dense(v: TensorView, name: str, inner: tuple[int, ...]) -> None:
    """The innermost axes, which the planner reads as one block of rows, have no gaps."""
    expected = 1
    for axis in reversed(inner):
        if v.stride[axis] != expected and v.shape[axis] > 1:
            raise LayoutError(
                f"KV cache layout {name}: strides {v.stride} of a tensor of shape {v.shape} pad "
                "the inside of a block, which kvpush cannot address"
            )
        expected *= v.shape[axis]


def _merged_spans(views: Sequence[TensorView]) -> tuple[tuple[int, int], ...]:
    spans: list[tuple[int, int]] = []
    for start, size in sorted((v.data_ptr, v.nbytes) for v in views):
        if spans and start <= spans[-1][0] + spans[-1][1]:
            first, last_size = spans[-1]
            spans[-1] = (first, max(last_size, start + size - first))
        else:
            spans.append((start, size))
    return tuple(spans)


def _from_shapes(views: Sequence[TensorView], model: Model, groups: Sequence[int]) -> CacheLayout:
    """vLLM before 0.28: recognise the tensors by shape."""
    regions: list[kvpush.Region] = []
    shapes = {_classify(v, model) for v in views}
    if len(shapes) != 1:
        raise LayoutError(f"KV cache tensors of different shapes: {sorted(shapes)}")
    (kind,) = shapes
    e = views[0].element_size
    layer_regions: list[tuple[int, int]] = []
    for v, group in zip(views, groups, strict=True):
        start = len(regions)
        if kind == "cpu":
            regions.append(kvpush.Region(v.data_ptr, v.stride[0] * e, v.shape[0], group))
        elif kind in ("flash_nhd", "flash_hnd"):
            for half in range(2):
                base = v.data_ptr + half * v.stride[0] * e
                regions.append(kvpush.Region(base, v.stride[1] * e, v.shape[1], group))
        else:  # flashinfer
            for half in range(2):
                base = v.data_ptr + half * v.stride[1] * e
                regions.append(kvpush.Region(base, v.stride[0] * e, v.shape[0], group))
        layer_regions.append((start, len(regions)))
    if kind == "cpu":
        # Each head's [block_size][2D] slab is whole and apart, its tokens scrambled: whole
        # blocks, split by head (as the layout-aware reader does).
        heads, head_bytes, order = model.kv_heads, 2 * model.head_size * e, "HND"
    else:
        heads, head_bytes = model.kv_heads, model.head_size * e
        order = "HND" if kind == "flash_hnd" else "NHD"
    layout = kvpush.KvLayout(
        regions,
        block_tokens=model.block_size,
        heads=heads,
        head_bytes=head_bytes,
        token_order=order,  # type: ignore[arg-type]
        tp_rank=model.tp_rank,
        tp_size=model.tp_size,
    )
    return CacheLayout(
        layout,
        whole_blocks=kind == "cpu",
        memory=_merged_spans(views),
        slices_heads=order == "HND",
        opaque_because="CPU attention packs a block's tokens together" if kind == "cpu" else None,
        layer_regions=tuple(layer_regions),
    )


def _classify(v: TensorView, m: Model) -> str:
    h, d, bs = m.kv_heads, m.head_size, m.block_size
    if len(v.shape) == 4 and v.shape[1:] == (h, bs, 2 * d) and _dense_inner(v, 1):
        return "cpu"
    if len(v.shape) == 5 and v.shape[0] == 2 and v.shape[2:] == (bs, h, d):
        # Inside a block: NHD has tokens outermost, HND heads outermost.
        if v.stride[2] == h * d and v.stride[3] == d and v.stride[4] == 1:
            return "flash_nhd"
        if v.stride[3] == bs * d and v.stride[2] == d and v.stride[4] == 1:
            return "flash_hnd"
    if len(v.shape) == 5 and v.shape[1] == 2 and v.shape[2:] == (bs, h, d) and _dense_inner(v, 2):
        return "flashinfer"
    raise LayoutError(
        f"unsupported KV cache tensor: shape {v.shape}, strides {v.stride} for {h} KV heads of "
        f"size {d} in blocks of {bs}; kvpush knows the CPU, FlashAttention and FlashInfer layouts"
    )


def _dense_inner(v: TensorView, first: int) -> bool:
    """Dimensions from ``first`` on are packed row-major (no padding inside a block)."""
    expected = 1
    for n, s in zip(reversed(v.shape[first:]), reversed(v.stride[first:]), strict=True):
        if s != expected:
            return False
        expected *= n
    return True
