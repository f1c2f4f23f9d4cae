"""vLLM's NIXL connectors at their best on a small host: NIXL's progress thread off.

vLLM's ``NixlConnector`` and ``NixlPushConnector`` make their NIXL agent with
``nixl_agent_config(...)``, whose progress thread is on by default, and NIXL's Python API sets
that thread's poll delay to 0: it spins a whole core whether or not anything moves. On a host
where each engine has one core, that core is the one the forward pass needs, so the upstream
connectors as shipped measure the spin rather than their transfer design. With the thread off,
UCX makes progress when the connector polls (``check_xfer_state`` and ``get_new_notifs``, which
vLLM's workers call every engine step), which is how vLLM's connectors run when NIXL's thread
is disabled.

:func:`register` is a vLLM plugin (entry point ``vllm.general_plugins`` of kvpush's lab, loaded
in each of a server's processes). It does nothing unless :data:`ENV` is ``off``; then every
``nixl_agent_config`` made in the process has ``enable_prog_thread=False``. Only the benchmark's
upstream "best" servers set it; kvpush's own agent never runs NIXL's progress thread.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

ENV = "KVPUSH_LAB_NIXL_PROGRESS_THREAD"
log = logging.getLogger(__name__)


def register() -> None:
    """vLLM's plugin hook: with ``KVPUSH_LAB_NIXL_PROGRESS_THREAD=off``, NIXL agents made in
    this process run without NIXL's progress thread; otherwise nothing."""
    value = os.environ.get(ENV)
    if not value:
        return
    if value != "off":
        raise ValueError(f"{ENV}={value!r}: the only value is 'off' (unset: NIXL's default)")
    # vLLM sets this before its own first import of NIXL (vllm.distributed.nixl_utils), which
    # importing NIXL here would pre-empt.
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    try:
        from nixl import _api  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return
    config = _api.nixl_agent_config
    if getattr(config.__init__, "_kvpush_lab_no_progress", False):
        return
    original = config.__init__

    @functools.wraps(original)
    def without_progress_thread(self: Any, *args: Any, **kwargs: Any) -> None:
        if args:  # enable_prog_thread is the first parameter
            args = (False, *args[1:])
        else:
            kwargs["enable_prog_thread"] = False
        original(self, *args, **kwargs)

    without_progress_thread._kvpush_lab_no_progress = True  # type: ignore[attr-defined]
    config.__init__ = without_progress_thread
    log.info("kvpush lab: NIXL agents in pid %d run without NIXL's progress thread", os.getpid())
