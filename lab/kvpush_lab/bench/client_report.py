"""What ``kvpush bench client`` reports: terminal tables, the goals met or not, the
``## vLLM's benchmark client`` section of ``docs/benchmarks.md`` and its plots.

Rounds of the same system are pooled: a point's percentiles are over every round's requests.
Ratios are kvpush's figure over the other system's (below 1: kvpush's is lower, i.e. better, for
every figure here).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpush_lab.bench import report
from kvpush_lab.bench.client_result import (
    FLOOR_ONE,
    FLOOR_TWO,
    KVPUSH_LAYERWISE,
    OUTPUT_TOKENS,
    STAGES,
    SYSTEMS,
    TPOT_SLO_MS,
    TTFT_SLO_MS,
    UPSTREAM,
    ClientResult,
    Point,
)
from kvpush_lab.bench.serving_result import KVPUSH


@dataclass
class Summary:
    """A system at a point, pooled over rounds."""

    system: str
    point: Point
    rate: float | None
    sent: int
    completed: int
    ttft: list[float]
    tpot: list[float]
    p_leg: list[float]
    handover: list[float]
    #: TTFT p50 of each round that finished, for the spread.
    round_ttft_p50: list[float]
    throughput: float | None
    goodput: float | None
    p2p_share: float | None
    errors: list[str]
    client_cores: float | None = None
    proxy_cores: float | None = None

    def q(self, metric: str, pct: float) -> float | None:
        return report.percentile(getattr(self, metric), pct)


def summarize(result: ClientResult) -> list[Summary]:
    summaries = []
    for point in result.config.points():
        for system in result.config.systems:
            runs = [r for r in result.runs if r.system == system and r.point == point]
            if not runs:
                continue
            done = [r for r in runs if r.error is None]
            summaries.append(
                Summary(
                    system,
                    point,
                    runs[0].rate,
                    point.prompts * len(runs),
                    sum(r.completed for r in done),
                    [t for r in done for t in r.ttft],
                    [t for r in done for t in r.tpot],
                    [t for r in done for t in r.p_leg],
                    [t for r in done for t in r.handover],
                    [p for r in done if (p := report.percentile(r.ttft, 50)) is not None],
                    _mean([r.throughput for r in done]),
                    _mean([r.goodput for r in done]),
                    _mean([r.p2p_share for r in done]),
                    sorted({r.error for r in runs if r.error}),
                    _mean([r.client_cores for r in done]),
                    _mean([r.proxy_cores for r in done]),
                )
            )
    return summaries


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.3g}" if value < 1 else f"{value * 1e3:.0f}"


def points_table(summaries: Sequence[Summary]) -> report.Table:
    t = report.Table(
        [
            "point",
            "system",
            "rate (req/s)",
            "done",
            "TTFT p50 (ms)",
            "TTFT p90 (ms)",
            "TTFT p99 (ms)",
            "TTFT p50 spread over rounds (ms)",
            "TPOT p50 (ms)",
            "TPOT p99 (ms)",
            "P leg p50 (ms)",
            "handover p50 / p99 (ms)",
            "req/s",
            "goodput (req/s)",
            "over p2p",
            "client / proxy cores",
        ]
    )
    for s in summaries:
        spread = (
            f"{_ms(min(s.round_ttft_p50))}-{_ms(max(s.round_ttft_p50))}"
            if len(s.round_ttft_p50) > 1
            else "-"
        )
        t.add(
            s.point.label,
            s.system,
            "-" if s.rate is None else f"{s.rate:.2f}",
            f"{s.completed}/{s.sent}" + (f" ({'; '.join(s.errors)})" if s.errors else ""),
            _ms(s.q("ttft", 50)),
            _ms(s.q("ttft", 90)),
            _ms(s.q("ttft", 99)),
            spread,
            _ms(s.q("tpot", 50)),
            _ms(s.q("tpot", 99)),
            _ms(s.q("p_leg", 50)),
            "-" if not s.handover else f"{_ms(s.q('handover', 50))} / {_ms(s.q('handover', 99))}",
            "-" if s.throughput is None else f"{s.throughput:.2f}",
            "-" if s.goodput is None else f"{s.goodput:.2f}",
            "-" if s.p2p_share is None else f"{s.p2p_share:.0%}",
            " / ".join("-" if c is None else f"{c:.2f}" for c in (s.client_cores, s.proxy_cores)),
        )
    return t


def stages_table(result: ClientResult) -> report.Table:
    """kvpush's stages per point and kvpush system (whole-request or layer-wise push), pooled
    over rounds: median and p90 (ms); and, layer-wise, the share of the bytes (and of the
    transfers) written before P's KV was ready."""
    t = report.Table(
        [
            "point",
            "system",
            "transfers",
            *[f"{name} p50 / p90 (ms)" for name, _, _ in STAGES],
            "bytes streamed before ready (transfers that streamed)",
        ]
    )
    kvpush_systems = [s for s in result.config.systems if SYSTEMS[s].connector == KVPUSH]
    for point, system in ((p, s) for p in result.config.points() for s in kvpush_systems):
        runs = [r for r in result.runs if r.system == system and r.point == point and r.stages]
        if not runs:
            continue
        pooled = {name: [v for r in runs for v in r.stages.get(name, [])] for name, _, _ in STAGES}
        cells = []
        for name, _, _ in STAGES:
            p50, p90 = report.percentile(pooled[name], 50), report.percentile(pooled[name], 90)
            cells.append("-" if p50 is None or p90 is None else f"{p50:.3g} / {p90:.3g}")
        shares = [
            (r.streamed_bytes_share, r.streamed_transfers_share)
            for r in runs
            if r.streamed_bytes_share is not None and r.streamed_transfers_share is not None
        ]
        streamed = (
            f"{sum(b for b, _ in shares) / len(shares):.0%} "
            f"({sum(n for _, n in shares) / len(shares):.0%})"
            if shares
            else "-"
        )
        t.add(point.label, system, max(len(v) for v in pooled.values()), *cells, streamed)
    return t


def _at(summaries: Sequence[Summary], system: str, point: Point) -> Summary | None:
    return next(
        (s for s in summaries if s.system == system and s.point == point and s.completed), None
    )


def _better_upstream(
    summaries: Sequence[Summary], point: Point, metric: str, pct: float
) -> tuple[str, float] | None:
    """The upstream system with the lowest ``metric`` percentile at ``point``; a system that did
    not finish the point counts as worse than any that did."""
    best: tuple[str, float] | None = None
    for name in UPSTREAM:
        value = _value(summaries, name, point, metric, pct)
        if value is not None and (best is None or value < best[1]):
            best = (name, value)
    return best


def _value(
    summaries: Sequence[Summary], system: str, point: Point, metric: str, pct: float
) -> float | None:
    """A system's percentile at a point; None if it did not finish the point."""
    s = _at(summaries, system, point)
    return None if s is None or s.errors else s.q(metric, pct)


def _against(
    summaries: Sequence[Summary], point: Point, metric: str, pct: float, system: str | None = None
) -> str:
    """kvpush's ``metric`` percentile over ``system``'s (None: the better upstream's, named)."""
    mine = _value(summaries, KVPUSH, point, metric, pct)
    if system is None:
        best = _better_upstream(summaries, point, metric, pct)
        if best is None or mine is None:
            return "-"
        return f"{report.ratio(mine, best[1])} ({best[0]})"
    theirs = _value(summaries, system, point, metric, pct)
    return "-" if mine is None or theirs is None else report.ratio(mine, theirs)


def goals_table(summaries: Sequence[Summary], points: Sequence[Point]) -> report.Table:
    """kvpush's figures over the floors' and the better upstream's, per point."""
    t = report.Table(
        [
            "point",
            f"TTFT p50 vs {FLOOR_ONE}",
            f"TPOT p99 vs {FLOOR_TWO}",
            "TTFT p50 vs better upstream",
            "TTFT p99 vs better upstream",
            "TPOT p99 vs better upstream",
            "handover p50 vs better upstream",
        ]
    )
    for point in points:
        if _at(summaries, KVPUSH, point) is None:
            continue
        t.add(
            point.label,
            _against(summaries, point, "ttft", 50, FLOOR_ONE),
            _against(summaries, point, "tpot", 99, FLOOR_TWO),
            _against(summaries, point, "ttft", 50),
            _against(summaries, point, "ttft", 99),
            _against(summaries, point, "tpot", 99),
            _against(summaries, point, "handover", 50),
        )
    return t


def layerwise_table(summaries: Sequence[Summary], points: Sequence[Point]) -> report.Table:
    """Whole-request push (kvpush as shipped) and layer-wise push, side by side per point:
    each figure as whole / layer-wise (ms), and layer-wise over whole."""
    t = report.Table(["point", "TTFT p50", "TTFT p99", "TPOT p99", "handover p50", "handover p99"])
    for point in points:
        if _at(summaries, KVPUSH, point) is None or _at(summaries, KVPUSH_LAYERWISE, point) is None:
            continue
        cells = []
        for metric, pct in (("ttft", 50), ("ttft", 99), ("tpot", 99), ("handover", 50),
                            ("handover", 99)):  # fmt: skip
            whole = _value(summaries, KVPUSH, point, metric, pct)
            layers = _value(summaries, KVPUSH_LAYERWISE, point, metric, pct)
            cells.append(
                "-"
                if whole is None or layers is None
                else f"{_ms(whole)} / {_ms(layers)} ({report.ratio(layers, whole)})"
            )
        t.add(point.label, *cells)
    return t


def verdicts(summaries: Sequence[Summary], points: Sequence[Point]) -> list[str]:
    """The issue's end-to-end goals for kvpush, each met, not met or not measured (a system it
    needs was not in the run or did not finish the point), from this run alone."""
    lines = []
    load_points = [p for p in points if p.load is not None]
    for length in sorted({p.input_len for p in load_points}):
        row = sorted((p for p in load_points if p.input_len == length), key=lambda p: p.load or 0)
        ours = _value(summaries, KVPUSH, row[0], "ttft", 50)
        floor = _value(summaries, FLOOR_ONE, row[0], "ttft", 50)
        head = f"TTFT p50 at {row[0].label} <= 1.1x {FLOOR_ONE}'s"
        if ours is None or floor is None:
            lines.append(f"{head}: not measured")
        else:
            verdict = "met" if ours <= 1.1 * floor else "not met"
            lines.append(f"{head}: {ours / floor:.2f}x, {verdict}")
        # The crossover: the lightest load from which on kvpush's TPOT p99 is below the
        # two-core server's at every load of the sweep.
        lower = []
        for point in row:
            mine = _value(summaries, KVPUSH, point, "tpot", 99)
            theirs = _value(summaries, FLOOR_TWO, point, "tpot", 99)
            lower.append(None if mine is None or theirs is None else mine < theirs)
        head = f"TPOT p99 at {length} in below {FLOOR_TWO}'s"
        if all(x is None for x in lower):
            lines.append(f"{head}: not measured")
            continue
        crossover = next(
            (row[i] for i in range(len(row)) if all(x is True for x in lower[i:])), None
        )
        lines.append(
            f"{head}: from {crossover.load:g}x P's capacity on (the crossover)"
            if crossover is not None
            else f"{head}: not at the heaviest load of the sweep (no crossover)"
        )
    worse, compared = [], 0
    for point in points:
        for metric, pct in (("ttft", 99), ("tpot", 99)):
            ours = _value(summaries, KVPUSH, point, metric, pct)
            best = _better_upstream(summaries, point, metric, pct)
            if ours is None or best is None:
                continue
            compared += 1
            if ours > best[1]:
                worse.append(
                    f"{metric.upper()} p99 at {point.label} ({ours / best[1]:.2f}x {best[0]})"
                )
    head = "TTFT and TPOT p99 never worse than the better upstream's"
    if not compared:
        lines.append(f"{head}: not measured")
    else:
        lines.append(
            f"{head}: "
            + (
                f"met at all {compared} comparisons"
                if not worse
                else f"not met: {'; '.join(worse)}"
            )
        )
    over, compared = [], 0
    for point in points:
        ours = _value(summaries, KVPUSH, point, "handover", 50)
        best = _better_upstream(summaries, point, "handover", 50)
        if ours is None or best is None:
            continue
        compared += 1
        if ours > 0.5 * best[1]:
            over.append(f"{point.label} ({ours / best[1]:.2f}x {best[0]})")
    head = "Handover p50 <= 0.5x the better upstream's"
    if not compared:
        lines.append(f"{head}: not measured")
    else:
        lines.append(
            f"{head}: "
            + (f"met at all {compared} points" if not over else f"not met: {'; '.join(over)}")
        )
    return lines


def plots(summaries: Sequence[Summary], points: Sequence[Point], img_dir: Path) -> list[Path]:
    written = []
    systems = list(dict.fromkeys(s.system for s in summaries))
    for length in sorted({p.input_len for p in points if p.load is not None}):
        row = sorted(
            (p for p in points if p.load is not None and p.input_len == length),
            key=lambda p: p.load or 0,
        )
        if len(row) < 2:
            continue
        for metric, pct, name in (("ttft", 50, "TTFT p50"), ("tpot", 99, "TPOT p99")):
            series = {}
            for system in systems:
                values = []
                for point in row:
                    v = _value(summaries, system, point, metric, pct)
                    values.append(math.nan if v is None else v * 1e3)
                if not all(math.isnan(v) for v in values):
                    series[system] = values
            path = img_dir / f"client-{metric}-{length}.png"
            report.line_chart(
                path,
                f"{name} at {length} input tokens, {OUTPUT_TOKENS} out (vllm bench serve)",
                [p.load or 0.0 for p in row],
                series,
                "offered load (x P's prefill capacity)",
                f"{name} (ms)",
                log=metric == "ttft",
            )
            written.append(path)
    return written


def _complete_rounds(result: ClientResult) -> int:
    """Rounds in which every system ran every point."""
    each = len(result.config.systems) * len(result.config.points())
    return sum(
        1
        for index in range(len(result.orders))
        if len([r for r in result.runs if r.round == index]) == each
    )


def _rounds(result: ClientResult) -> str:
    """How many rounds ran: all asked for, or the run was stopped part-way."""
    asked, complete = result.config.rounds, _complete_rounds(result)
    if complete == asked:
        return f"{asked} round(s)"
    return f"{complete} of the {asked} rounds asked for (the run was stopped after that)"


def markdown(result: ClientResult, doc: Path, command: str) -> str:
    summaries = summarize(result)
    points = result.config.points()
    c = result.config
    capacity = ", ".join(f"{v:.2f}/s at {k}" for k, v in sorted(result.capacity.items()))
    img = plots(summaries, points, doc.parent / "img")
    orders = result.orders[: max(1, _complete_rounds(result))]
    lines = [
        "`kvpush bench client` (`lab/kvpush_lab/bench/client.py`) points vLLM's own benchmark "
        "client, `vllm bench serve` (the installed vLLM's `vllm.benchmarks.serve`), at every "
        "system: random dataset, fixed input length, "
        f"{c.output_len} output tokens (`--ignore-eos`), Poisson arrivals at multiples of P's "
        "prefill capacity (measured first on the one-core aggregated server, one prompt at a "
        f"time: {capacity} prefills)"
        + (
            f", a closed-loop `--max-concurrency` sweep at {c.input_lens[0]} tokens"
            if c.concurrencies
            else ""
        )
        + f", {c.warmups} warm-ups per point, goodput against TTFT <= "
        f"{TTFT_SLO_MS:g} ms and TPOT <= {TPOT_SLO_MS:g} ms. Pairs: P on core 0, D on core 1, "
        "behind `kvpush proxy` (pull routing for `NixlConnector`, push for the others). "
        "Floors: `aggregated-1core`, one server with one engine's resources (what "
        "disaggregation costs); `aggregated-2core`, one server with the pair's two cores "
        "(whether it pays). Upstream as shipped, and `-best`: NIXL's progress thread off in "
        "its servers (`kvpush_lab.upstream_best`), which otherwise spins the engine's only "
        "core (`-poll`, the thread polling every millisecond, is an option). With the thread "
        "off, NIXL makes progress only when the connector polls it, which vLLM's connectors do "
        "from their engine steps, so a `-best` pair can be slower than as shipped; each goal is "
        "judged against the best upstream figure at that point, whichever variant it came "
        "from. The client, the proxy and the "
        "servers share the machine's two cores (`client / proxy cores`: how much of them vLLM's "
        "client and the proxy took during the point; on a real deployment both run elsewhere, "
        "while here they take CPU from P and D, where the one-core floor's server keeps its "
        "core to itself). **P leg** and **handover** come from the "
        "proxy's log line per request (P's answer, D's first byte after the request came in): "
        "handover is D's first token minus P's answer, for pull D's request, READ and first "
        "step, for push whatever of the WRITE and D's first step is left after P answered.",
        "",
        f"Measured {result.started[:16].replace('T', ' ')} UTC in "
        f"{result.elapsed_s / 60:.0f} min, {_rounds(result)}, orders "
        f"{'; '.join(' → '.join(o) for o in orders)}, with:",
        "",
        "```bash",
        command,
        "```",
        "",
        f"Machine: {report.cpu_model()}, vLLM (CPU) {result.notes.get('vllm')}; load average "
        f"{result.notes.get('load_before')} before, {result.notes.get('load_after')} after. "
        "Percentiles pool every round's requests; the spread column is the lowest and highest "
        "per-round TTFT p50.",
        "",
        "**Goals (kvpush, this run).**",
        "",
        *[f"- {line}" for line in verdicts(summaries, points)],
        "",
        "kvpush over each reference (below 1: kvpush's is lower):",
        "",
        goals_table(summaries, points).markdown(),
        "",
        *(
            [
                'Whole-request push against layer-wise push (P with `layerwise: "on"`): '
                "whole / layer-wise in ms, and layer-wise over whole (below 1: layer-wise is "
                "lower). The share of the bytes written before P's KV was ready is in the "
                "stages table below.",
                "",
                layerwise_table(summaries, points).markdown(),
                "",
            ]
            if KVPUSH_LAYERWISE in c.systems
            else []
        ),
        points_table(summaries).markdown(),
        "",
        "Cores the servers burn while idle, just started (mean over rounds; the spin of NIXL's "
        "progress thread shows here): "
        + "; ".join(
            f"{name} {statistics.fmean(v):.2f}" for name, v in result.idle_cores.items() if v
        )
        + ".",
        "",
        "kvpush's handover stage by stage, from the connector's timelines (negative: the "
        "second event came first; `D admitted after P's KV ready` late means D's scheduler "
        "admitted the request after P had finished, so push's overlap was lost; `completed → "
        "D holds all` is negative when D held the DONE before P's writer saw its WRITE "
        "complete, each on its own clock of one host):",
        "",
        stages_table(result).markdown(),
        "",
        *[f"![{p.stem}](img/{p.name})" for p in img],
    ]
    return "\n".join(lines)
