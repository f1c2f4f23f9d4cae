"""The package surface: re-exports, the exception hierarchy, keys, the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvpush
import kvpush.exceptions as exc
from kvpush.cli import main


def test_public_names_are_exported() -> None:
    for name in kvpush.__all__:
        assert hasattr(kvpush, name), name
    assert kvpush.__version__ == "0.1.0"


def test_every_exception_derives_from_kvpush_error() -> None:
    for name in exc.__all__:
        cls = getattr(exc, name)
        assert issubclass(cls, exc.KvPushError)
        assert issubclass(cls, Exception)
        assert cls.__module__ == "kvpush.exceptions"
    assert issubclass(exc.InvalidBlocksError, exc.PlanError)
    assert issubclass(exc.AuthenticationError, exc.ProtocolError)
    assert issubclass(exc.StaleEpochError, exc.RendezvousError)


@pytest.mark.parametrize(
    ("request_id", "key"),
    [
        ("cmpl-7f3e-0-0badf00d", "7f3e-0"),
        ("chatcmpl-7f3e-c0ffee11", "7f3e"),
        ("plain-id", "plain-id"),
        ("abc-DEADBEEF", "abc-DEADBEEF"),
    ],
)
def test_p_and_d_request_ids_share_a_key(request_id: str, key: str) -> None:
    assert kvpush.canonical_request_id(request_id) == key
    assert kvpush.transfer_key(request_id) == key
    assert kvpush.transfer_key(request_id, "xfer-1") == "xfer-1"


def test_version_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    out = capsys.readouterr().out
    assert f"kvpush/{kvpush.PROTOCOL_VERSION}" in out
    assert "NIXL" in out


def test_nixl_version_comes_from_the_wheel_that_ships_the_library() -> None:
    import importlib.metadata

    path = "/x/site-packages/.nixl_cu12.mesonpy.libs/libnixl_capi.so"
    try:
        expected: str | None = importlib.metadata.version("nixl-cu12")
    except importlib.metadata.PackageNotFoundError:
        expected = None
    assert kvpush.nixl.library_version(path) == expected
    assert kvpush.nixl.library_version("/elsewhere/libnixl_capi.so") is None


def test_demo_runs_end_to_end_and_verifies_bytes() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvpush.cli", "demo", "--core", "--requests", "8", "--layers", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "byte for byte: yes" in result.stdout
    assert "NOT REFUSED" not in result.stdout
    assert result.stdout.count("Error[") == 6


def test_the_vllm_plugin_entry_point_is_installed() -> None:
    import importlib.metadata

    (plugin,) = [
        p
        for p in importlib.metadata.entry_points(group="vllm.general_plugins")
        if p.name == "kvpush"
    ]
    assert plugin.value == "kvpush.vllm:register"


def test_model_command_reports_a_missing_dependency_cleanly(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import importlib.util

    if importlib.util.find_spec("transformers") is not None:
        pytest.skip("transformers is installed here: the e2e tests make the model for real")
    assert main(["model", "make", "/nonexistent/model"]) == 2
    assert "kvpush model make" in capsys.readouterr().err
