"""From vLLM's per-layer KV cache tensors to a :class:`kvpush.KvLayout`.

vLLM hands the connector one tensor per attention layer; its shape depends on the attention
backend. kvpush describes memory as regions of blocks with heads in NHD or HND order, so each
known shape maps onto that model:

* CPU attention (``CPU_ATTN``): ``[blocks, kv_heads, block_size, 2 * head_size]``: per head,
  the block's K rows then its V rows. That is HND with ``2 * kv_heads`` pseudo-heads (K of head
  ``h`` is pseudo-head ``2h``, V is ``2h + 1``), one region per layer. A rank's pseudo-heads stay
  a contiguous global range, so tensor-parallel slicing still works.
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


def layout_from_caches(views: Sequence[TensorView], model: Model) -> kvpush.KvLayout:
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
        heads, order = 2 * model.kv_heads, "HND"
    else:
        heads, order = model.kv_heads, "HND" if kind == "flash_hnd" else "NHD"
    return kvpush.KvLayout(
        regions,
        block_tokens=model.block_size,
        heads=heads,
        head_bytes=model.head_size * e,
        token_order=order,  # type: ignore[arg-type]
        tp_rank=model.tp_rank,
        tp_size=model.tp_size,
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
