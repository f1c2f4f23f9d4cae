"""``kvpush bench core``: the Rust core's criterion benches (``benches/benches/*.rs``), read back
from criterion's own estimates and written as the ``## Core (criterion)`` section.

* the planner on one request of 64 layers x (K, V) x 1,000 blocks, contiguous and fragmented,
  for P/D block-size translation and tensor-parallel head slicing;
* the rendezvous table against a bare ``Mutex<HashMap>`` (one thread, two racing threads) and
  its match cost with 0 and 10,000 unmatched entries pending.

It needs a source checkout and cargo: it runs ``cargo bench`` in the repository this module
belongs to (or the current directory).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvpush_lab.bench import report

SECTION = "Core (criterion)"
PLANNER = "planner/64 layers x 1000 blocks"
ONE_THREAD = "rendezvous/one thread, per transfer"
TWO_THREADS = "rendezvous/two threads racing halves"
PENDING = "rendezvous/match with pending entries"
#: What the planner bench prints per case before measuring it.
RUNS_LINE = re.compile(
    r"^(?P<case>.+) (?P<order>contiguous|fragmented): "
    r"(?P<runs>\d+) runs \((?P<before>\d+) before merging\)$"
)

Key = tuple[str, str, str | None]


class CoreBenchError(RuntimeError):
    """cargo or the benches could not run."""


@dataclass(frozen=True)
class Estimate:
    """Criterion's median time per iteration and its 95% interval, in seconds."""

    median: float
    low: float
    high: float

    def cell(self) -> str:
        low, high = report.seconds(self.low), report.seconds(self.high)
        return f"{report.seconds(self.median)} ({low} to {high})"


@dataclass
class CoreResult:
    estimates: dict[Key, Estimate] = field(default_factory=dict)
    #: (case, order) -> (runs after merging, before merging), as the planner bench printed them.
    runs: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    command: str = ""
    seconds: float = 0.0


def repository() -> Path:
    """The checkout holding the benches: above this file, else the current directory."""
    for base in (Path(__file__).resolve(), Path.cwd().resolve()):
        for candidate in (base, *base.parents):
            if (candidate / "benches" / "benches").is_dir() and (candidate / "Cargo.toml").exists():
                return candidate
    raise CoreBenchError(
        "no kvpush source checkout found (benches/benches/*.rs): run from the repository"
    )


def read_estimates(criterion_dir: Path, since: float) -> dict[Key, Estimate]:
    """Every benchmark criterion measured at or after ``since`` (its ``new`` estimates)."""
    found: dict[Key, Estimate] = {}
    for meta in criterion_dir.glob("**/new/benchmark.json"):
        estimates = meta.with_name("estimates.json")
        if not estimates.exists() or estimates.stat().st_mtime < since:
            continue
        info = json.loads(meta.read_text())
        median = json.loads(estimates.read_text())["median"]
        interval = median["confidence_interval"]
        found[(info["group_id"], info["function_id"], info.get("value_str"))] = Estimate(
            median["point_estimate"] * 1e-9,
            interval["lower_bound"] * 1e-9,
            interval["upper_bound"] * 1e-9,
        )
    return found


def run(quick: bool = False, progress: Callable[[str], None] = print) -> CoreResult:
    root = repository()
    timing = ["--warm-up-time", "0.2", "--measurement-time", "0.5"] if quick else [
        "--warm-up-time", "1", "--measurement-time", "3"
    ]  # fmt: skip
    targets = sorted(f"--bench={path.stem}" for path in (root / "benches" / "benches").glob("*.rs"))
    command = ["cargo", "bench", "-p", "kvpush-benches", *targets, "--", *timing]
    result = CoreResult(command=" ".join(command))
    started = time.time()
    progress(f"core: {result.command} (in {root}; compiles the benches first)")
    try:
        process = subprocess.Popen(
            command, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    except FileNotFoundError:
        raise CoreBenchError(
            "cargo is not on PATH: the core benches need the Rust toolchain"
        ) from None
    assert process.stdout is not None
    last: collections.deque[str] = collections.deque(maxlen=15)
    for line in process.stdout:
        line = line.rstrip()
        last.append(line)
        matched = RUNS_LINE.match(line)
        if matched:
            key = (matched["case"], matched["order"])
            result.runs[key] = (int(matched["runs"]), int(matched["before"]))
        if matched or line.startswith(("planner/", "rendezvous/")) or "time:" in line:
            progress(f"core: {line.strip()}")
    if process.wait() != 0:
        tail = "\n".join(last)
        raise CoreBenchError(f"{result.command} failed (exit {process.returncode}):\n{tail}")
    target = Path(os.environ.get("CARGO_TARGET_DIR", root / "target"))
    result.estimates = read_estimates(target / "criterion", started - 1.0)
    result.seconds = time.time() - started
    if not result.estimates:
        raise CoreBenchError(f"criterion wrote no estimates under {target / 'criterion'}")
    return result


def planner_table(result: CoreResult) -> report.Table:
    table = report.Table(
        ["case", "contiguous", "fragmented", "runs after merging (contiguous / fragmented)"]
    )
    cases = sorted({case for group, case, _ in result.estimates if group == PLANNER})
    for case in cases:
        cells = []
        for order in ("contiguous", "fragmented"):
            estimate = result.estimates.get((PLANNER, case, order))
            cells.append("-" if estimate is None else estimate.cell())
        runs = [result.runs.get((case, order)) for order in ("contiguous", "fragmented")]
        merged = " / ".join("-" if r is None else f"{r[0]:,}" for r in runs)
        before = {r[1] for r in runs if r is not None}
        if len(before) == 1:
            merged += f" (from {before.pop():,})"
        table.add(case.replace("->", " → "), *cells, merged)
    return table


def table_table(result: CoreResult) -> report.Table:
    e = result.estimates
    table = report.Table(["group", "kvpush table", "`Mutex<HashMap>`", "ratio"])
    rows = (
        (
            "one thread, per transfer (kvpush: ready + register + begin + finish; baseline: two "
            "map operations)",
            e.get((ONE_THREAD, "kvpush table (match + write + finish)", None)),
            e.get((ONE_THREAD, "Mutex<HashMap> (match only)", None)),
        ),
        (
            "two threads racing the halves of 20,000 transfers",
            e.get((TWO_THREADS, "kvpush table", "20000")),
            e.get((TWO_THREADS, "Mutex<HashMap>", "20000")),
        ),
    )
    for label, mine, theirs in rows:
        if mine is None or theirs is None:
            table.add(label, "-", "-", "-")
            continue
        if mine.median > theirs.median:
            verdict = f"{report.ratio(mine.median, theirs.median)} slower"
        else:
            verdict = f"{report.ratio(theirs.median, mine.median)} faster"
        table.add(label, mine.cell(), theirs.cell(), verdict)
    empty, full = e.get((PENDING, "kvpush table", "0")), e.get((PENDING, "kvpush table", "10000"))
    if empty is not None and full is not None:
        table.add(
            "one match with 0 / 10,000 unmatched entries pending on each side",
            f"{report.seconds(empty.median)} / {report.seconds(full.median)}",
            "—",
            f"{report.ratio(full.median, empty.median)} (flat is 1x)",
        )
    return table


INTRO = """\
`kvpush bench core` runs `{command}` (`benches/benches/*.rs`) and reads criterion's median and
95% interval back from `target/criterion`; measured {date} in {seconds:.0f} s on {machine}.

**Planner**, one request of 64 layers x (K, V) x 1,000 blocks (16,000 tokens, 128,000 block
copies before merging), `plan_into` a reused buffer; fragmented = every other block, shuffled,
on both sides:"""

TABLE_INTRO = """\
**Rendezvous table** against a single `Mutex<HashMap>` holding whichever half came first (no
epochs, deadlines, fences or write gating: a lower bound on any table):"""

OUTRO = """\
The table does four state transitions, a deadline-heap item and fence bookkeeping per transfer
where the baseline does two map operations, so it is slower than the bare lock in absolute terms;
what it buys is exactly-once matching under every interleaving (loom), epochs, cancels that
never free a block a write may land in, and bounded memory. Its per-match cost does not grow
with the number of pending entries (vLLM's writer scans its pending dict by suffix: see
"Matching under load"). Where its cost went and what was cut: "Profiling: the rendezvous table"
below. The two-thread race depends on the machine's load more than on either table: on a quiet
machine the sharded table has beaten the single lock, on a busy one it has measured 1.7-2.7x
slower (two threads that share two cores with other jobs mostly wait for a CPU, not a lock)."""


def markdown(result: CoreResult) -> str:
    machine = (
        f"{os.cpu_count()} cores ({report.cpu_model()}), shared (load average "
        f"{report.load_average()}): compare within a row"
    )
    intro = INTRO.format(
        command=result.command,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        seconds=result.seconds,
        machine=machine,
    )
    tables = [planner_table(result).markdown(), TABLE_INTRO, table_table(result).markdown()]
    return "\n\n".join([intro, *tables, OUTRO])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="short measurements (a check)")
    parser.add_argument("--markdown", metavar="PATH", help="write the section into PATH")


def main(args: argparse.Namespace) -> int:
    try:
        result = run(args.quick)
    except CoreBenchError as error:
        print(f"kvpush bench core: {error}")
        return 1
    print()
    print(planner_table(result).text())
    print()
    print(table_table(result).text())
    if args.markdown:
        report.replace_section(Path(args.markdown), SECTION, markdown(result))
        print(f"\nwrote the '{SECTION}' section of {args.markdown}")
    return 0
