"""A short soak (tests/support/soak.py) in CI, so that the long one (scripts/dev soak) keeps
working."""

from __future__ import annotations

import pytest

from tests.support.nixl import nixl_or_skip
from tests.support.soak import main


def test_a_short_soak_ends_every_transfer_once_and_leaves_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    nixl_or_skip()
    status = main(["--minutes", "0.25", "--concurrency", "400", "--rss-slack-mib", "96"])
    out = capsys.readouterr().out
    print(out)
    assert status == 0, out
    assert "soak: OK" in out
