"""``kvpush bench core`` reads criterion's estimates back: only this run's, keyed by group,
function and value, and renders them with the planner's merge counts and the table's ratios.
(Running cargo itself is ``scripts/dev core-bench``'s job, not a unit test's.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvpush_lab.bench import core, report


def write_estimate(root: Path, group: str, function: str, value: str | None, ns: float) -> Path:
    directory = root / group.replace("/", "_") / function / (value or "") / "new"
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"group_id": group, "function_id": function, "value_str": value}
    (directory / "benchmark.json").write_text(json.dumps(meta))
    interval = {"lower_bound": ns * 0.9, "upper_bound": ns * 1.1}
    estimates = {"median": {"point_estimate": ns, "confidence_interval": interval}}
    path = directory / "estimates.json"
    path.write_text(json.dumps(estimates))
    return path


def test_only_this_runs_estimates_are_read(tmp_path: Path) -> None:
    fresh = write_estimate(tmp_path, core.ONE_THREAD, "Mutex<HashMap> (match only)", None, 100.0)
    stale = write_estimate(tmp_path, core.TWO_THREADS, "Mutex<HashMap>", "20000", 5e6)
    os.utime(stale, (1.0, 1.0))
    found = core.read_estimates(tmp_path, since=fresh.stat().st_mtime - 1)
    assert list(found) == [(core.ONE_THREAD, "Mutex<HashMap> (match only)", None)]
    assert abs(found[(core.ONE_THREAD, "Mutex<HashMap> (match only)", None)].median - 1e-7) < 1e-15


def test_tables_carry_merge_counts_and_say_which_way_a_ratio_goes(tmp_path: Path) -> None:
    line = core.RUNS_LINE.match("NHD P16->D16 fragmented: 128000 runs (128000 before merging)")
    assert line is not None
    assert (line["case"], line["order"], line["runs"]) == ("NHD P16->D16", "fragmented", "128000")
    result = core.CoreResult(command="cargo bench", seconds=1.0)
    e = core.Estimate
    result.estimates = {
        (core.PLANNER, "NHD P16->D16", "contiguous"): e(20e-6, 19e-6, 21e-6),
        (core.PLANNER, "NHD P16->D16", "fragmented"): e(100e-6, 99e-6, 101e-6),
        (core.ONE_THREAD, "kvpush table (match + write + finish)", None): e(5e-7, 4e-7, 6e-7),
        (core.ONE_THREAD, "Mutex<HashMap> (match only)", None): e(1e-7, 1e-7, 1e-7),
        (core.TWO_THREADS, "kvpush table", "20000"): e(4e-3, 4e-3, 4e-3),
        (core.TWO_THREADS, "Mutex<HashMap>", "20000"): e(8e-3, 8e-3, 8e-3),
    }
    result.runs = {("NHD P16->D16", "contiguous"): (128, 128000)}
    result.runs[("NHD P16->D16", "fragmented")] = (128000, 128000)
    planner = core.planner_table(result).markdown()
    assert "| NHD P16 → D16 | 20 µs (19 µs to 21 µs) | 100 µs" in planner
    assert "128 / 128,000 (from 128,000)" in planner
    table = core.table_table(result).markdown()
    assert "5.00x slower" in table
    assert "2.00x faster" in table
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# B\n\n## Core (criterion)\n\nlast run's tables\n\n## Data path\n\nkept\n")
    report.replace_section(doc, core.SECTION, core.markdown(result))
    text = doc.read_text()
    assert "last run's tables" not in text
    assert "## Data path\n\nkept" in text
    assert "`kvpush bench core` runs `cargo bench`" in text
