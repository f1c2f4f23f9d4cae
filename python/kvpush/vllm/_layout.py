"""From vLLM's per-layer KV cache tensors to a :class:`kvpush.KvLayout`.

vLLM hands the connector one tensor per attention layer; its shape depends on the attention
backend. kvpush describes memory as regions of blocks with heads in NHD or HND order, so each
known shape maps onto that model:

* CPU attention (``CPU_ATTN``): ``[blocks, kv_heads, block_size, 2 * head_size]``. Inside a
  block the kernels keep, per head, K *transposed* (``[head_size][block_size]``) and then V
  (``[block_size][head_size]``) (measured with ``cpu_attn_reshape_and_cache``), so one token's
  K is not contiguous and no token range of a block is a byte range. Such blocks are *opaque*:
  they move whole, between P and D of the same block size, which :class:`CacheLayout` says with
  ``whole_blocks``. The layout presents a block as ``block_size`` rows of equal bytes so that
  the planner's whole-block runs are exact.
* FlashAttention-style: ``[2, blocks, block_size, kv_heads, head_size]`` (K and V halves), in
  NHD order, or HND when the strides say heads are outermost inside a block.
* FlashInfer-style: ``[blocks, 2, block_size, kv_heads, head_size]``.

Only shapes, strides, element sizes and addresses are read (:class:`TensorView`), so this module
needs no torch and is tested without vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import kvpush
from kvpush.exceptions import LayoutError


@dataclass(frozen=True)
class TensorView:
    """What the layout needs of a tensor: address, shape and strides (in elements)."""

    data_ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    element_size: int

    @classmethod
    def of(cls, tensor: object) -> TensorView:
        """From a torch tensor (duck-typed: ``data_ptr()``, ``shape``, ``stride()``,
        ``element_size()``)."""
        t = tensor
        return cls(
            t.data_ptr(),  # type: ignore[attr-defined]
            tuple(t.shape),  # type: ignore[attr-defined]
            tuple(t.stride()),  # type: ignore[attr-defined]
            t.element_size(),  # type: ignore[attr-defined]
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
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1


@dataclass(frozen=True)
class CacheLayout:
    """A worker's layout, and whether its blocks may only move whole (see the module docs)."""

    layout: kvpush.KvLayout
    whole_blocks: bool

    def tokens_to_write(self, num_tokens: int) -> int:
        """Tokens to ask the planner for: whole blocks when blocks are opaque. The slots past
        the prompt carry P's scratch, which D overwrites as it decodes."""
        if not self.whole_blocks:
            return num_tokens
        block = self.layout.block_tokens
        return -(-num_tokens // block) * block


def layout_from_caches(views: Sequence[TensorView], model: Model) -> CacheLayout:
    """The layout of one worker's KV caches (one view per layer, in layer order)."""
    if not views:
        raise LayoutError("vLLM registered no KV cache tensors with the connector")
    regions: list[kvpush.Region] = []
    shapes = {_classify(v, model) for v in views}
    if len(shapes) != 1:
        raise LayoutError(f"KV cache tensors of different shapes: {sorted(shapes)}")
    (kind,) = shapes
    e = views[0].element_size
    for v in views:
        if kind == "cpu":
            regions.append(kvpush.Region(v.data_ptr, v.stride[0] * e, v.shape[0]))
        elif kind in ("flash_nhd", "flash_hnd"):
            for half in range(2):
                base = v.data_ptr + half * v.stride[0] * e
                regions.append(kvpush.Region(base, v.stride[1] * e, v.shape[1]))
        else:  # flashinfer
            for half in range(2):
                base = v.data_ptr + half * v.stride[1] * e
                regions.append(kvpush.Region(base, v.stride[0] * e, v.shape[0]))
    if kind == "cpu":
        # A block as `block_size` equal rows holding every head's K and V: exact for whole
        # blocks, which is all an opaque block may be copied as.
        heads, head_bytes, order = 1, model.kv_heads * 2 * model.head_size * e, "NHD"
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
    return CacheLayout(layout, whole_blocks=kind == "cpu")


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
