"""A soak of two processes: thousands of transfers in flight at once, in random arrival order,
with D cancelling and P aborting some, round after round, for minutes.

Checks, every round: each request ends in exactly one outcome on each side (an event, or for
P's own abort the abort's answer), nothing is left pending on P, and at the end both processes'
resident memory is flat: it grew less than ``--rss-slack-mib`` over the last two thirds of the
run. (The first third is warm-up: an ended transfer's key stays fenced for a minute, so P's
table fills to its cap of fences before its memory levels off.)

    .venv/bin/python -m tests.support.soak --minutes 10     # the long run (scripts/dev soak)
    .venv/bin/python -m tests.support.soak --minutes 0.3 --concurrency 300   # a quick look

``tests/two_process/test_soak.py`` runs a short soak in CI so this keeps working.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvpush_lab.cache import CacheShape, Request
from kvpush_lab.peer import RemoteWorker
from tests.support.faults import rss_bytes

SHAPE = CacheShape(layers=2, num_blocks=8192, block_tokens=16)
SECRET = b"shared-secret-of-the-soak-pair"
OPTIONS = {"heartbeat_interval": 0.5, "peer_timeout": 5.0, "write_timeout": 5.0}
CANCEL_SHARE = 0.1
ABORT_SHARE = 0.1


@dataclass
class Round:
    """One round's requests and what became of them."""

    requests: list[Request]
    cancelled: set[str] = field(default_factory=set)
    aborted: dict[str, str] = field(default_factory=dict)  # P's request id -> abort's answer
    received: Counter[str] = field(default_factory=Counter)
    sent: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)


def make_round(rng: random.Random, count: int, index: int) -> list[Request]:
    """``count`` requests with disjoint random blocks (1-4 blocks each, both sides)."""
    p_free = rng.sample(range(SHAPE.num_blocks), SHAPE.num_blocks)
    d_free = rng.sample(range(SHAPE.num_blocks), SHAPE.num_blocks)
    requests = []
    for i in range(count):
        tokens = rng.randint(1, 4 * SHAPE.block_tokens)
        blocks = -(-tokens // SHAPE.block_tokens)
        p_blocks, p_free = tuple(p_free[:blocks]), p_free[blocks:]
        d_blocks, d_free = tuple(d_free[:blocks]), d_free[blocks:]
        requests.append(
            Request(f"soak-{index}-{i}", tokens, p_blocks, d_blocks, 0, f"xfer-{index}-{i}")
        )
    return requests


def run_round(p: Any, d: Any, rng: random.Random, count: int, index: int) -> Round:
    """Sends one round in random order and collects every outcome (bounded waits)."""
    this = Round(make_round(rng, count, index))
    actions = [("expect", r) for r in this.requests] + [("ready", r) for r in this.requests]
    rng.shuffle(actions)
    for start in range(0, len(actions), 64):
        batch = actions[start : start + 64]
        expects = [r for kind, r in batch if kind == "expect"]
        readies = [r for kind, r in batch if kind == "ready"]
        if expects:
            d.expect(p.address(), expects, ttl=30.0)
        if readies:
            for error in p.ready(readies, ttl=30.0):
                this.outcomes[f"P ready refused: {error.split(':')[0]}"] += 1
    for r in this.requests:
        roll = rng.random()
        if roll < CANCEL_SHARE:
            d.cancel(r.request_id)
            this.cancelled.add(r.request_id)
        elif roll < CANCEL_SHARE + ABORT_SHARE:
            this.aborted[r.request_id] = p.abort(r)
    # Every D request has one receive event; P has one send event per request, except those
    # its own abort released (the abort's answer is that request's outcome).
    want_p = count - sum(1 for answer in this.aborted.values() if answer == "released")
    deadline = time.monotonic() + 120.0
    while (sum(this.received.values()) < count or sum(this.sent.values()) < want_p) and (
        time.monotonic() < deadline
    ):
        for event in d.events(1, timeout=0.2, snapshot=False):
            this.received[event["request_id"]] += 1
            this.outcomes[f"D {event['outcome']}"] += 1
        for event in p.events(1, timeout=0.05, snapshot=False):
            this.sent[event["request_id"]] += 1
            this.outcomes[f"P {event['outcome']}"] += 1
    return this


def check_round(this: Round, p: Any) -> list[str]:
    problems = []
    ids = {r.request_id for r in this.requests}
    missing = ids - set(this.received)
    twice = [rid for rid, n in this.received.items() if n != 1]
    if missing:
        problems.append(f"{len(missing)} receives without an outcome (e.g. {sorted(missing)[:3]})")
    if twice:
        problems.append(f"{len(twice)} receives with more than one outcome")
    for rid in ids:
        released = this.aborted.get(rid) == "released"
        events = this.sent.get(rid, 0)
        if events != (0 if released else 1):
            problems.append(f"request {rid}: {events} send events (abort: {this.aborted.get(rid)})")
            break
    deadline = time.monotonic() + 30.0
    while p.pending() and time.monotonic() < deadline:
        time.sleep(0.05)
    if p.pending():
        problems.append(f"P holds {p.pending()} entries after the round")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=2000, help="requests in flight")
    parser.add_argument("--rss-slack-mib", type=float, default=64.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    env = {"UCX_NET_DEVICES": "lo"}
    kw: dict[str, Any] = {"shape": SHAPE, "transport": "nixl", "secret": SECRET, "options": OPTIONS}
    p = RemoteWorker(env, role="p", seed=3, **kw)
    d = RemoteWorker(env, role="d", seed=None, **kw)
    started = time.monotonic()
    baseline: dict[str, int] = {}
    totals: Counter[str] = Counter()
    problems: list[str] = []
    rounds = 0
    try:
        while time.monotonic() - started < args.minutes * 60.0 or rounds < 3:
            this = run_round(p, d, rng, args.concurrency, rounds)
            problems += [f"round {rounds}: {problem}" for problem in check_round(this, p)]
            totals.update(this.outcomes)
            rounds += 1
            rss = {"P": rss_bytes(p.pid), "D": rss_bytes(d.pid)}
            elapsed = time.monotonic() - started
            warmed_up = rounds >= 2 and elapsed >= args.minutes * 20.0
            if warmed_up and not baseline:
                baseline = dict(rss)  # the end of the warm-up (see the module docs)
            print(
                f"[{elapsed:6.0f}s] round {rounds}: {args.concurrency} transfers, "
                f"P {rss['P'] >> 20} MiB, D {rss['D'] >> 20} MiB RSS, "
                f"{dict(sorted(this.outcomes.items()))}",
                flush=True,
            )
            if problems:
                break
        final = {"P": rss_bytes(p.pid), "D": rss_bytes(d.pid)}
    finally:
        d.close()
        p.close()
    growth = {side: (final[side] - baseline.get(side, final[side])) / (1 << 20) for side in final}
    for side, mib in growth.items():
        if mib > args.rss_slack_mib:
            problems.append(f"{side}'s RSS grew {mib:.0f} MiB after warm-up")
    print(
        f"soak: {rounds} rounds, {rounds * args.concurrency} transfers in "
        f"{time.monotonic() - started:.0f}s; RSS growth after warm-up P {growth['P']:+.1f} MiB, "
        f"D {growth['D']:+.1f} MiB; outcomes {dict(sorted(totals.items()))}"
    )
    for problem in problems:
        print(f"FAILED: {problem}")
    print("soak: OK" if not problems else f"soak: {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
