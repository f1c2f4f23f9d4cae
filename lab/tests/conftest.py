"""The lab's tests (benchmarks, the demo): fixtures shared with the product's tests, and one
that writes a benchmark's section."""

from collections.abc import Callable
from pathlib import Path

import pytest

from kvpush_lab.bench import report
from tests.support.fake_http import fakes

__all__ = ["fakes", "section_written"]  # fixtures: fakes for the serving benchmark's tests


@pytest.fixture
def section_written(tmp_path: Path) -> Callable[[str, str], str]:
    """Writes a section (its name, its body) into a fresh benchmarks document and returns the
    document's text."""

    def write(name: str, body: str) -> str:
        doc = tmp_path / "benchmarks.md"
        doc.write_text("# Benchmarks\n")
        report.replace_section(doc, name, body)
        return doc.read_text()

    return write
