"""Shared fixtures for the binding tests."""

from __future__ import annotations

import json
import os
import sys

import pytest

import kvpush

HEADS = 2
HEAD_BYTES = 8


def make_layout(
    block_tokens: int,
    num_blocks: int,
    regions: int = 4,
    *,
    heads: int = HEADS,
    order: str = "NHD",
    tp: tuple[int, int] = (0, 1),
    base: int = 0,
) -> kvpush.KvLayout:
    """`regions` back-to-back regions of `num_blocks` blocks each, starting at `base`."""
    block_bytes = block_tokens * heads * HEAD_BYTES
    return kvpush.KvLayout(
        [
            kvpush.Region(base + i * num_blocks * block_bytes, block_bytes, num_blocks)
            for i in range(regions)
        ],
        block_tokens=block_tokens,
        heads=heads,
        head_bytes=HEAD_BYTES,
        token_order=order,  # type: ignore[arg-type]
        tp_rank=tp[0],
        tp_size=tp[1],
    )


@pytest.fixture
def secret() -> bytes:
    return b"kvpush-test-secret-0123456789abcdef"


def nixl_or_skip() -> None:
    """Skips a test that needs NIXL's wheel, unless ``KVPUSH_REQUIRE_NIXL`` makes that a failure
    (as ``scripts/dev test`` does: there NIXL is installed, and a skip would hide a break)."""
    try:
        kvpush.nixl.library_path()
    except kvpush.exceptions.NixlUnavailableError as error:
        if os.environ.get("KVPUSH_REQUIRE_NIXL"):
            raise
        pytest.skip(f"NIXL is not installed: {error}")


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
