"""kvpush's vLLM connector: the only part of kvpush that imports vLLM.

``kv_connector_module_path: "kvpush.vllm"`` loads :class:`KvPushConnector` from here; vLLM is
imported only when the class is first asked for, so the vLLM-free parts of this package
(``config``, ``metadata``, ``_scheduler``, ``_worker``, ``_layout``) import and test without it.
"""

from __future__ import annotations

from contextlib import suppress
from typing import Any

__all__ = ["KvPushConnector", "NixlPushConnector", "register"]

CONNECTOR_NAME = "KvPushConnector"


def __getattr__(name: str) -> Any:
    if name in ("KvPushConnector", "NixlPushConnector"):
        from kvpush.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'kvpush.vllm' has no attribute {name!r}")


def register() -> None:
    """vLLM plugin entry point (``vllm.general_plugins``): makes ``"kv_connector":
    "KvPushConnector"`` work without ``kv_connector_module_path``."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with suppress(ValueError):  # already registered: plugins may load more than once
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "kvpush.vllm.connector", "KvPushConnector"
        )
