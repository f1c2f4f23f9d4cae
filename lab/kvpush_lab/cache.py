"""The paged KV cache of the two-process peer: one numpy buffer, its kvpush layout, and the
patterns tests and benchmarks write into it and check it by.

A cache is ``[layers, K/V, blocks, block_tokens, heads, head_dim]`` fp16 (NHD), one region (array
of blocks) per layer and K or V, all back to back in one buffer. It is filled once, at start,
page by page (first-touch faults would otherwise land in whichever transfer touches a page
first), either with random bytes from a seed (P's "computed" KV, which D's whole cache is then
compared with: :func:`expected_destination`) or with a repeated 64-bit word (an empty cache: the
sentinel, or the benchmark's fill). The benchmark also stamps every block's first 8 bytes with a
per-repeat sequence and the block's own index (:meth:`PagedCache.stamp`), which D checks at the
cost of one gather (:meth:`PagedCache.wrong_blocks`).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

import kvpush

DTYPE = np.float16
#: Every byte of an empty cache: P's bytes differ from it but for 1 in 256.
SENTINEL = 0x5A
SENTINEL_WORD = int.from_bytes(bytes([SENTINEL]) * 8, "little")

IndexArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class CacheShape:
    """A paged KV cache ``[layers, K/V, num_blocks, block_tokens, heads, head_dim]`` (NHD)."""

    layers: int
    num_blocks: int
    block_tokens: int
    heads: int = 2
    head_dim: int = 16

    @property
    def regions(self) -> int:
        return 2 * self.layers

    @property
    def head_bytes(self) -> int:
        return self.head_dim * np.dtype(DTYPE).itemsize

    @property
    def token_bytes(self) -> int:
        return self.heads * self.head_bytes

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.token_bytes

    @property
    def bytes(self) -> int:
        return self.regions * self.num_blocks * self.block_bytes

    @property
    def descriptors(self) -> int:
        """Blocks over all regions: the descriptors of a whole-cache request before merging."""
        return self.regions * self.num_blocks

    @property
    def dims(self) -> tuple[int, ...]:
        return (self.layers, 2, self.num_blocks, self.block_tokens, self.heads, self.head_dim)

    def layout(self, base: int) -> kvpush.KvLayout:
        """The layout of a cache of this shape whose buffer starts at ``base``."""
        region_bytes = self.num_blocks * self.block_bytes
        regions = [
            kvpush.Region(base + r * region_bytes, self.block_bytes, self.num_blocks)
            for r in range(self.regions)
        ]
        return kvpush.KvLayout(
            regions, block_tokens=self.block_tokens, heads=self.heads, head_bytes=self.head_bytes
        )

    def block_indices(self, blocks: IndexArray) -> npt.NDArray[np.int32]:
        """Indices into a list of every block of every region (region-major), for ``blocks`` of
        each region in turn: what vLLM's connector hands NIXL's ``make_prepped_xfer``."""
        rows = np.arange(self.regions, dtype=np.int64)[:, None] * self.num_blocks
        indices: npt.NDArray[np.int32] = (rows + blocks[None, :]).ravel().astype(np.int32)
        return indices


class PagedCache:
    """A cache of ``shape`` in numpy: random bytes from ``seed``, else every 64-bit word
    ``fill`` (the sentinel unless given). ``pretouch_s`` is how long filling it took."""

    def __init__(self, shape: CacheShape, seed: int | None = None, fill: int = SENTINEL_WORD):
        self.shape = shape
        started = time.perf_counter()
        if seed is None:
            self.array = np.empty(shape.dims, dtype=DTYPE)
            self.words.fill(fill)
        else:
            # P's "computed" KV: every byte differs from its neighbours and from the sentinel.
            raw = np.random.default_rng(seed).integers(0, 256, shape.bytes, np.uint8)
            self.array = raw.view(DTYPE).reshape(shape.dims)
        self.pretouch_s = time.perf_counter() - started
        ids = np.arange(shape.descriptors, dtype=np.uint64)
        self._ids = ids.reshape(shape.regions, shape.num_blocks)

    @property
    def words(self) -> npt.NDArray[np.uint64]:
        words: npt.NDArray[np.uint64] = self.array.reshape(-1).view(np.uint64)
        return words

    @property
    def flat(self) -> npt.NDArray[np.uint8]:
        """The whole cache as one flat byte array (a view)."""
        flat: npt.NDArray[np.uint8] = self.array.view(np.uint8).reshape(-1)
        return flat

    @property
    def address(self) -> int:
        return int(self.array.ctypes.data)

    def layout(self) -> kvpush.KvLayout:
        return self.shape.layout(self.address)

    def memory(self) -> list[tuple[int, int]]:
        """What an endpoint registers (``memory=``): the whole buffer."""
        return [(self.address, self.array.nbytes)]

    def token(self, layer: int, kv: int, blocks: tuple[int, ...], first: int, token: int) -> Any:
        """One token's heads, in a request whose ``blocks`` hold its tokens from ``first``."""
        bt = self.shape.block_tokens
        return self.array[layer, kv, blocks[(token - first) // bt], token % bt]

    # ---- checks -------------------------------------------------------------------------------

    def digest(self) -> str:
        """sha256 of the whole cache's bytes: a canary that any write changes."""
        return hashlib.sha256(self.array.view(np.uint8).data).hexdigest()

    def blocks_digest(self, blocks: list[int]) -> str:
        """sha256 of ``blocks``, in the order given, in every layer and K/V: the same on P and D
        when D's blocks hold P's whole (caches of one block size), whatever their size."""
        digest = hashlib.sha256()
        for layer in range(self.shape.layers):
            for kv in range(2):
                digest.update(self.array[layer, kv, blocks].tobytes())
        return digest.hexdigest()

    def copy(self) -> npt.NDArray[np.uint8]:
        """The whole cache's bytes, copied."""
        copy: npt.NDArray[np.uint8] = self.flat.copy()
        return copy

    def changed_since(self, then: npt.NDArray[np.uint8]) -> int:
        """Bytes that differ from ``then`` (a :meth:`copy`)."""
        now = self.flat
        # In slices: a cache of hundreds of MiB is compared without a copy of its own size.
        step = 16 << 20
        return sum(
            int(np.count_nonzero(now[i : i + step] != then[i : i + step]))
            for i in range(0, now.size, step)
        )

    def landed(self, stride: int = 1) -> int:
        """Bytes unlike the sentinel (every ``stride``-th byte, the count scaled)."""
        return int(np.count_nonzero(self.flat[::stride] != SENTINEL)) * stride

    # ---- the benchmark's stamps ---------------------------------------------------------------

    def _stamps(self) -> npt.NDArray[np.uint64]:
        """The first 8 bytes of every block, ``[regions, blocks]`` (a view)."""
        s = self.shape
        stamps: npt.NDArray[np.uint64] = self.words.reshape(s.regions, s.num_blocks, -1)[:, :, 0]
        return stamps

    def stamp(self, sequence: int) -> None:
        """Every block's first 8 bytes: ``sequence`` and the block's own index."""
        self._stamps()[...] = np.uint64(sequence << 32) | self._ids

    def wrong_blocks(self, sequence: int, p_blocks: IndexArray, d_blocks: IndexArray) -> int:
        """Blocks of D (named in ``d_blocks``) not holding P's stamp for ``sequence``: a transfer
        that wrote nothing, wrote the wrong blocks, or is left over from an earlier repeat."""
        expected = np.uint64(sequence << 32) | self._ids[:, p_blocks]
        return int(np.count_nonzero(self._stamps()[:, d_blocks] != expected))


@dataclass(frozen=True)
class Request:
    """One transfer: P's blocks cover the whole prompt, D's only tokens from ``d_first``."""

    request_id: str
    tokens: int
    p_blocks: tuple[int, ...]
    d_blocks: tuple[int, ...]
    d_first: int = 0
    transfer_id: str | None = None


def expected_destination(
    p_shape: CacheShape, p_seed: int, d_shape: CacheShape, requests: list[Request]
) -> np.ndarray:
    """D's whole cache as an independent per-token copy says it must be after ``requests``."""
    source = PagedCache(p_shape, p_seed)
    expected = PagedCache(d_shape)
    for r in requests:
        for layer in range(p_shape.layers):
            for kv in range(2):
                for t in range(r.d_first, r.tokens):
                    expected.token(layer, kv, r.d_blocks, r.d_first, t)[...] = source.token(
                        layer, kv, r.p_blocks, 0, t
                    )
    return expected.array
