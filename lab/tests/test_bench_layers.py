"""``kvpush bench layers``: both ways of handing a forward's layers to the endpoint run on the
real worker and endpoint, every forward timed, and the section says which way the ratio goes.
The times themselves are not asserted (the machine is shared)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from kvpush_lab.bench import layers


def test_both_ways_time_every_forward_and_the_section_is_written(
    section_written: Callable[[str, str], str],
) -> None:
    lines: list[str] = []
    points = layers.run([1, 3], layers=4, prompt_tokens=40, forwards=5, progress=lines.append)
    assert [p.requests for p in points] == [1, 3]
    for p in points:
        for samples in (p.batched_cpu, p.batched_wall, p.per_request_cpu, p.per_request_wall):
            assert len(samples) == 5
            assert all(ns > 0 for ns in samples)
        assert (p.refused, p.batched_refused) == (0, 0)
    assert len(lines) == 2
    assert "3 requests x 4 layers" in lines[1]
    text = section_written(layers.SECTION, layers.markdown(points, "cmd", 4, 40))
    assert f"## {layers.SECTION}" in text
    assert "one call per layer over one per request per layer" in text
    assert "| 3 |" in text


def test_the_command_runs_in_quick_mode(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    layers.add_arguments(parser)
    args = parser.parse_args(["--quick", "--layers", "2", "--prompt-tokens", "16"])
    assert layers.main(args) == 0
    table = capsys.readouterr().out.rsplit("requests in the forward", 1)[1]
    assert [line.split()[0] for line in table.splitlines()[2:] if line.strip()] == ["1", "8"]
