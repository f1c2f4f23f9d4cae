"""kvpush registers its connector by name through vLLM's plugin entry point."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
]


def test_vllm_finds_the_connector_by_name_through_the_entry_point() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert "kvpush" in {p.name for p in plugins}, "install kvpush (not only its sources)"
    load_general_plugins()
    from kvpush.vllm.connector import KvPushConnector

    assert KVConnectorFactory._registry["KvPushConnector"]() is KvPushConnector
