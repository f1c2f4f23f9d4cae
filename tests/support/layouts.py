"""KV layouts for the planner and binding tests."""

from __future__ import annotations

import kvpush

HEADS = 2
HEAD_BYTES = 8


def make_layout(
    block_tokens: int,
    num_blocks: int,
    regions: int = 4,
    *,
    heads: int = HEADS,
    order: str = "NHD",
    tp: tuple[int, int] = (0, 1),
    base: int = 0,
) -> kvpush.KvLayout:
    """`regions` back-to-back regions of `num_blocks` blocks each, starting at `base`."""
    block_bytes = block_tokens * heads * HEAD_BYTES
    return kvpush.KvLayout(
        [
            kvpush.Region(base + i * num_blocks * block_bytes, block_bytes, num_blocks)
            for i in range(regions)
        ],
        block_tokens=block_tokens,
        heads=heads,
        head_bytes=HEAD_BYTES,
        token_order=order,  # type: ignore[arg-type]
        tp_rank=tp[0],
        tp_size=tp[1],
    )
