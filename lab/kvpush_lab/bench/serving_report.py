"""What ``kvpush bench serving`` reports: terminal tables, the ``## End to end (vLLM)`` and
``## Idle cost`` sections of ``docs/benchmarks.md``, and their PNG plots.

Rounds of the same connector are pooled: a phase's percentiles are over every round's requests,
idle cost is the mean over rounds. Ratios are kvpush's figure over the upstream connector's
(below 1: kvpush is lower, i.e. better, for every figure here).
"""

from __future__ import annotations

import math
import os
import platform
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import kvpush
from kvpush_lab.bench.report import Table, bar_chart, cpu_model, line_chart, ratio, replace_section
from kvpush_lab.bench.serving_client import PhaseStats, Sample, summarize
from kvpush_lab.bench.serving_result import (
    BREAKDOWN,
    CONNECTORS,
    KVPUSH,
    MIN_PHASE_S,
    NIXL_PULL,
    NIXL_PUSH,
    NO_CONNECTOR,
    IdleCost,
    PairRun,
    ServingResult,
)

E2E_SECTION = "End to end (vLLM)"
IDLE_SECTION = "Idle cost"
HANDOVER_GOAL = 0.5  # kvpush's handover at most half of each upstream connector's, at load
IDLE_GOAL_CORES = 0.01
#: How the documented runs are started (``kvpush bench serving`` with vLLM's interpreter).
COMMAND = ".venv-vllm/bin/python -m kvpush_lab.bench.serving"
UPSTREAM = (NIXL_PUSH, NIXL_PULL)
LABELS = {
    KVPUSH: "kvpush",
    NIXL_PUSH: "NixlPushConnector",
    NIXL_PULL: "NixlConnector (pull)",
    NO_CONNECTOR: "no connector",
}


# --- pooling -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PhaseKey:
    name: str
    length: int
    load: float | None

    @property
    def label(self) -> str:
        if self.load is None:
            return f"{self.length} one at a time"
        return f"{self.length} at {self.load:g}x"


def phase_keys(result: ServingResult) -> list[PhaseKey]:
    """Every phase that ran, one-at-a-time phases first (by length), then loads (by load)."""
    keys = {
        PhaseKey(p.name, p.length, p.load)
        for pair in result.pairs
        for p in pair.phases
        if pair.connector != NO_CONNECTOR
    }
    return sorted(keys, key=lambda k: (k.load is not None, k.load or 0.0, k.length))


def pooled(result: ServingResult) -> dict[tuple[str, PhaseKey], list[Sample]]:
    """Every round's samples of each (connector, phase)."""
    out: dict[tuple[str, PhaseKey], list[Sample]] = {}
    for pair in result.pairs:
        for phase in pair.phases:
            key = (pair.connector, PhaseKey(phase.name, phase.length, phase.load))
            out.setdefault(key, []).extend(phase.samples)
    return out


def planned(result: ServingResult) -> dict[tuple[str, PhaseKey], int]:
    """Requests each (connector, phase) meant to send, over every round."""
    out: dict[tuple[str, PhaseKey], int] = {}
    for pair in result.pairs:
        for phase in pair.phases:
            key = (pair.connector, PhaseKey(phase.name, phase.length, phase.load))
            out[key] = out.get(key, 0) + max(phase.planned, len(phase.samples))
    return out


def stats_by_phase(result: ServingResult) -> dict[tuple[str, PhaseKey], PhaseStats]:
    return {key: summarize(samples) for key, samples in pooled(result).items()}


def rates(result: ServingResult) -> dict[PhaseKey, float]:
    """The arrival rate each load phase ran at (requests per second)."""
    out: dict[PhaseKey, float] = {}
    for pair in result.pairs:
        for phase in pair.phases:
            if phase.rate is not None:
                out[PhaseKey(phase.name, phase.length, phase.load)] = phase.rate
    return out


def connectors_run(result: ServingResult) -> list[str]:
    ran = {pair.connector for pair in result.pairs}
    return [c for c in CONNECTORS if c in ran]


def idle_by_connector(result: ServingResult) -> dict[str, tuple[float | None, float | None]]:
    """Mean pair cores idle (fresh, after traffic) per connector, ``none`` included."""
    out: dict[str, tuple[float | None, float | None]] = {}
    for connector in (NO_CONNECTOR, *CONNECTORS):
        pairs = [p for p in result.pairs if p.connector == connector]
        if not pairs:
            continue
        out[connector] = (
            _mean([p.idle_fresh.cores for p in pairs if p.idle_fresh]),
            _mean([p.idle_after.cores for p in pairs if p.idle_after]),
        )
    return out


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _nan(value: float | None) -> bool:
    return value is None or math.isnan(value)


def _ms(value: float | None) -> str:
    if _nan(value):
        return "-"
    assert value is not None
    ms = value * 1000.0
    if abs(ms) >= 99.95:
        return f"{ms:.0f}"
    return f"{ms:.1f}" if abs(ms) >= 0.995 else f"{ms:.2f}"


def _pct(value: float | None) -> str:
    return "-" if _nan(value) else f"{value:.1%}"


def _ratio(a: float, b: float) -> str:
    if _nan(a) or _nan(b):
        return "n/a"
    if a <= 0 < b:
        # A push handover can be <= 0: D's first token beat P's own answer to the client.
        return "kvpush <= 0"
    return ratio(a, b)


# --- goals -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    met: bool | None  # None: not measured
    text: str


def handover_verdict(result: ServingResult) -> Verdict:
    stats = stats_by_phase(result)
    loads = [k for k in phase_keys(result) if k.load is not None]
    upstream = [u for u in UPSTREAM if u in connectors_run(result)]
    if KVPUSH not in connectors_run(result) or not upstream or not loads:
        return Verdict(None, "not measured (needs kvpush, an upstream connector and a load phase)")
    misses, notes = [], []
    for key in loads:
        mine = stats.get((KVPUSH, key))
        for other in upstream:
            theirs = stats.get((other, key))
            if mine is None or theirs is None:
                continue
            if _nan(mine.handover_p50):
                misses.append(f"{key.label}: kvpush has no successful request")
            elif _nan(theirs.handover_p50):
                notes.append(f"{LABELS[other]} at {key.label} had no successful request")
            elif mine.handover_p50 > HANDOVER_GOAL * theirs.handover_p50:
                misses.append(
                    f"{key.label} vs {LABELS[other]}: {_ms(mine.handover_p50)} ms against "
                    f"{_ms(theirs.handover_p50)} ms "
                    f"({_ratio(mine.handover_p50, theirs.handover_p50)})"
                )
    extra = f" ({'; '.join(notes)}: nothing to compare there)" if notes else ""
    if misses:
        return Verdict(False, "not met: " + "; ".join(misses) + extra)
    return Verdict(True, "met at every load" + extra)


def ttft_verdict(result: ServingResult) -> Verdict:
    stats = stats_by_phase(result)
    upstream = [u for u in UPSTREAM if u in connectors_run(result)]
    if KVPUSH not in connectors_run(result) or not upstream:
        return Verdict(None, "not measured")
    worse = []
    for key in phase_keys(result):
        mine = stats.get((KVPUSH, key))
        for other in upstream:
            theirs = stats.get((other, key))
            if mine is None or theirs is None:
                continue
            for name in ("ttft_p50", "ttft_p99"):
                a, b = getattr(mine, name), getattr(theirs, name)
                if not _nan(a) and not _nan(b) and a > b:
                    worse.append(
                        f"{key.label} {name[5:]} vs {LABELS[other]} "
                        f"({_ms(a)} against {_ms(b)} ms, {_ratio(a, b)})"
                    )
    if worse:
        return Verdict(False, "not met: worse at " + "; ".join(worse))
    return Verdict(True, "met: kvpush's TTFT p50 and p99 are at or below both at every point")


def idle_verdict(result: ServingResult) -> Verdict:
    idle = idle_by_connector(result)
    if KVPUSH not in idle:
        return Verdict(None, "not measured")
    worst = max((v for v in idle[KVPUSH] if v is not None), default=None)
    if worst is None:
        return Verdict(None, "not measured")
    base = idle.get(NO_CONNECTOR)
    base_worst = None if base is None else max((v for v in base if v is not None), default=None)
    if base_worst is None:
        met = worst < IDLE_GOAL_CORES
        return Verdict(met, f"{'met' if met else 'not met'}: {worst:.1%} of a core (no baseline)")
    extra = worst - base_worst
    met = extra < IDLE_GOAL_CORES
    return Verdict(
        met,
        f"{'met' if met else 'not met'}: kvpush's pair idles at {worst:.2%} of a core, "
        f"{extra:+.2%} over the same pair without a connector ({base_worst:.2%})",
    )


def slowdown_notes(result: ServingResult) -> list[str]:
    """Per connector: its P legs one at a time at the load length against P alone without a
    connector, its pair's idle cores and the thread that burns them (why a pair is slow)."""
    stats = stats_by_phase(result)
    probes = [
        p.capacity_probe_s
        for p in result.pairs
        if p.connector == NO_CONNECTOR and p.capacity_probe_s
    ]
    length = result.config.load_length
    key = next((k for k in phase_keys(result) if k.load is None and k.length == length), None)
    notes = []
    for connector in connectors_run(result):
        pairs = [p for p in result.pairs if p.connector == connector]
        idle = _mean([c.cores for p in pairs for c in (p.idle_after,) if c is not None])
        s = stats.get((connector, key)) if key is not None else None
        parts = []
        if s is not None and not _nan(s.prefill_p50) and probes:
            parts.append(
                f"P legs at {length} tokens one at a time {_ms(s.prefill_p50)} ms against "
                f"{_ms(statistics.median(probes))} ms on P without a connector "
                f"({_ratio(s.prefill_p50, statistics.median(probes))})"
            )
        if idle is not None:
            busiest = _busiest_thread(pairs)
            parts.append(f"idle pair {idle:.0%} of a core" + (f" ({busiest})" if busiest else ""))
        if parts:
            notes.append(f"{LABELS[connector]}: " + "; ".join(parts))
    return notes


SPIN_NOTE = (
    " The busy `unnamed` thread in each upstream vLLM worker is NIXL's progress thread: vLLM "
    "makes its agent with the progress thread on, and NIXL's Python API sets its poll delay to "
    "0, so it spins whether or not anything moves; on 2 cores it takes the core P's or D's "
    "forward pass needs (and vLLM's NIXL worker re-pins the forward pass's thread, "
    "`docs/vllm-cpu.md`). These are the upstream connectors as shipped; the handover and TPOT "
    "columns compare the transfer paths more directly than TTFT does."
)


def spin_note(result: ServingResult) -> str:
    """:data:`SPIN_NOTE` when an upstream pair idled above half a core."""
    idle = idle_by_connector(result)
    spinning = any(
        value is not None and value > 0.5 for c in UPSTREAM for value in idle.get(c, (None, None))
    )
    return SPIN_NOTE if spinning else ""


def _busiest_thread(pairs: Sequence[PairRun]) -> str | None:
    best: tuple[float, str] | None = None
    for pair in pairs:
        cost = pair.idle_after
        if cost is None:
            continue
        for side, usage in (("P", cost.prefill), ("D", cost.decode)):
            for name, cores in usage.threads.items():
                if best is None or cores > best[0]:
                    best = (cores, f"busiest thread {side} {name} at {cores:.0%}")
    return None if best is None or best[0] < 0.05 else best[1]


# --- tables ------------------------------------------------------------------------------------


def latency_table(result: ServingResult) -> Table:
    stats = stats_by_phase(result)
    meant = planned(result)
    rate_of = rates(result)
    table = Table(
        [
            "phase",
            "connector",
            "TTFT p50 (ms)",
            "TTFT p99 (ms)",
            "TPOT p50 (ms)",
            "handover p50 (ms)",
            "handover p99 (ms)",
            "P leg p50 (ms)",
            "failed",
        ]
    )
    for key in phase_keys(result):
        label = key.label
        if key in rate_of:
            label += f" ({rate_of[key]:.2f}/s)"
        for connector in connectors_run(result):
            s = stats.get((connector, key))
            if s is None:
                continue
            table.add(
                label,
                LABELS[connector],
                _ms(s.ttft_p50),
                _ms(s.ttft_p99),
                _ms(s.tpot_p50),
                _ms(s.handover_p50),
                _ms(s.handover_p99),
                _ms(s.prefill_p50),
                _failed_cell(s, meant.get((connector, key), s.requests)),
            )
    return table


def _failed_cell(stats: PhaseStats, meant: int) -> str:
    cell = f"{stats.failed}/{stats.requests}"
    if meant > stats.requests:
        cell += f" ({meant - stats.requests} not sent)"
    return cell


def ratio_table(result: ServingResult) -> Table:
    stats = stats_by_phase(result)
    upstream = [u for u in UPSTREAM if u in connectors_run(result)]
    columns = ["phase"]
    for other in upstream:
        columns += [f"handover p50 vs {other}", f"TTFT p50 vs {other}", f"TTFT p99 vs {other}"]
    table = Table(columns)
    for key in phase_keys(result):
        mine = stats.get((KVPUSH, key))
        if mine is None:
            continue
        cells = [key.label]
        for other in upstream:
            theirs = stats.get((other, key))
            if theirs is None:
                cells += ["n/a"] * 3
                continue
            cells += [
                _ratio(mine.handover_p50, theirs.handover_p50),
                _ratio(mine.ttft_p50, theirs.ttft_p50),
                _ratio(mine.ttft_p99, theirs.ttft_p99),
            ]
        table.add(*cells)
    return table


def source_table(result: ServingResult) -> Table:
    table = Table(
        [
            "connector",
            "round",
            "P / D healthy after (s)",
            "prompt tokens at D",
            "over p2p",
            "failed transfers",
            "warm-up",
            "note",
        ]
    )
    for pair in result.pairs:
        if pair.connector == NO_CONNECTOR:
            continue
        src = pair.source
        share = "-"
        if src is not None and src.p2p_share is not None:
            share = f"{src.p2p_share:.1%}" + (" ¹" if src.p2p_share > 1 else "")
        ready = "/".join("-" if r is None else f"{r:.0f}" for r in pair.ready_s)
        warm = ", ".join("ok" if s.ok else f"failed ({(s.error or '')[:60]})" for s in pair.warmup)
        table.add(
            LABELS[pair.connector],
            pair.round + 1,
            ready,
            "-" if src is None else f"{src.prompt_tokens:.0f}",
            share,
            "-" if src is None else f"{src.failed_transfers:.0f}",
            warm or "-",
            pair.error or "",
        )
    return table


def breakdown_table(result: ServingResult) -> Table | None:
    rows: dict[PhaseKey, list[tuple[dict[str, float], int]]] = {}
    for pair in result.pairs:
        if pair.connector != KVPUSH:
            continue
        for phase in pair.phases:
            if phase.breakdown_n:
                key = PhaseKey(phase.name, phase.length, phase.load)
                rows.setdefault(key, []).append((phase.breakdown, phase.breakdown_n))
    if not rows:
        return None
    table = Table(["phase", "requests", *(f"{name} (ms)" for name, _, _ in BREAKDOWN)])
    for key in sorted(rows, key=lambda k: (k.load is not None, k.load or 0.0, k.length)):
        entries = rows[key]
        cells: list[str] = [key.label, str(sum(n for _, n in entries))]
        for name, _, _ in BREAKDOWN:
            values = [b[name] for b, _ in entries if name in b]
            cells.append(_ms(statistics.fmean(values) / 1000.0) if values else "-")
        table.add(*cells)
    return table


def idle_table(result: ServingResult) -> Table:
    table = Table(
        [
            "connector",
            "round",
            "idle, fresh (P + D)",
            "idle, after traffic (P + D)",
            "over no connector",
            "busiest threads (after traffic)",
        ]
    )
    idle = idle_by_connector(result)
    base = idle.get(NO_CONNECTOR)
    base_worst = None if base is None else max((v for v in base if v is not None), default=None)

    def cell(cost: IdleCost | None) -> str:
        if cost is None:
            return "-"
        return f"{cost.cores:.2%} ({cost.prefill.cores:.2%} + {cost.decode.cores:.2%})"

    for pair in sorted(result.pairs, key=lambda p: (_order(p.connector), p.round)):
        worst = max((c.cores for c in (pair.idle_fresh, pair.idle_after) if c), default=None)
        over = (
            "-"
            if worst is None or base_worst is None or pair.connector == NO_CONNECTOR
            else f"{worst - base_worst:+.2%}"
        )
        table.add(
            LABELS[pair.connector],
            pair.round + 1,
            cell(pair.idle_fresh),
            cell(pair.idle_after),
            over,
            _threads(pair),
        )
    return table


def _order(connector: str) -> int:
    return (NO_CONNECTOR, *CONNECTORS).index(connector)


def _threads(pair: PairRun) -> str:
    cost = pair.idle_after or pair.idle_fresh
    if cost is None:
        return "-"
    parts = []
    for side, usage in (("P", cost.prefill), ("D", cost.decode)):
        for name, cores in list(usage.threads.items())[:3]:
            if cores >= 0.002:
                parts.append(f"{side} {name} {cores:.1%}")
    return ", ".join(parts) or "none above 0.2%"


# --- text --------------------------------------------------------------------------------------


def report_text(result: ServingResult) -> str:
    """Every table, for a terminal."""
    c = result.config
    lines = [
        f"kvpush bench serving, {result.started:%Y-%m-%d %H:%M %Z}, {result.elapsed_s:.0f} s",
        f"order: {' | '.join(', '.join(o) for o in result.orders)}",
        f"P capacity at {c.load_length} tokens: "
        + (
            "unknown"
            if result.capacity is None
            else f"{result.capacity:.2f} prefills/s ({result.capacity_source})"
        ),
        "",
        "latency (ms)",
        latency_table(result).text(),
        "",
        "kvpush / upstream (below 1: kvpush lower)",
        ratio_table(result).text(),
        "",
        "pairs",
        source_table(result).text(),
    ]
    table = breakdown_table(result)
    if table is not None:
        lines += ["", "kvpush's handover, step by step (median ms)", table.text()]
    lines += [
        "",
        "idle CPU (share of one core)",
        idle_table(result).text(),
        "",
        f"handover goal (<= {HANDOVER_GOAL:g}x upstream at load): " + handover_verdict(result).text,
        "TTFT goal (never worse than upstream): " + ttft_verdict(result).text,
        *slowdown_notes(result),
        f"idle goal (< {IDLE_GOAL_CORES:.0%} of a core): " + idle_verdict(result).text,
    ]
    return "\n".join(lines)


# --- markdown and plots ------------------------------------------------------------------------


def _machine(result: ServingResult) -> str:
    model = cpu_model()
    return (
        f"{os.cpu_count()} cores ({model}), Linux {platform.release()}, Python "
        f"{platform.python_version()}, kvpush {kvpush.__version__}, vLLM (CPU) "
        f"{result.notes.get('vllm', 'unknown')}. The machine "
        f"is shared (load average {result.notes.get('load_before', 'n/a')} before, "
        f"{result.notes.get('load_after', 'n/a')} after): absolute times are noisy"
    )


def plots(result: ServingResult, img_dir: Path) -> list[tuple[str, Path]]:
    """The PNGs (alt text, path): TTFT and handover against prompt length one at a time, and
    against load."""
    stats = stats_by_phase(result)
    keys = phase_keys(result)
    sequential = [k for k in keys if k.load is None]
    loads = [k for k in keys if k.load is not None]
    connectors = connectors_run(result)
    written: list[tuple[str, Path]] = []
    nan = float("nan")

    def series(phase_list: Sequence[PhaseKey], name: str) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for connector in connectors:
            values = []
            for key in phase_list:
                s = stats.get((connector, key))
                values.append(nan if s is None else getattr(s, name) * 1000.0)
            out[LABELS[connector]] = values
        return out

    if len(sequential) > 1:
        x = [float(k.length) for k in sequential]
        path = img_dir / "serving-ttft-length.png"
        line_chart(
            path,
            "TTFT p50, one request at a time",
            x,
            series(sequential, "ttft_p50"),
            "prompt tokens",
            "ms",
            log=True,
        )
        written.append(("TTFT against prompt length", path))
        path = img_dir / "serving-handover-length.png"
        line_chart(
            path,
            "Handover p50 (first token - P done), one at a time",
            x,
            series(sequential, "handover_p50"),
            "prompt tokens",
            "ms",
            log=True,
        )
        written.append(("Handover against prompt length", path))
    if loads:
        phases = [*[k for k in sequential if k.length == loads[0].length], *loads]
        categories = [k.label for k in phases]
        path = img_dir / "serving-handover-load.png"
        bar_chart(
            path,
            f"Handover p50 at {loads[0].length} tokens by load",
            categories,
            series(phases, "handover_p50"),
            "ms",
            log=True,
        )
        written.append(("Handover against load", path))
        path = img_dir / "serving-ttft-load.png"
        bar_chart(
            path,
            f"TTFT p50 at {loads[0].length} tokens by load",
            categories,
            series(phases, "ttft_p50"),
            "ms",
            log=True,
        )
        written.append(("TTFT against load", path))
    return written


def _image_links(images: Sequence[tuple[str, Path]], doc: Path) -> list[str]:
    out = []
    for alt, path in images:
        try:
            rel = os.path.relpath(path, doc.parent)
        except ValueError:
            rel = str(path)
        out.append(f"![{alt}]({rel})")
    return out


P2P_FOOTNOTE = (
    "¹ Above 100%: vLLM counts a request's prompt tokens when it finishes and its p2p tokens "
    "when the KV arrives, so requests that received their KV but were cut off at the deadline "
    "count only in the second."
)

E2E_INTRO = """\
`kvpush bench serving` (`lab/kvpush_lab/bench/serving.py`) runs real vLLM servers on this machine:
a prefill server P confined to core 0 and a decode server D confined to core 1 (each server's
whole process tree, as if each had a host of its own; `docs/vllm-cpu.md` says why), the tiny local
model (`kvpush model make`: Qwen3, 2 layers, fp32, random weights), 128-token blocks, D without
prefix caching, one pair at a time. For each connector it starts the pair, measures it idle (next
section), sends unmeasured warm-up requests (handshakes), then the same prompts at the same
arrival times: every prompt length one request at a time, then open-loop Poisson arrivals of one
length at multiples of P's prefill capacity (measured on the same pair without a connector): below
1, P keeps up; above 1, P saturates and requests queue on it. Answers are {max_tokens} tokens,
greedy, `ignore_eos`. Each pair's phases share a time budget ({budget:g} s, split evenly over the
phases left; a load phase may send for at least {min_phase:g} s), so a connector whose requests
take tens of seconds sends fewer of them (`not sent` below) instead of stretching the run.

The bench client routes every request through kvpush's router core in-process
(`kvpush.router`, the code `kvpush proxy` serves), so all connectors see the same router. **Push**
(kvpush and upstream `NixlPushConnector`): P's leg (`max_tokens` 1, `do_remote_decode`) and D's
leg (P's coordinates, one `X-Request-Id` and `transfer_id`) go out at the same moment.
**Pull** (`NixlConnector`, vLLM's default): P's leg first; D's leg, with the
`kv_transfer_params` P answered, when P's answer arrives.

**TTFT**: request sent → first token streamed by D. **TPOT**: mean time between D's tokens
after the first. **Handover**: D's first token minus P's answer, which comes when P's prefill is
done; the same definition for all three (for pull it includes D's request, D's READ and D's
first step; for push, whatever of the WRITE and D's first step is left after P's answer, which
can be about 0: D's first token races P's own answer through P's API server).
**P leg**: request sent → P's answer (prefill plus queueing). A request unanswered after
{timeout:g} s counts as failed. D's `/metrics` confirm where the prompt's KV came from
(`over p2p`: prompt tokens D received rather than computed; a connector that recomputed would
look fast).
"""

IDLE_INTRO = """\
CPU time an idle P + D pair burns: `utime + stime` of every process in each server's process
group (API server, engine core, worker; read from `/proc`), over a window after the servers are
healthy and have settled (**fresh**), and again after the load above, when the connectors have
handshaken and hold connections (**after traffic**). The same pair without any connector is
vLLM's own idle cost; **over no connector** is the connector's share (the larger of the two
windows minus the baseline's larger). 100% = one core busy all the time.
"""


def e2e_section(result: ServingResult, doc: Path, img_dir: Path) -> str:
    images = plots(result, img_dir)
    c = result.config
    capacity = (
        "unknown"
        if result.capacity is None
        else f"{result.capacity:.2f} prefills/s at {c.load_length} tokens "
        f"({result.capacity_source})"
    )
    lines = [
        E2E_INTRO.format(
            max_tokens=c.max_tokens,
            budget=c.pair_budget_s,
            min_phase=MIN_PHASE_S,
            timeout=c.request_timeout_s,
        ),
        f"Measured {result.started:%Y-%m-%d %H:%M %Z} in {result.elapsed_s / 60:.1f} min with:",
        "",
        "```bash",
        f"{c.command(COMMAND)} --markdown {_doc_arg(doc)}",
        "```",
        "",
        f"Machine: {_machine(result)}. Connector order: "
        + " | ".join(" → ".join(o) for o in result.orders)
        + f". P's capacity: {capacity}.",
        "",
        f"**Goals.** Handover at most {HANDOVER_GOAL:g}x each upstream connector's at load: "
        f"{handover_verdict(result).text}. TTFT never worse than upstream: "
        f"{ttft_verdict(result).text}.",
        "",
        "**Where the time goes.** " + ". ".join(slowdown_notes(result)) + "." + spin_note(result),
        "",
        latency_table(result).markdown(),
        "",
        "kvpush over upstream (below 1: kvpush's is lower):",
        "",
        ratio_table(result).markdown(),
        "",
        source_table(result).markdown(),
    ]
    if any(p.source and (p.source.p2p_share or 0) > 1 for p in result.pairs):
        lines += ["", P2P_FOOTNOTE]
    table = breakdown_table(result)
    if table is not None:
        lines += [
            "",
            "kvpush's handover step by step, from the connector's timelines (`KVPUSH_TIMELINE_DIR`;"
            " medians in ms): **step wait**: vLLM's scheduler decided the prefill was done → the"
            " worker marked the KV ready; **registration at P after ready**: negative when D's"
            " registration was there first; **ready → posted**: P's writer planned and posted the"
            " WRITE (with UCX's cma transport on one host the copy runs inside the post, so the"
            " WRITE's time shows here and posted → completed is near 0); **posted → completed**:"
            " the rest of the WRITE; **completed → D DONE**: D holds the"
            " completion; **completed → first token**: D's scheduling and first step, and the"
            " stream to the client.",
            "",
            table.markdown(),
        ]
    if images:
        lines += ["", *_image_links(images, doc)]
    return "\n".join(lines)


def idle_section(result: ServingResult) -> str:
    verdict = idle_verdict(result)
    lines = [
        IDLE_INTRO,
        f"Measured in the same run ({result.config.idle_s:g} s windows, "
        f"{result.config.settle_s:g} s after start-up or the last request). "
        f"**Goal** (kvpush idle < {IDLE_GOAL_CORES:.0%} of a core): {verdict.text}.",
        "",
        idle_table(result).markdown(),
    ]
    return "\n".join(lines)


def _doc_arg(doc: Path) -> str:
    try:
        return str(doc.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(doc)


def write_markdown(result: ServingResult, doc: Path, img_dir: Path) -> None:
    """Rewrites the ``End to end (vLLM)`` and ``Idle cost`` sections of ``doc`` (other sections
    kept) and writes the plots into ``img_dir``."""
    replace_section(doc, E2E_SECTION, e2e_section(result, doc, img_dir))
    replace_section(doc, IDLE_SECTION, idle_section(result))


def summary_figures(result: ServingResult) -> Mapping[str, str]:
    """The headline figures, one line each (for a report to a person)."""
    out: dict[str, str] = {}
    for (connector, key), s in sorted(
        stats_by_phase(result).items(), key=lambda item: (item[0][1].label, item[0][0])
    ):
        out[f"{connector} {key.label}"] = (
            f"TTFT p50 {_ms(s.ttft_p50)} p99 {_ms(s.ttft_p99)}, TPOT {_ms(s.tpot_p50)}, "
            f"handover p50 {_ms(s.handover_p50)} p99 {_ms(s.handover_p99)} ms, "
            f"failed {s.failed}/{s.requests}"
        )
    for connector, (fresh, after) in idle_by_connector(result).items():
        out[f"idle {connector}"] = f"fresh {_pct(fresh)}, after traffic {_pct(after)}"
    return out
