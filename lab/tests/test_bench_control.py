"""``kvpush bench control`` (quick): both sides write the same bytes, every case is reported, and
the markdown sections are written. Nothing here asserts on time."""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker",
    reason="needs vLLM's NIXL push connector (run with .venv-vllm/bin/python -m pytest)",
)

from kvpush_lab.bench import control


@pytest.fixture(scope="module")
def result() -> control.ControlResult:
    return control.run(control.ControlConfig.quick(), progress=lambda line: None)


def test_kvpush_runs_cover_exactly_the_bytes_vllm_posts() -> None:
    for case in control.cases(control.ControlConfig.quick()):
        measured = control.measure_case(case, repeats=1, warmup=0)
        assert measured.same_bytes, case.name
        assert measured.kvpush_runs <= measured.vllm_descriptors, case.name
        req = control.request(case, *control.sides(case))
        token_bytes = control.HEADS * 2 * control.HEAD_SIZE * control.ELEMENT
        tokens = req.num_tokens - req.d_first_token
        assert measured.bytes == case.layers * tokens * token_bytes, case.name


def test_a_changed_block_is_seen_as_different_bytes() -> None:
    runs = np.array([[0, 100, 8], [8, 108, 8], [40, 200, 8]], dtype=np.uint64)
    merged = control.canonical_runs(runs)
    assert merged.tolist() == [[0, 100, 16], [40, 200, 8]]
    moved = runs.copy()
    moved[2, 1] = 208
    assert not np.array_equal(control.canonical_runs(moved), merged)


def test_fragmented_blocks_never_neighbour() -> None:
    ids = control.block_ids(500, 2000, contiguous=False)
    assert sorted(ids) == list(range(0, 1000, 2))
    assert all(abs(a - b) != 1 for a, b in itertools.pairwise(ids))


def test_every_case_and_pending_count_is_reported(result: control.ControlResult) -> None:
    config = control.ControlConfig.quick()
    names = {r.case.name for r in result.cases}
    assert names == {case.name for case in control.cases(config)}
    assert [m.pending for m in result.matching] == list(config.pending)
    text = control.report_text(result)
    for name in names:
        assert name in text
    for r in result.cases:
        assert r.same_bytes, r.case.name
        assert r.kvpush_runs > 0, r.case.name


def test_markdown_sections_are_written_and_others_kept(
    result: control.ControlResult, tmp_path: Path
) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Data path\n\nkept\n")
    control.write_markdown(result, doc, tmp_path / "img")
    text = doc.read_text()
    assert "## Data path\n\nkept" in text
    assert text.count("## Control path") == 1
    assert text.count("## Matching under load") == 1
    assert "| 8 x 64 fragmented |" in text
    assert (tmp_path / "img" / "control-path.png").stat().st_size > 0
    assert (tmp_path / "img" / "matching.png").stat().st_size > 0
    control.write_markdown(result, doc, tmp_path / "img")
    assert doc.read_text().count("## Control path") == 1


def test_cli_arguments() -> None:
    parser = argparse.ArgumentParser()
    control.add_arguments(parser)
    args = parser.parse_args(["--quick", "--markdown", "docs/benchmarks.md"])
    assert args.quick
    assert args.markdown == "docs/benchmarks.md"
    assert args.img_dir is None
