"""``kvpush bench idle`` and the report helpers every benchmark writes with. The CPU figures
themselves are not asserted (the machine is shared); what is checked is that the accounting
sees a busy thread, that both pairs really move a request before idling, and that a section
of the benchmarks document is replaced without touching the others."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvpush_lab.bench import idle, report
from tests.support.nixl import nixl_or_skip


def test_thread_accounting_sees_this_thread_spin() -> None:
    before = idle._thread_seconds()
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:
        pass
    after = idle._thread_seconds()
    used = sum(cpu - before.get(tid, (name, 0.0))[1] for tid, (name, cpu) in after.items())
    assert used > 0


def test_idle_pairs_warm_up_then_report_their_threads(tmp_path: Path) -> None:
    nixl_or_skip()
    lines: list[str] = []
    samples = idle.run(seconds=0.5, progress=lines.append)
    assert [s.variant for s in samples] == list(idle.VARIANTS)
    assert all(s.seconds >= 0.5 and s.percent >= 0 for s in samples)
    assert any("kvpush:" in line for line in lines)
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Other\n\nkept\n")
    report.replace_section(doc, idle.SECTION, idle.markdown(samples, "kvpush bench idle"))
    text = doc.read_text()
    assert "## Other\n\nkept\n" in text
    assert f"## {idle.SECTION}" in text
    assert "kvpush endpoints" in text
    assert "Goal (issue 5)" in text


def test_replace_section_rewrites_one_section_and_appends_new_ones(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nintro\n\n## A\n\nold a\n\n## B\n\nb stays\n")
    report.replace_section(doc, "A", "new a")
    report.replace_section(doc, "C", "c at the end")
    assert doc.read_text() == (
        "# Benchmarks\n\nintro\n\n## A\n\nnew a\n\n## B\n\nb stays\n\n## C\n\nc at the end\n"
    )


def test_table_renders_markdown_and_text_and_refuses_ragged_rows() -> None:
    table = report.Table(["case", "ratio"])
    table.add("64 x 1,000", report.ratio(30.0, 1.0))
    assert table.markdown().splitlines() == [
        "| case | ratio |",
        "|---|---|",
        "| 64 x 1,000 | 30.0x |",
    ]
    assert table.text().splitlines()[2].startswith("64 x 1,000")
    with pytest.raises(ValueError, match="1 cells"):
        table.add("only one cell")
    assert report.seconds(0.00125) == "1.25 ms"
    assert report.seconds(812e-9) == "812 ns"
