"""Whether a test that needs NIXL's wheel runs, skips, or (under ``KVPUSH_REQUIRE_NIXL``) fails."""

from __future__ import annotations

import os

import pytest

import kvpush


def nixl_or_skip() -> None:
    """Skips a test that needs NIXL's wheel, unless ``KVPUSH_REQUIRE_NIXL`` makes that a failure
    (as ``scripts/dev test`` does: there NIXL is installed, and a skip would hide a break)."""
    try:
        kvpush.nixl.library_path()
    except kvpush.exceptions.NixlUnavailableError as error:
        if os.environ.get("KVPUSH_REQUIRE_NIXL"):
            raise
        pytest.skip(f"NIXL is not installed: {error}")
