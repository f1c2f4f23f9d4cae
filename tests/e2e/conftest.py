"""End-to-end tests against real vLLM servers (``-m e2e``); skipped where vLLM is not installed.

The fixtures every module shares: the tiny Qwen3 (made once per module, on its own path) and a
folder for the servers' logs, printed at the end so a failure's logs are easy to find.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "e2e: starts real vLLM servers (minutes; needs scripts/setup-vllm's venv)",
    )


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpush_lab.model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen3")


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("logs")
    yield path
    print(f"server logs: {path}")
