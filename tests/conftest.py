"""Shared fixtures for the binding tests."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.support.fake_http import fakes

__all__ = ["fakes"]  # the fixture, for every test under tests/


@pytest.fixture
def secret() -> bytes:
    return b"kvpush-test-secret-0123456789abcdef"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The fault matrix's table (time to each side's outcome, canary), when it ran: the rows of
    tests/two_process/test_faults.py, then tests/two_process/test_netns.py's."""
    names = ("tests.two_process.test_faults", "tests.two_process.test_netns")
    modules = (sys.modules.get(name) for name in names)
    rows = [row for module in modules for row in getattr(module, "REPORT", [])]
    if not rows:
        return
    terminalreporter.section(
        "fault matrix: each side's outcomes and their times (from the fault), canary, P after"
    )
    columns = ["case", "fault", "d", "p", "canary", "p_entries_left", "p_rss"]
    terminalreporter.write_line(" | ".join(columns))
    for row in rows:
        terminalreporter.write_line(" | ".join(str(row.get(c, "-")) for c in columns))
    path = os.environ.get("KVPUSH_FAULT_REPORT")
    if path:
        with open(path, "w", encoding="utf-8") as out:
            out.writelines(json.dumps(row) + "\n" for row in rows)
