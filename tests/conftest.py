"""Shared fixtures for the binding tests."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator

import pytest

from tests.support.fake_http import Fake, Respond


@pytest.fixture
def secret() -> bytes:
    return b"kvpush-test-secret-0123456789abcdef"


@pytest.fixture
def fakes() -> Iterator[Callable[[Respond], Fake]]:
    made: list[Fake] = []

    def make(respond: Respond) -> Fake:
        made.append(Fake(respond))
        return made[-1]

    yield make
    for fake in made:
        fake.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The fault matrix's table (time to each side's outcome, canary), when it ran: the rows of
    tests/test_faults.py, then tests/test_netns.py's."""
    modules = (sys.modules.get(name) for name in ("tests.test_faults", "tests.test_netns"))
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
