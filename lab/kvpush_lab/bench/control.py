"""``kvpush bench control``: P's per-request control path, kvpush against vLLM's own Python code.

**Control path** (issue 5, item 1). The work P's writer does for one request between "both
halves present" and "WRITE posted": matching the key, logical→kernel block expansion, P/D
block-size translation, prefix trim, and descriptor ids (vLLM) or merged runs (kvpush). One
thread, one process, the same layouts and block ids for both, timed per request with
``time.perf_counter_ns`` after a warm-up; medians.

* **vLLM** (:mod:`kvpush_lab.bench.vllm_baseline`): the installed ``NixlPushConnectorWorker`` on a
  stub instance, as its unit tests drive it. Timed: ``_pop_matching_registration`` (exact key,
  then the suffix scan, as P's and D's request ids differ in their random suffix) and
  ``_do_start_push_kv``, which runs ``_as_grouped_block_ids``, ``_logical_to_kernel_block_ids``
  (both sides), ``_xfer_blocks_for_req`` (TP mapping to ``ReadSpec``), ``_xfer_blocks``
  (``_map_block_ids_for_block_size_ratio``, ``_apply_prefix_caching``, ``_compute_desc_ids`` for
  both sides) up to ``make_prepped_xfer`` + ``transfer``, which only record the ids: NIXL's own
  work on them (looking the ids up in its prepared lists, in C++) is not measured.
* **kvpush**: its public Python API, so each call pays the Python→Rust crossing and the block
  lists' conversion (conservative for kvpush). Timed: ``RendezvousTable.ready`` (the second half:
  returns the match), ``RendezvousTable.begin_write``, ``Planner.plan`` (validation, kernel
  blocks, block-size translation, prefix trim, merging; every run decided and counted). Its
  runs are written out as addresses only when asked; the column "runs written out" adds
  ``Plan.to_bytes()`` (every run's ``(src, dst, len)``), the step kvpush's writer fuses with
  building NIXL's descriptor list.

Both describe the same memory: one region per layer holding ``blocks`` of 16 tokens x 8 KV
heads x K and V x 128 x bf16 (64 KiB), as vLLM 0.32 registers a KV cache tensor of shape
``[blocks, kv_heads, block_size, 2 * head_size]`` (one descriptor per layer and kernel block), and
kvpush's connector describes it (``kvpush.vllm._layout``: blocks move whole). Fragmented = every
other block of a pool 4x the request, shuffled, on both sides (the criterion planner bench's
fixture). Every case checks that kvpush's runs cover exactly the bytes vLLM's descriptors cover.

**Matching under load** (item 2). N unmatched entries pending on each side (D registrations and
finished P requests), then matches arriving: vLLM's ``_pop_matching_registration`` /
``_pop_matching_finished_blocks`` (a dict, then a scan of every pending key by its id without
the random suffix) against ``RendezvousTable.ready`` / ``register``. The matching half waits
behind the unmatched ones, as an old unmatched entry would.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import numpy as np

import kvpush
from kvpush._native import lab
from kvpush_lab.bench import report
from kvpush_lab.bench.report import Table, bar_chart, line_chart, ratio, replace_section, seconds
from kvpush_lab.bench.vllm_baseline import Side, VllmUnavailableError, VllmWriter, vllm_version

CONTROL_SECTION = "Control path"
MATCHING_SECTION = "Matching under load"
GOAL_RATIO = 20.0
GOAL_CASE = (64, 1000, "fragmented", "")
HEADS, HEAD_SIZE, ELEMENT = 8, 128, 2
BLOCK_TOKENS = 16
#: A pool this many times the request's blocks; fragmented requests use every other block.
POOL = 4
Layout = Literal["contiguous", "fragmented"]
Variant = Literal["", "kernel", "block_size", "prefix"]
VARIANTS: dict[str, str] = {
    "": "P 16 → D 16 tokens",
    "kernel": "32-token blocks of 2 kernel blocks",
    "block_size": "P 32 → D 16 tokens",
    "prefix": "D holds a 25% prefix",
}


@dataclass(frozen=True)
class ControlConfig:
    """What to measure; :meth:`quick` is the small variant the tests run."""

    layers: tuple[int, ...] = (8, 64)
    blocks: tuple[int, ...] = (16, 256, 1000, 4000)
    #: Timed requests per case (after ``warmup``), scaled down for the largest cases.
    repeats: int = 41
    warmup: int = 3
    pending: tuple[int, ...] = (0, 100, 1000, 10000)
    matches: int = 41
    seed: int = 0

    @classmethod
    def quick(cls) -> ControlConfig:
        return cls(
            layers=(2, 8), blocks=(16, 64), repeats=3, warmup=1, pending=(0, 10, 100), matches=3
        )

    def command(self) -> str:
        quick = " --quick" if self == ControlConfig.quick() else ""
        return f"kvpush bench control{quick} --markdown docs/benchmarks.md"


@dataclass(frozen=True)
class Case:
    layers: int
    blocks: int
    layout: Layout
    variant: Variant = ""

    @property
    def name(self) -> str:
        base = f"{self.layers} x {self.blocks:,} {self.layout}"
        return f"{base}, {VARIANTS[self.variant]}" if self.variant else base


@dataclass
class CaseResult:
    case: Case
    vllm_ns: float
    kvpush_ns: float
    kvpush_written_ns: float
    vllm_descriptors: int
    kvpush_runs: int
    kvpush_unmerged: int
    bytes: int
    same_bytes: bool

    @property
    def speedup(self) -> float:
        return self.vllm_ns / self.kvpush_ns if self.kvpush_ns else 0.0

    @property
    def speedup_written(self) -> float:
        return self.vllm_ns / self.kvpush_written_ns if self.kvpush_written_ns else 0.0


@dataclass
class MatchResult:
    pending: int
    vllm_ready_ns: float
    vllm_register_ns: float
    kvpush_ready_ns: float
    kvpush_register_ns: float


@dataclass
class ControlResult:
    config: ControlConfig
    cases: list[CaseResult]
    matching: list[MatchResult]
    started: datetime.datetime
    elapsed_s: float
    machine: str
    notes: dict[str, str] = field(default_factory=dict)

    def case(self, layers: int, blocks: int, layout: str, variant: str = "") -> CaseResult | None:
        return next(
            (
                r
                for r in self.cases
                if (r.case.layers, r.case.blocks, r.case.layout, r.case.variant)
                == (layers, blocks, layout, variant)
            ),
            None,
        )


class BenchError(RuntimeError):
    """The benchmark could not run, or the two sides disagreed on what to write."""


# --- fixtures ---------------------------------------------------------------------------------


def block_ids(count: int, pool: int, contiguous: bool) -> list[int]:
    """``count`` ids out of ``range(pool)``: consecutive, or every other block scrambled by the
    criterion planner bench's xorshift (``benches/src/lib.rs``), so no two neighbours merge."""
    if contiguous:
        return list(range(count))
    if 2 * count > pool:
        raise BenchError(f"a fragmented request of {count} blocks needs a pool of {2 * count}")
    mask = (1 << 64) - 1
    state = 0x9E37_79B9_7F4A_7C15
    ids = [2 * i for i in range(count)]
    for i in range(len(ids) - 1, 0, -1):
        state ^= (state << 13) & mask
        state ^= state >> 7
        state ^= (state << 17) & mask
        j = state % (i + 1)
        ids[i], ids[j] = ids[j], ids[i]
    return ids


@dataclass(frozen=True)
class Request:
    """One request's blocks on both sides and the tokens D needs."""

    num_tokens: int
    p_blocks: list[int]
    d_blocks: list[int]
    d_first_token: int


def sides(case: Case) -> tuple[Side, Side]:
    token_bytes = HEADS * 2 * HEAD_SIZE * ELEMENT
    kernel_blocks = POOL * case.blocks  # kernel blocks of 16 tokens in each region
    kernel_bytes = BLOCK_TOKENS * token_bytes

    def side(base: int, block_tokens: int, kernels_per_block: int) -> Side:
        # A block of `block_tokens` is `kernels_per_block` kernel blocks, or one larger block.
        bytes_per_block = block_tokens * token_bytes // kernels_per_block
        blocks = kernel_blocks * kernel_bytes // bytes_per_block
        return Side(base, case.layers, block_tokens, kernels_per_block, blocks, bytes_per_block)

    p_base, d_base = 0x1000_0000_0000, 0x9000_0000_0000
    if case.variant == "kernel":
        return side(p_base, 32, 2), side(d_base, 32, 2)
    if case.variant == "block_size":
        return side(p_base, 32, 1), side(d_base, 16, 1)
    return side(p_base, 16, 1), side(d_base, 16, 1)


def request(case: Case, p: Side, d: Side) -> Request:
    num_tokens = case.blocks * BLOCK_TOKENS
    contiguous = case.layout == "contiguous"
    p_count = num_tokens // p.block_tokens
    d_count = num_tokens // d.block_tokens
    p_pool = p.kernel_blocks // p.kernels_per_block
    d_pool = d.kernel_blocks // d.kernels_per_block
    p_ids = block_ids(p_count, p_pool, contiguous)
    d_ids = block_ids(d_count, d_pool, contiguous)
    hit = d_count // 4 if case.variant == "prefix" else 0
    return Request(num_tokens, p_ids, d_ids[hit:], hit * d.block_tokens)


def kvpush_layout(side: Side) -> kvpush.KvLayout:
    """The layout kvpush's connector builds for vLLM's packed blocks: a block is
    ``block_tokens`` rows of every head's K and V, moved whole."""
    kernel_tokens = side.block_tokens // side.kernels_per_block
    regions = [kvpush.Region(b, side.block_bytes, side.kernel_blocks) for b in side.region_bases()]
    return kvpush.KvLayout(
        regions,
        block_tokens=side.block_tokens,
        kernel_block_tokens=kernel_tokens,
        heads=1,
        head_bytes=HEADS * 2 * HEAD_SIZE * ELEMENT,
    )


def canonical_runs(triples: np.ndarray) -> np.ndarray:
    """``(src, dst, len)`` rows sorted by source and merged where they continue each other on
    both sides: two lists of copies write the same bytes to the same places iff these agree."""
    if len(triples) == 0:
        return triples.reshape(0, 3)
    t = triples[np.argsort(triples[:, 0], kind="stable")].astype(np.uint64)
    src, dst, length = t[:, 0], t[:, 1], t[:, 2]
    starts = np.ones(len(t), dtype=bool)
    starts[1:] = (src[:-1] + length[:-1] != src[1:]) | (dst[:-1] + length[:-1] != dst[1:])
    index = np.flatnonzero(starts)
    lengths = np.add.reduceat(length, index)
    return np.stack([src[index], dst[index], lengths], axis=1)


# --- timing -----------------------------------------------------------------------------------


def _median_us(samples: list[int]) -> float:
    return statistics.median(samples) if samples else 0.0


def request_ids(i: int) -> tuple[str, str]:
    """P's and D's internal ids of request ``i``: one front-end id, different random suffixes."""
    return f"cmpl-bench-{i}-0-1a2b3c4d", f"cmpl-bench-{i}-0-9f8e7d6c"


def measure_case(case: Case, repeats: int, warmup: int) -> CaseResult:
    p, d = sides(case)
    req = request(case, p, d)
    writer = VllmWriter(p, d, HEADS)
    planner = lab.Planner(kvpush_layout(p), kvpush_layout(d))
    table = lab.RendezvousTable(max_entries=1 << 20)
    first_tokens = [req.d_first_token]
    vllm_ns: list[int] = []
    kvpush_ns: list[int] = []
    written_ns: list[int] = []
    plan: lab.Plan | None = None
    for i in range(warmup + repeats):
        p_id, d_id = request_ids(i)
        # vLLM: D's registration waits; P's finished blocks arrive.
        writer.park_registration(d_id, list(req.d_blocks))
        p_blocks = ([*req.p_blocks],)
        t0 = time.perf_counter_ns()
        posted = writer.ready(p_id, p_blocks)
        t1 = time.perf_counter_ns()
        writer.forget_writes()
        if not posted:
            raise BenchError(f"{case.name}: vLLM's writer found no registration for {p_id}")
        # kvpush: the same, through the table and the planner.
        # Alternate which kvpush variant runs first, so neither always follows vLLM's call.
        for written in (False, True) if i % 2 else (True, False):
            k_id, kd_id = request_ids(1_000_000 + 2 * i + int(written))
            table.register(kd_id, 1, [list(req.d_blocks)], ttl=3600.0)
            p_list = [[*req.p_blocks]]
            t2 = time.perf_counter_ns()
            arrival = table.ready(k_id, p_list, ttl=3600.0)
            table.begin_write(arrival.key, 1)
            plan = planner.plan(
                k_id,
                req.num_tokens,
                arrival.ready,
                arrival.registration,
                dst_first_tokens=first_tokens,
            )
            if written:
                plan.to_bytes()
            t3 = time.perf_counter_ns()
            table.finish(arrival.key, 1)
            if i >= warmup:
                (written_ns if written else kvpush_ns).append(t3 - t2)
        if i >= warmup:
            vllm_ns.append(t1 - t0)
    assert plan is not None
    vllm_triples = writer.posted_triples()
    kvpush_triples = np.frombuffer(plan.to_bytes(), dtype=np.uint64).reshape(-1, 3)
    same = np.array_equal(canonical_runs(vllm_triples), canonical_runs(kvpush_triples))
    return CaseResult(
        case=case,
        vllm_ns=_median_us(vllm_ns),
        kvpush_ns=_median_us(kvpush_ns),
        kvpush_written_ns=_median_us(written_ns),
        vllm_descriptors=writer.posted_descriptors(),
        kvpush_runs=len(plan),
        kvpush_unmerged=plan.unmerged_runs,
        bytes=plan.bytes,
        same_bytes=bool(same),
    )


def measure_matching(pending: int, matches: int, warmup: int) -> MatchResult:
    """Per-match cost with ``pending`` unmatched entries waiting on each side."""
    tiny = Side(0x1000, 1, BLOCK_TOKENS, 1, 16, 4096)
    writer = VllmWriter(tiny, replace(tiny, base=0x9000), HEADS)
    table = lab.RendezvousTable(max_entries=1 << 20)
    blocks = [0]
    for i in range(pending):
        p_id, d_id = request_ids(10_000_000 + i)
        writer.park_registration(f"x{d_id}", blocks)
        writer.park_finished(f"y{p_id}", blocks)
        table.register(f"x{d_id}", 1, blocks, ttl=3600.0)
        table.ready(f"y{p_id}", blocks, ttl=3600.0)
    samples: dict[str, list[int]] = {k: [] for k in ("vr", "vd", "kr", "kd")}
    # One side after the other: vLLM's scans sweep the caches, which would bill kvpush's next
    # lookup for cold memory if the two alternated.
    for i in range(warmup + matches):
        keep = i >= warmup
        # P's half second: D's registration parked behind the unmatched ones.
        p_id, d_id = request_ids(i)
        writer.park_registration(d_id, blocks)
        t0 = time.perf_counter_ns()
        found = writer.match_ready(p_id)
        t1 = time.perf_counter_ns()
        # D's half second: P's finished blocks parked behind the unmatched ones.
        p_id, d_id = request_ids(1_000_000 + i)
        writer.park_finished(p_id, blocks)
        t2 = time.perf_counter_ns()
        found_d = writer.match_registration(d_id)
        t3 = time.perf_counter_ns()
        if not (found and found_d):
            raise BenchError(f"matching with {pending} pending: vLLM missed request {i}")
        if keep:
            samples["vr"].append(t1 - t0)
            samples["vd"].append(t3 - t2)
    for i in range(warmup + matches):
        keep = i >= warmup
        p_id, d_id = request_ids(i)
        table.register(d_id, 1, blocks, ttl=3600.0)
        t0 = time.perf_counter_ns()
        arrival = table.ready(p_id, blocks, ttl=3600.0)
        t1 = time.perf_counter_ns()
        if not arrival.matched:
            raise BenchError(f"matching with {pending} pending: kvpush missed {p_id}")
        table.begin_write(arrival.key, 1)
        table.finish(arrival.key, 1)
        p_id, d_id = request_ids(1_000_000 + i)
        table.ready(p_id, blocks, ttl=3600.0)
        t2 = time.perf_counter_ns()
        arrival = table.register(d_id, 1, blocks, ttl=3600.0)
        t3 = time.perf_counter_ns()
        if not arrival.matched:
            raise BenchError(f"matching with {pending} pending: kvpush missed {d_id}")
        table.begin_write(arrival.key, 1)
        table.finish(arrival.key, 1)
        if keep:
            samples["kr"].append(t1 - t0)
            samples["kd"].append(t3 - t2)
    if writer.pending() != 2 * pending:
        raise BenchError(f"vLLM's writer holds {writer.pending()} entries, not {2 * pending}")
    return MatchResult(
        pending,
        _median_us(samples["vr"]),
        _median_us(samples["vd"]),
        _median_us(samples["kr"]),
        _median_us(samples["kd"]),
    )


def cases(config: ControlConfig) -> list[Case]:
    grid = [
        Case(layers, blocks, layout)
        for layers in config.layers
        for blocks in config.blocks
        for layout in ("contiguous", "fragmented")
    ]
    layers, blocks = max(config.layers), sorted(config.blocks)[len(config.blocks) // 2]
    variants = [Case(layers, blocks, "fragmented", v) for v in ("kernel", "block_size", "prefix")]
    return grid + variants


def _repeats(config: ControlConfig, case: Case) -> int:
    # The largest cases take milliseconds per request: fewer of them keep the run short.
    size = case.layers * case.blocks
    return max(5, config.repeats // 2) if size > 100_000 else config.repeats


def run(config: ControlConfig, progress: Callable[[str], None] = print) -> ControlResult:
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.monotonic()
    load_before = report.load_average()
    results: list[CaseResult] = []
    all_cases = cases(config)
    for index, case in enumerate(all_cases, 1):
        result = measure_case(case, _repeats(config, case), config.warmup)
        if not result.same_bytes:
            raise BenchError(f"{case.name}: kvpush's runs and vLLM's descriptors differ")
        results.append(result)
        progress(
            f"  [{index}/{len(all_cases)}] {case.name}: vLLM {seconds(result.vllm_ns * 1e-9)}, "
            f"kvpush {seconds(result.kvpush_ns * 1e-9)} ({ratio(result.vllm_ns, result.kvpush_ns)}"
            f" faster); {result.vllm_descriptors:,} descriptors vs {result.kvpush_runs:,} runs"
        )
    matching: list[MatchResult] = []
    for pending in config.pending:
        m = measure_matching(pending, config.matches, config.warmup)
        matching.append(m)
        progress(
            f"  matching, {pending:,} pending per side: vLLM {seconds(m.vllm_ready_ns * 1e-9)}, "
            f"kvpush {seconds(m.kvpush_ready_ns * 1e-9)} per match"
        )
    elapsed = time.monotonic() - t0
    return ControlResult(
        config,
        results,
        matching,
        started,
        elapsed,
        _machine(load_before, report.load_average()),
    )


def _machine(before: str, after: str) -> str:
    return (
        f"{os.cpu_count()} cores ({report.cpu_model()}), Linux {platform.release()}, Python "
        f"{platform.python_version()}, numpy {np.__version__}, vLLM {vllm_version()}, kvpush "
        f"{kvpush.__version__}; shared with other jobs (load average {before} before, {after} "
        "after), so absolute times are noisy and the side-by-side ratios are what matters"
    )


# --- reporting --------------------------------------------------------------------------------


def _t(ns: float) -> str:
    return seconds(ns * 1e-9)


def control_table(result: ControlResult, variants: bool = False) -> Table:
    table = Table(
        [
            "case",
            "vLLM",
            "kvpush",
            "speed-up",
            "kvpush, runs written out",
            "speed-up",
            "vLLM descriptors",
            "kvpush runs (before merging)",
        ]
    )
    for r in result.cases:
        if bool(r.case.variant) != variants:
            continue
        table.add(
            r.case.name,
            _t(r.vllm_ns),
            _t(r.kvpush_ns),
            f"**{ratio(r.vllm_ns, r.kvpush_ns)}**",
            _t(r.kvpush_written_ns),
            ratio(r.vllm_ns, r.kvpush_written_ns),
            f"{r.vllm_descriptors:,}",
            f"{r.kvpush_runs:,} ({r.kvpush_unmerged:,})",
        )
    return table


def matching_table(result: ControlResult) -> Table:
    table = Table(
        [
            "pending per side",
            "vLLM, P second",
            "kvpush, P second",
            "vLLM, D second",
            "kvpush, D second",
            "vLLM / kvpush",
        ]
    )
    for m in result.matching:
        table.add(
            f"{m.pending:,}",
            _t(m.vllm_ready_ns),
            _t(m.kvpush_ready_ns),
            _t(m.vllm_register_ns),
            _t(m.kvpush_register_ns),
            f"{ratio(m.vllm_ready_ns, m.kvpush_ready_ns)} / "
            f"{ratio(m.vllm_register_ns, m.kvpush_register_ns)}",
        )
    return table


def goal(result: ControlResult) -> str:
    r = result.case(*GOAL_CASE)
    if r is None:
        return "the goal case (64 x 1,000 fragmented) was not measured in this run"
    met = "met" if r.speedup >= GOAL_RATIO else "not met"
    met_written = "met" if r.speedup_written >= GOAL_RATIO else "not met"
    return (
        f"goal (kvpush ≥ {GOAL_RATIO:.0f}x faster at 64 x 1,000 fragmented): **{met}** "
        f"({r.speedup:.1f}x; with every run written out {r.speedup_written:.1f}x, "
        f"{met_written})"
    )


def growth(result: ControlResult) -> str:
    if len(result.matching) < 2:
        return ""
    lo, hi = result.matching[0], result.matching[-1]
    return (
        f"from {lo.pending:,} to {hi.pending:,} pending entries per side, vLLM's per-match cost "
        f"grows {ratio(hi.vllm_ready_ns, lo.vllm_ready_ns)} (P second) and "
        f"{ratio(hi.vllm_register_ns, lo.vllm_register_ns)} (D second); kvpush's "
        f"{ratio(hi.kvpush_ready_ns, lo.kvpush_ready_ns)} and "
        f"{ratio(hi.kvpush_register_ns, lo.kvpush_register_ns)}"
    )


def report_text(result: ControlResult) -> str:
    return "\n".join(
        [
            f"Control path, per request (median; {result.machine})",
            "",
            control_table(result).text(),
            "",
            control_table(result, variants=True).text(),
            "",
            goal(result).replace("**", ""),
            "",
            "Matching under load, per match (median)",
            "",
            matching_table(result).text(),
            "",
            growth(result),
        ]
    )


CONTROL_INTRO = """\
`kvpush bench control` (`lab/kvpush_lab/bench/control.py`) times, per request and on one thread,
the work P's writer does between "both halves present" and "WRITE posted", in one process, for
kvpush and for vLLM's own push writer (the installed `NixlPushConnectorWorker`, on a stub worker
as vLLM's unit tests build one; `lab/kvpush_lab/bench/vllm_baseline.py`).

* **vLLM**: `_pop_matching_registration` (P's and D's request ids differ in their random suffix,
  so its suffix scan runs) and `_do_start_push_kv`: `_logical_to_kernel_block_ids`,
  `_xfer_blocks_for_req`, `_xfer_blocks` (`_map_block_ids_for_block_size_ratio`,
  `_apply_prefix_caching`, `_compute_desc_ids` for both sides) up to `make_prepped_xfer`, which
  only records the descriptor ids: NIXL's own work on them (C++) is not timed.
* **kvpush**: the public Python API, Python→Rust crossings and block-list conversion included
  (conservative for kvpush): `RendezvousTable.ready` (the second half, returning the match),
  `begin_write`, `Planner.plan` (validation, kernel blocks, block-size translation, prefix trim,
  merging). The plan holds each KV group's merged runs once, relative to a region, and the
  regions that repeat them; **runs written out** adds `Plan.to_bytes()`, every run's
  `(src, dst, len)`, the step kvpush's writer fuses with building NIXL's descriptor list.

Same memory on both sides: one region per layer of 64 KiB blocks (16 tokens x 8 KV heads x K
and V x 128 x bf16), the way vLLM 0.32 registers a `[blocks, kv_heads, block_size, 2 x
head_size]` cache (one descriptor per layer and kernel block) and kvpush's connector describes
it. Fragmented = every other block of a pool 4x the request, shuffled, on both sides (the
criterion planner bench's fixture). In every case kvpush's runs cover exactly the bytes vLLM's
descriptors cover (checked by the bench). Medians of per-request `perf_counter_ns` timings after
a warm-up; vLLM and kvpush alternate request by request."""

MATCHING_INTRO = """\
Same command. N unmatched entries wait on each side (D registrations and finished P requests,
under ids that match nothing), then requests whose halves meet arrive, the waiting half parked
behind the N unmatched ones, as a stale entry would be; vLLM's matches run first, then kvpush's
(alternating them would bill kvpush for the caches vLLM's scans sweep). Per match: vLLM's
`_pop_matching_registration` (P's KV second) and `_pop_matching_finished_blocks` (D's
registration second), a dict lookup and then a scan of every pending id with its random suffix
stripped; kvpush's `RendezvousTable.ready` / `register` (Python API, key derivation included),
which match on the canonical key in a sharded hash table. Goal: per-match cost flat in N."""


def write_markdown(result: ControlResult, doc: Path, img_dir: Path) -> None:
    """Writes the "Control path" and "Matching under load" sections of ``doc`` and their plots
    (``control-path.png``, ``matching.png``) into ``img_dir``."""
    img_dir.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(img_dir, doc.parent)
    grid = [r for r in result.cases if not r.case.variant]
    bar_chart(
        img_dir / "control-path.png",
        "Control path per request (median)",
        [f"{r.case.layers}x{r.case.blocks} {r.case.layout[:4]}" for r in grid],
        {
            "vLLM (Python)": [r.vllm_ns / 1e3 for r in grid],
            "kvpush": [r.kvpush_ns / 1e3 for r in grid],
            "kvpush, runs written out": [r.kvpush_written_ns / 1e3 for r in grid],
        },
        "µs per request (log)",
        log=True,
    )
    xs = [max(1, m.pending) for m in result.matching]
    line_chart(
        img_dir / "matching.png",
        "Per-match cost vs pending unmatched entries per side",
        xs,
        {
            "vLLM, P second": [m.vllm_ready_ns / 1e3 for m in result.matching],
            "vLLM, D second": [m.vllm_register_ns / 1e3 for m in result.matching],
            "kvpush, P second": [m.kvpush_ready_ns / 1e3 for m in result.matching],
            "kvpush, D second": [m.kvpush_register_ns / 1e3 for m in result.matching],
        },
        "pending entries per side (0 plotted at 1)",
        "µs per match (log)",
        log=True,
    )
    when = f"{result.started:%Y-%m-%d %H:%M %Z}"
    measured = (
        f"Measured {when} in {result.elapsed_s:.0f} s with `{result.config.command()}` on "
        f"{result.machine}."
    )
    control = [
        CONTROL_INTRO,
        "",
        measured,
        "",
        f"Result: {goal(result)}.",
        "",
        control_table(result).markdown(),
        "",
        "The steps that do work only in some configurations, at one size (64 layers, fragmented):",
        "",
        control_table(result, variants=True).markdown(),
        "",
        "**vLLM descriptors**: descriptor ids vLLM hands `make_prepped_xfer` (one per layer and "
        "kernel block); **kvpush runs**: kvpush's runs after merging whatever is contiguous on "
        "both sides (before merging in brackets). NIXL's prepped path may merge neighbouring "
        "descriptors of a contiguous request later, in C++; nothing merges in a fragmented one.",
        "",
        f"![control path per request]({rel}/control-path.png)",
    ]
    replace_section(doc, CONTROL_SECTION, "\n".join(control))
    matching = [
        MATCHING_INTRO,
        "",
        measured,
        "",
        f"Result: {growth(result)}.",
        "",
        matching_table(result).markdown(),
        "",
        f"![per-match cost]({rel}/matching.png)",
    ]
    replace_section(doc, MATCHING_SECTION, "\n".join(matching))


# --- command line -----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="a few small cases (seconds), as the tests run"
    )
    parser.add_argument(
        "--markdown",
        metavar="PATH",
        help="also write the 'Control path' and 'Matching under load' sections of PATH "
        "(e.g. docs/benchmarks.md) and their plots",
    )
    parser.add_argument(
        "--img-dir",
        metavar="DIR",
        help="where the plots go (default: img/ next to --markdown)",
    )


def main(args: argparse.Namespace) -> int:
    config = ControlConfig.quick() if args.quick else ControlConfig()
    try:
        print("kvpush bench control: per-request control path and matching, kvpush vs vLLM")
        result = run(config, progress=lambda line: print(line, flush=True))
    except BenchError as error:
        print(f"kvpush bench control: {error}", file=sys.stderr)
        return 1
    except VllmUnavailableError as error:
        print(f"kvpush bench control: {error}", file=sys.stderr)
        return 2
    print()
    print(report_text(result))
    if args.markdown:
        doc = Path(args.markdown)
        img_dir = Path(args.img_dir) if args.img_dir else doc.parent / "img"
        write_markdown(result, doc, img_dir)
        print(f"\nwrote the '{CONTROL_SECTION}' and '{MATCHING_SECTION}' sections of {doc}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="kvpush bench control")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
