"""End-to-end tests against real vLLM servers (``-m e2e``); skipped where vLLM is not installed."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "e2e: starts real vLLM servers (minutes; needs scripts/setup-vllm's venv)",
    )
