"""A P and a D worker on one transport (in this process, or two processes over NIXL), with
paged KV caches in numpy, and requests with scattered blocks for them."""

from __future__ import annotations

import random
from typing import Any

from kvpush_lab.cache import CacheShape, Request
from kvpush_lab.peer import RemoteWorker, Worker
from tests.support.nixl import nixl_or_skip

P_SHAPE = CacheShape(layers=4, num_blocks=256, block_tokens=16)
D_SHAPE = CacheShape(layers=4, num_blocks=128, block_tokens=32)
P_SEED = 1234
UCX_LOOPBACK = {"UCX_NET_DEVICES": "lo"}
TRANSPORTS = {
    "loopback": None,
    "nixl": UCX_LOOPBACK,
    "nixl-tcp": {**UCX_LOOPBACK, "UCX_TLS": "tcp"},
}


class Pair:
    """A P and a D worker on one transport."""

    def __init__(
        self,
        transport: str,
        p_secret: bytes | None,
        d_secret: bytes | None,
        options: dict[str, Any] | None = None,
        *,
        d_shape: CacheShape = D_SHAPE,
    ) -> None:
        env = TRANSPORTS[transport]
        self.transport = transport
        if env is not None:
            nixl_or_skip()

        def worker(role: str, shape: CacheShape, seed: int | None, secret: bytes | None) -> Any:
            if env is None:
                return Worker(role, shape, seed, "loopback", secret, options or {})
            return RemoteWorker(
                env,
                role=role,
                shape=shape,
                seed=seed,
                transport="nixl",
                secret=secret,
                options=options or {},
            )

        self.p: Any = worker("p", P_SHAPE, P_SEED, p_secret)
        self.d: Any = worker("d", d_shape, None, d_secret)
        self.source = self.p.address()

    def verify(self, delivered: list[Request]) -> None:
        result = self.d.verify(P_SHAPE, P_SEED, delivered)
        assert result["wrong"] == 0, f"{result['wrong']} of {result['bytes']} bytes of D are wrong"

    def close(self) -> None:
        self.d.close()
        self.p.close()


def make_requests(
    rng: random.Random,
    count: int,
    prefix: str,
    *,
    cached_blocks: int = 0,
    d_shape: CacheShape = D_SHAPE,
    whole_blocks: bool = False,
) -> list[Request]:
    """``count`` requests with scattered, disjoint blocks on both sides (of whole blocks of
    both sides only, with ``whole_blocks``)."""
    p_free = rng.sample(range(P_SHAPE.num_blocks), P_SHAPE.num_blocks)
    d_free = rng.sample(range(d_shape.num_blocks), d_shape.num_blocks)
    requests = []
    for i in range(count):
        d_first = cached_blocks * d_shape.block_tokens
        tokens = rng.randint(d_first + 1, d_first + 150)
        if whole_blocks:
            unit = max(P_SHAPE.block_tokens, d_shape.block_tokens)
            tokens = d_first + unit * max(1, (tokens - d_first) // unit)
        p_count = -(-tokens // P_SHAPE.block_tokens)
        d_count = -(-(tokens - d_first) // d_shape.block_tokens)
        p_blocks, p_free = tuple(p_free[:p_count]), p_free[p_count:]
        d_blocks, d_free = tuple(d_free[:d_count]), d_free[d_count:]
        requests.append(
            Request(f"cmpl-{prefix}{i}-0", tokens, p_blocks, d_blocks, d_first, f"xfer-{prefix}{i}")
        )
    return requests
