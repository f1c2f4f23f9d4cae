"""``kvpush demo``: the core's request lifecycle, end to end, in one process.

Two simulated workers, P (16-token blocks) and D (32-token blocks), hold paged KV caches in
``bytearray``s. For each request, D's registration travels as a signed kvpush/1 frame and P's
"KV ready" arrives in random order; the rendezvous table matches them, the planner turns both
block lists into byte runs, and the runs are applied with an in-process memcpy: the stand-in for
the NIXL WRITE, which this demo does not use. D's whole cache is then compared byte for byte with
an independent per-token copy, so a wrong or stray write fails the demo.

The second half shows refusals: a forged frame, a replayed frame, a registration naming blocks D
does not have, a stale epoch, and a transfer whose P side was cancelled before D registered.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

import kvpush
from kvpush._native import lab
from kvpush.exceptions import KvPushError

HEADS = 2
HEAD_BYTES = 16
P_BLOCK_TOKENS = 16
D_BLOCK_TOKENS = 32
P_BLOCKS = 512
D_BLOCKS = 256
TTL_S = 30.0


@dataclass
class Worker:
    """One side's paged KV cache: its layout, its memory and its free blocks."""

    name: str
    layout: kvpush.KvLayout
    memory: bytearray
    free: list[int]

    @classmethod
    def create(cls, name: str, layers: int, block_tokens: int, num_blocks: int) -> Worker:
        block_bytes = block_tokens * HEADS * HEAD_BYTES
        region_bytes = block_bytes * num_blocks
        regions = [
            kvpush.Region(base=i * region_bytes, block_stride=block_bytes, num_blocks=num_blocks)
            for i in range(2 * layers)  # K and V of each layer
        ]
        layout = kvpush.KvLayout(
            regions, block_tokens=block_tokens, heads=HEADS, head_bytes=HEAD_BYTES
        )
        return cls(name, layout, bytearray(region_bytes * len(regions)), list(range(num_blocks)))

    def allocate(self, rng: random.Random, tokens: int) -> list[int]:
        """Blocks from the head of the free list, as vLLM's allocator hands them out: a fresh
        engine's blocks are consecutive, and they fragment as requests end out of order."""
        count = -(-tokens // self.layout.block_tokens)
        if count > len(self.free):
            raise RuntimeError(f"{self.name}: out of KV blocks ({count} needed)")
        blocks, self.free = self.free[:count], self.free[count:]
        return blocks

    def release(self, rng: random.Random, blocks: list[int]) -> None:
        freed = list(blocks)
        rng.shuffle(freed)  # requests end in any order, so freed blocks return scrambled
        self.free.extend(freed)

    def token_slice(self, region: int, blocks: list[int], first_token: int, token: int) -> slice:
        """Where ``token``'s K or V bytes (all heads: NHD) live in this worker's memory."""
        block_tokens = self.layout.block_tokens
        index = (token - first_token) // block_tokens
        reg = self.layout.regions[region]
        token_bytes = HEADS * HEAD_BYTES
        start = reg.base + blocks[index] * reg.block_stride + (token % block_tokens) * token_bytes
        return slice(start, start + token_bytes)


@dataclass
class Outcome:
    request: str
    tokens: int
    cached: int
    order: str
    runs: int
    unmerged: int
    written: int
    plan_us: float


def _say(out: TextIO, text: str = "") -> None:
    out.write(text + "\n")
    out.flush()


def run_demo(
    requests: int = 24,
    layers: int = 8,
    seed: int = 0,
    secret: bool = True,
    out: TextIO | None = None,
) -> bool:
    """Runs the demo; returns True when every byte D received is where it belongs."""
    out = out or sys.stdout
    rng = random.Random(seed)
    key = rng.randbytes(32) if secret else None
    p = Worker.create("P", layers, P_BLOCK_TOKENS, P_BLOCKS)
    d = Worker.create("D", layers, D_BLOCK_TOKENS, D_BLOCKS)
    p.memory[:] = rng.randbytes(len(p.memory))  # P's computed KV
    expected = bytearray(len(d.memory))  # D's memory as a per-token copy says it must end up

    planner = lab.Planner(p.layout, d.layout)
    table = lab.RendezvousTable()
    d_encoder, p_decoder = lab.Encoder("decode-0", key), lab.Decoder(key)
    p_encoder, d_decoder = lab.Encoder("prefill-0", key), lab.Decoder(key)

    _say(out, f"kvpush {kvpush.__version__} demo: core walkthrough in one process")
    _say(
        out,
        f"  P: {2 * layers} regions, {P_BLOCK_TOKENS}-token blocks | D: {2 * layers} regions, "
        f"{D_BLOCK_TOKENS}-token blocks | {HEADS} heads x {HEAD_BYTES} B | control messages "
        f"{'HMAC-signed' if secret else 'unsigned'}",
    )
    _say(out, "  data path: in-process memcpy standing in for the NIXL WRITE\n")
    header = f"{'request':<13}{'tokens':>7}{'cached':>7}  {'arrival':<10}{'runs':>6}"
    _say(out, header + f"{'unmerged':>9}{'bytes':>9}{'plan':>10}  progress")

    outcomes: list[Outcome] = []
    for i in range(requests):
        tokens = rng.randint(20, 700)
        cached = D_BLOCK_TOKENS * rng.randint(0, 1) if tokens > 2 * D_BLOCK_TOKENS else 0
        request = f"cmpl-{i:04x}-0"
        p_blocks = p.allocate(rng, tokens)
        d_blocks = d.allocate(rng, tokens - cached)
        register = {
            "kind": "register",
            "transfer_key": kvpush.transfer_key(request),
            "request_id": f"{request}-{rng.getrandbits(32):08x}",
            "epoch": 1,
            "engine_id": "decode-0",
            "address": "127.0.0.1:0",
            "tp_rank": 0,
            "tp_size": 1,
            "groups": [{"first_token": cached, "block_ids": d_blocks}],
            "num_tokens": tokens,
            "ttl_ms": int(TTL_S * 1000),
        }

        def arrive_registration(frame: bytes = d_encoder.encode(register)) -> lab.Arrival:
            reg = p_decoder.decode(frame)["message"]
            return table.register(reg["transfer_key"], reg["epoch"], reg, ttl=TTL_S)

        def arrive_ready(blocks: list[int] = p_blocks, rid: str = request) -> lab.Arrival:
            return table.ready(f"{rid}-{rng.getrandbits(32):08x}", blocks, ttl=TTL_S)

        first: Callable[[], lab.Arrival]
        second: Callable[[], lab.Arrival]
        order = rng.choice(["reg-first", "kv-first"])
        first, second = (
            (arrive_registration, arrive_ready)
            if order == "reg-first"
            else (arrive_ready, arrive_registration)
        )
        if first().matched:
            raise AssertionError(f"{request}: matched with only one half present")
        arrival = second()
        if not arrival.matched:
            raise AssertionError(f"{request}: both halves present but no match")

        reg, blocks = arrival.registration, arrival.ready
        started = time.perf_counter()
        plan = planner.plan(
            reg["request_id"],
            reg["num_tokens"],
            [blocks],
            [reg["groups"][0]["block_ids"]],
            dst_first_tokens=[reg["groups"][0]["first_token"]],
        )
        plan_us = (time.perf_counter() - started) * 1e6
        table.begin_write(arrival.key, reg["epoch"])
        src, dst = memoryview(p.memory), memoryview(d.memory)
        for s, dd, n in plan.runs():
            dst[dd : dd + n] = src[s : s + n]
        table.finish(arrival.key, reg["epoch"])
        done = p_encoder.encode(
            {
                "kind": "done",
                "transfer_key": arrival.key,
                "request_id": reg["request_id"],
                "epoch": reg["epoch"],
                "tp_rank": 0,
                "tp_size": 1,
                "bytes": plan.bytes,
                "runs": len(plan),
            }
        )
        if d_decoder.decode(done)["message"]["kind"] != "done":
            raise AssertionError(f"{request}: DONE did not decode as DONE")

        for region in range(len(d.layout.regions)):
            for token in range(cached, tokens):
                src_at = p.token_slice(region, p_blocks, 0, token)
                expected[d.token_slice(region, d_blocks, cached, token)] = p.memory[src_at]
        p.release(rng, p_blocks)
        d.release(rng, d_blocks)

        outcome = Outcome(request, tokens, cached, order, len(plan), plan.unmerged_runs,
                          plan.bytes, plan_us)  # fmt: skip
        outcomes.append(outcome)
        _say(
            out,
            f"{request:<13}{tokens:>7}{cached:>7}  {order:<10}{len(plan):>6}"
            f"{plan.unmerged_runs:>9}{plan.bytes:>9}{plan_us:>8.0f}us  [{i + 1}/{requests}]",
        )

    intact = bytes(d.memory) == bytes(expected)
    total_runs = sum(o.runs for o in outcomes)
    total_unmerged = sum(o.unmerged for o in outcomes)
    _say(out)
    _say(
        out,
        f"{len(outcomes)} transfers, {sum(o.written for o in outcomes)} bytes, {total_runs} runs "
        f"({total_unmerged} before merging), table empty: {len(table) == 0}",
    )
    _say(
        out,
        "D's memory matches a per-token copy byte for byte: "
        + ("yes" if intact else "NO, a write went astray"),
    )
    refusals_ok = _show_refusals(out, planner, d_blocks_limit=D_BLOCKS, secret=key)
    return intact and len(table) == 0 and refusals_ok


def _show_refusals(
    out: TextIO, planner: lab.Planner, d_blocks_limit: int, secret: bytes | None
) -> bool:
    """Each bad input is refused with an error that names the request and the value."""
    _say(out, "\nrefusals (each must raise, with a reason):")
    table = lab.RendezvousTable()
    encoder, decoder = lab.Encoder("decode-0", secret), lab.Decoder(secret)
    frame = encoder.encode(
        {"kind": "cancel", "transfer_key": "abc", "request_id": "abc-1", "epoch": 1}
    )
    forged = bytearray(frame)
    forged[-40] ^= 0x01

    def stale() -> Any:
        table.register("req-stale", 2, "blocks@2", ttl=TTL_S)
        return table.register("req-stale", 1, "blocks@1", ttl=TTL_S)

    def fenced() -> Any:
        table.cancel(kvpush.transfer_key("req-aborted"))
        return table.register("req-aborted", 1, "blocks", ttl=TTL_S)

    cases: list[tuple[str, Callable[[], Any], bool]] = [
        ("forged frame", lambda: decoder.decode(bytes(forged)), secret is not None),
        (
            "replayed frame",
            lambda: (decoder.decode(frame), decoder.decode(frame)),
            secret is not None,
        ),
        (
            "block id beyond D's cache",
            lambda: planner.plan("req-bad", 40, [[1, 2, 3]], [[d_blocks_limit, 1]]),
            True,
        ),
        ("duplicate D block", lambda: planner.plan("req-dup", 40, [[1, 2, 3]], [[5, 5]]), True),
        ("stale epoch", stale, True),
        ("registration after P aborted", fenced, True),
    ]
    ok = True
    for name, attempt, must_refuse in cases:
        if not must_refuse:
            _say(out, f"  {name:<30} skipped (no secret: unsigned mode trusts the network)")
            continue
        try:
            attempt()
        except KvPushError as error:
            _say(out, f"  {name:<30} {type(error).__name__}[{error.code}]: {error}")
        else:
            ok = False
            _say(out, f"  {name:<30} NOT REFUSED")
    return ok
