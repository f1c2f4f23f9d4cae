"""What every benchmark writes: markdown tables, sections of ``docs/benchmarks.md`` and PNG plots.

A benchmark owns one ``## `` section of the document; :func:`replace_section` rewrites that
section and keeps every other one, so each benchmark can be rerun on its own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Table:
    """A markdown table: a header row and rows of already formatted cells."""

    columns: Sequence[str]
    rows: list[Sequence[str]] = field(default_factory=list)

    def add(self, *cells: object) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"row has {len(cells)} cells, the table {len(self.columns)} columns")
        self.rows.append([str(cell) for cell in cells])

    def markdown(self) -> str:
        lines = [
            "| " + " | ".join(self.columns) + " |",
            "|" + "|".join("---" for _ in self.columns) + "|",
        ]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines)

    def text(self) -> str:
        """The table for a terminal: columns padded to their widest cell."""
        cells = [list(self.columns), *[list(row) for row in self.rows]]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.columns))]
        rendered = [
            "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in cells
        ]
        rendered.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(rendered)


def ratio(numerator: float, denominator: float) -> str:
    """``12.3x``; ``n/a`` when the denominator is zero or missing."""
    if not denominator:
        return "n/a"
    value = numerator / denominator
    return f"{value:.0f}x" if value >= 100 else f"{value:.1f}x" if value >= 10 else f"{value:.2f}x"


def seconds(value: float | None) -> str:
    """A duration with a unit that keeps three significant digits (``812 ns``, ``1.25 ms``)."""
    if value is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value / 1e-9:.3g} ns"


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100, linear between closest ranks); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (rank - low))


def microseconds(ns: float | None) -> str:
    """Nanoseconds as a table cell in microseconds (``12.3``; ``-`` for none)."""
    if ns is None:
        return "-"
    return f"{ns / 1e3:.1f}" if ns < 1e7 else f"{ns / 1e3:.0f}"


def load_average() -> str:
    """The 1, 5 and 15 minute load averages (``n/a`` where the platform has none)."""
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def replace_section(path: Path, heading: str, body: str) -> None:
    """Writes ``## heading`` followed by ``body`` into ``path``, replacing that section (up to
    the next ``## `` heading) if it exists and appending it otherwise."""
    title = f"## {heading}"
    lines = path.read_text().splitlines() if path.exists() else ["# Benchmarks"]
    start = next((i for i, line in enumerate(lines) if line.strip() == title), None)
    section = [title, "", *body.strip("\n").splitlines(), ""]
    if start is None:
        while lines and not lines[-1].strip():
            lines.pop()
        lines += ["", *section]
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), None)
        lines[start : len(lines) if end is None else end] = section
    while lines and not lines[-1].strip():
        lines.pop()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(
            "plots need matplotlib: pip install matplotlib (scripts/dev bench installs it)"
        ) from None
    return plt


def bar_chart(
    path: Path,
    title: str,
    categories: Sequence[str],
    series: Mapping[str, Sequence[float]],
    ylabel: str,
    log: bool = False,
) -> None:
    """Grouped bars: one group per category, one bar per series."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(categories) * len(series) ** 0.5), 4.0))
    width = 0.8 / max(1, len(series))
    for index, (name, values) in enumerate(series.items()):
        offsets = [c + (index - (len(series) - 1) / 2) * width for c in range(len(categories))]
        ax.bar(offsets, values, width, label=name)
    ax.set_xticks(range(len(categories)), categories, rotation=20 if len(categories) > 6 else 0)
    _finish(plt, fig, ax, path, title, ylabel, log)


def line_chart(
    path: Path,
    title: str,
    x: Sequence[float],
    series: Mapping[str, Sequence[float]],
    xlabel: str,
    ylabel: str,
    log: bool = False,
) -> None:
    """One line with markers per series over the same x values."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, values in series.items():
        ax.plot(x, values, marker="o", label=name)
    ax.set_xlabel(xlabel)
    if log:
        ax.set_xscale("log")
    _finish(plt, fig, ax, path, title, ylabel, log)


def _finish(plt: Any, fig: Any, ax: Any, path: Path, title: str, ylabel: str, log: bool) -> None:
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
