"""vLLM's NIXL connectors tuned for a small host: NIXL's progress thread off, or polling.

vLLM's ``NixlConnector`` and ``NixlPushConnector`` make their NIXL agent with
``nixl_agent_config(...)``, whose progress thread is on by default, and NIXL's Python API sets
that thread's poll delay to 0 (``agent_config.pthrDelay = 0`` in ``nixl._api.nixl_agent``): it
spins a whole core whether or not anything moves. On a host where each engine has one core,
that core is the one the forward pass needs, so the upstream connectors as shipped measure the
spin rather than their transfer design. Two ways out, neither of which upstream offers as a
setting:

* ``off``: no progress thread; UCX makes progress when the connector polls
  (``check_xfer_state`` and ``get_new_notifs``, which vLLM's workers call every engine step).
  An idle engine does not step, so a peer's one-sided operation that needs this side's progress
  (a READ of P's memory over TCP) waits for P's next request;
* ``poll:<µs>``: the progress thread on, sleeping ``<µs>`` microseconds between polls (NIXL's
  C++ ``pthrDelay``, which the Python API does not expose).

:func:`register` is a vLLM plugin (entry point ``vllm.general_plugins`` of kvpush's lab, loaded
in each of a server's processes). It does nothing unless :data:`ENV` is set; only the
benchmark's tuned upstream servers set it. kvpush's own agent never runs NIXL's progress thread.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

ENV = "KVPUSH_LAB_NIXL_PROGRESS_THREAD"
log = logging.getLogger(__name__)
#: Marks what :func:`register` wrapped, so a second load in one process wraps nothing twice.
_MARK = "_kvpush_lab_progress"


def parse(value: str) -> int | None:
    """``off`` → None (no thread); ``poll:<µs>`` → the poll delay in microseconds (>= 1)."""
    if value == "off":
        return None
    kind, _, delay = value.partition(":")
    if kind == "poll" and delay.isdigit() and int(delay) >= 1:
        return int(delay)
    raise ValueError(
        f"{ENV}={value!r}: expected 'off' (no progress thread) or 'poll:<microseconds>' (the "
        "thread sleeping that long between polls); unset: NIXL's default"
    )


def register() -> None:
    """vLLM's plugin hook: applies :data:`ENV` to every NIXL agent this process makes."""
    value = os.environ.get(ENV)
    if not value:
        return
    delay_us = parse(value)
    # vLLM sets this before its own first import of NIXL (vllm.distributed.nixl_utils), which
    # importing NIXL here would pre-empt.
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    try:
        from nixl import _api  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return
    if delay_us is None:
        _wrap(_api.nixl_agent_config, "__init__", _without_thread)
    else:
        _wrap(_api.nixlBind, "nixlAgent", functools.partial(_with_delay, delay_us))
    log.info("kvpush lab: NIXL agents in pid %d: progress thread %s", os.getpid(), value)


def _wrap(owner: Any, name: str, replacement: Any) -> None:
    original = getattr(owner, name)
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return replacement(original, *args, **kwargs)

    setattr(wrapper, _MARK, True)
    setattr(owner, name, wrapper)


def _without_thread(original: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    if args:  # enable_prog_thread is the first parameter
        args = (False, *args[1:])
    else:
        kwargs["enable_prog_thread"] = False
    original(self, *args, **kwargs)


def _with_delay(delay_us: int, original: Any, name: str, config: Any) -> Any:
    # nixl_agent has just set pthrDelay = 0 on this config; the agent reads it when made.
    config.pthrDelay = delay_us
    return original(name, config)
