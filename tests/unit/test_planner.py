"""The planner through the binding: byte placement, translation, validation errors."""

from __future__ import annotations

import random

import pytest

import kvpush
from kvpush._native import lab
from kvpush.exceptions import InvalidBlocksError, KvPushError, LayoutError, PlanError
from tests.support.layouts import HEAD_BYTES, HEADS, make_layout


def apply(plan: lab.Plan, src: bytes, dst: bytearray) -> None:
    for s, d, n in plan.runs():
        dst[d : d + n] = src[s : s + n]


def token_at(
    layout: kvpush.KvLayout, region: int, blocks: list[int], first: int, token: int
) -> int:
    reg = layout.regions[region]
    bt = layout.block_tokens
    return (
        reg.base
        + blocks[(token - first) // bt] * reg.block_stride
        + (token % bt) * HEADS * HEAD_BYTES
    )


@pytest.mark.parametrize(("p_block", "d_block"), [(16, 16), (16, 32), (32, 16), (8, 32)])
def test_every_token_lands_where_d_expects_and_nothing_else_changes(
    p_block: int, d_block: int
) -> None:
    rng = random.Random(p_block * 100 + d_block)
    src_layout, dst_layout = make_layout(p_block, 64), make_layout(d_block, 64)
    num_tokens = 300
    p_blocks = rng.sample(range(64), -(-num_tokens // p_block))
    d_blocks = rng.sample(range(64), -(-num_tokens // d_block))
    src = rng.randbytes(4 * 64 * p_block * HEADS * HEAD_BYTES)
    dst = bytearray(b"\xee" * (4 * 64 * d_block * HEADS * HEAD_BYTES))
    expected = bytearray(dst)

    plan = lab.Planner(src_layout, dst_layout).plan("req-1", num_tokens, [p_blocks], [d_blocks])
    apply(plan, src, dst)

    token_bytes = HEADS * HEAD_BYTES
    for region in range(4):
        for token in range(num_tokens):
            s = token_at(src_layout, region, p_blocks, 0, token)
            d = token_at(dst_layout, region, d_blocks, 0, token)
            expected[d : d + token_bytes] = src[s : s + token_bytes]
    assert dst == expected
    assert plan.bytes == 4 * num_tokens * token_bytes


def test_contiguous_blocks_merge_into_one_run_per_region() -> None:
    planner = lab.Planner(make_layout(16, 64), make_layout(16, 64))
    plan = planner.plan("req-merge", 16 * 10, list(range(10)), list(range(20, 30)))
    assert len(plan) == 4
    assert plan.unmerged_runs == 40
    runs = plan.runs()
    assert all(n == 10 * 16 * HEADS * HEAD_BYTES for _, _, n in runs)
    raw = memoryview(plan.to_bytes()).cast("Q")
    assert [tuple(raw[i : i + 3]) for i in range(0, len(raw), 3)] == runs


def test_prefix_hit_on_d_writes_only_the_uncached_suffix() -> None:
    planner = lab.Planner(make_layout(16, 64, regions=1), make_layout(16, 64, regions=1))
    plan = planner.plan("req-prefix", 64, [[0, 1, 2, 3]], [[10, 11]], dst_first_tokens=[32])
    token_bytes = HEADS * HEAD_BYTES
    assert plan.bytes == 32 * token_bytes
    # P's blocks 2 and 3 (tokens 32..63) go to D's blocks 10 and 11.
    assert plan.runs() == [(2 * 16 * token_bytes, 10 * 16 * token_bytes, 32 * token_bytes)]


def test_hnd_head_slicing_between_tp_sizes() -> None:
    d = make_layout(16, 8, regions=1, heads=2, order="HND", tp=(0, 1))
    p0 = make_layout(16, 8, regions=1, heads=1, order="HND", tp=(0, 2))
    p1 = make_layout(16, 8, regions=1, heads=1, order="HND", tp=(1, 2))
    head_block = 16 * HEAD_BYTES
    run0 = lab.Planner(p0, d).plan("req-tp", 16, [[3]], [[5]]).runs()
    run1 = lab.Planner(p1, d).plan("req-tp", 16, [[3]], [[5]]).runs()
    d_block = 5 * 2 * head_block
    assert run0 == [(3 * head_block, d_block, head_block)]
    assert run1 == [(3 * head_block, d_block + head_block, head_block)]


def test_nhd_cannot_split_heads_between_tp_sizes() -> None:
    d = make_layout(16, 8, heads=2, tp=(0, 1))
    p = make_layout(16, 8, heads=1, tp=(0, 2))
    with pytest.raises(LayoutError, match="HND") as caught:
        lab.Planner(p, d)
    assert caught.value.code == "incompatible_layouts"


@pytest.mark.parametrize(
    ("d_blocks", "code", "text"),
    [
        ([[64, 1]], "block_out_of_range", "names block 64"),
        ([[5, 5]], "duplicate_block", "block 5 more than once"),
        ([[1, 2, 3]], "block_count_mismatch", "lists 3 blocks"),
        ([[1], [2]], "group_count", "2 KV cache groups"),
    ],
)
def test_bad_peer_input_is_refused_naming_request_and_value(
    d_blocks: list[list[int]], code: str, text: str
) -> None:
    planner = lab.Planner(make_layout(16, 64), make_layout(16, 64))
    with pytest.raises(InvalidBlocksError, match=text) as caught:
        planner.plan("req-bad", 20, [[7, 8]], d_blocks)
    error = caught.value
    assert isinstance(error, PlanError)
    assert isinstance(error, KvPushError)
    assert error.code == code
    assert error.request == "req-bad"  # type: ignore[attr-defined]
    assert "req-bad" in str(error)


def test_invalid_layouts_are_refused_on_creation() -> None:
    with pytest.raises(LayoutError, match="block_tokens") as caught:
        kvpush.KvLayout([kvpush.Region(0, 32, 4)], block_tokens=0, heads=1, head_bytes=2)
    assert caught.value.code == "invalid_layout"
    with pytest.raises(LayoutError, match="stride"):
        kvpush.KvLayout([kvpush.Region(0, 8, 4)], block_tokens=16, heads=1, head_bytes=2)
    with pytest.raises(ValueError, match="token_order"):
        kvpush.KvLayout(
            [kvpush.Region(0, 32, 4)],
            block_tokens=16,
            heads=1,
            head_bytes=2,
            token_order="XYZ",  # type: ignore[arg-type]
        )


def test_layout_round_trips_through_dict() -> None:
    layout = make_layout(16, 64, order="HND", tp=(1, 2))
    again = kvpush.KvLayout.from_dict(layout.to_dict())
    assert again == layout
    assert again.token_order == "HND"
    assert again.regions[1].base == layout.regions[1].base
