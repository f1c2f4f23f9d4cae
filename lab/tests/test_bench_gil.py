"""``kvpush bench gil``: every endpoint call an engine step makes is timed alone and with another
Python thread busy, beside a call that gives the GIL up, and the section is written. The times
themselves are not asserted (the machine is shared)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from kvpush_lab.bench import gil


def test_every_call_is_timed_both_ways_and_the_section_is_written(
    section_written: Callable[[str, str], str],
) -> None:
    lines: list[str] = []
    samples = gil.run(20, progress=lines.append)
    assert [s.call for s in samples] == [
        "expect (D)",
        "cancel (D)",
        "ready (P)",
        "abort (P)",
        "streams_ready (P, a layer)",
        gil.POLL,
        gil.RELEASES,
    ]
    for s in samples:
        assert len(s.alone) == len(s.busy) == 20, s.call
        assert all(ns > 0 for ns in s.alone + s.busy), s.call
    assert len(lines) == 2
    text = section_written(gil.SECTION, gil.markdown(samples, "cmd"))
    assert f"## {gil.SECTION}" in text
    assert "| ready (P) |" in text
    assert "the call that gives the GIL up took" in text


def test_the_command_runs_in_quick_mode(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    gil.add_arguments(parser)
    assert gil.main(parser.parse_args(["--quick"])) == 0
    out = capsys.readouterr().out
    assert "calls over 1 ms, busy" in out
