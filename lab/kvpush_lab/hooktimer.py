"""An independent timer around every KV connector hook, in-process or in a real vLLM server.

:class:`Timer` wraps hooks and reports each outermost call on a thread (a hook that calls another
counts once) with its wall and thread CPU time. ``kvpush bench engine`` uses it on connector
objects in its own process; :func:`register` is a vLLM plugin (entry point
``vllm.general_plugins`` of kvpush's lab, loaded by vLLM in each of a server's processes) that
does nothing unless ``KVPUSH_HOOK_TIMER_DIR`` is set, and then wraps the hooks of vLLM's
``NixlConnector`` (pull), ``NixlPushConnector`` and kvpush's ``KvPushConnector`` at class level,
as shipped otherwise, and appends one record per call to ``hooks-<pid>.jsonl`` in that
directory (written every second by a thread of its own, and at exit):

``[monotonic_ns, pid, thread, connector class, role, hook, wall_ns, cpu_ns, scheduled]``

``scheduled`` is the step's scheduled token count on ``build_connector_meta``, else null.
:mod:`kvpush_lab.bench.engine_servers` reads the records into engine steps.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ENV = "KVPUSH_HOOK_TIMER_DIR"
#: The scheduler role's hooks.
SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "take_events",
    "get_kv_connector_stats",
    "build_kv_connector_stats",
)
#: The worker role's hooks, the per-layer ones of the forward pass included.
WORKER_HOOKS = (
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_transfer_results",
    "get_finished",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
    "get_kv_connector_kv_cache_events",
    "build_connector_worker_meta",
    "clear_connector_metadata",
)
HOOKS = tuple(dict.fromkeys(SCHEDULER_HOOKS + WORKER_HOOKS))
#: Seconds between two writes of a process's records.
FLUSH_S = 1.0

Record = Callable[[str, int, int, Sequence[Any]], None]


class Timer:
    """Wraps hooks so that ``record(hook, wall_ns, cpu_ns, args)`` hears of each outermost call
    on a thread once it returned or raised."""

    def __init__(self, record: Record) -> None:
        self._record = record
        self._local = threading.local()

    def wrap(self, name: str, hook: Callable[..., Any]) -> Callable[..., Any]:
        local, record = self._local, self._record

        @functools.wraps(hook)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if getattr(local, "depth", 0):
                return hook(*args, **kwargs)
            local.depth = 1
            wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
            try:
                return hook(*args, **kwargs)
            finally:
                cpu = time.thread_time_ns() - cpu
                wall = time.perf_counter_ns() - wall
                local.depth = 0
                record(name, wall, cpu, args)

        timed.__kvpush_timed__ = True  # type: ignore[attr-defined]
        return timed

    def wrap_object(self, target: object, names: Sequence[str]) -> None:
        """Wraps the hooks ``target`` has among ``names`` (on the object, or on a class)."""
        for name in names:
            hook = getattr(target, name, None)
            if callable(hook) and not getattr(hook, "__kvpush_timed__", False):
                setattr(target, name, self.wrap(name, hook))


class _Log:
    """One process's records, written to ``hooks-<pid>.jsonl``."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._path = directory / f"hooks-{os.getpid()}.jsonl"
        self._rows: list[list[Any]] = []
        self._lock = threading.Lock()
        atexit.register(self.flush)
        threading.Thread(target=self._flush_every, name="kvpush-hook-timer", daemon=True).start()

    def _flush_every(self) -> None:
        while True:
            time.sleep(FLUSH_S)
            self.flush()

    def record(self, name: str, wall: int, cpu: int, args: Sequence[Any]) -> None:
        connector = args[0] if args else None
        role = getattr(getattr(connector, "_role", None), "name", "unknown").lower()
        scheduled = None
        if name == "build_connector_meta" and len(args) > 1:
            scheduled = getattr(args[1], "total_num_scheduled_tokens", None)
        row = [
            time.monotonic_ns(),
            os.getpid(),
            threading.get_native_id(),
            type(connector).__name__,
            role,
            name,
            wall,
            cpu,
            scheduled,
        ]
        with self._lock:
            self._rows.append(row)

    def flush(self) -> None:
        with self._lock:
            rows, self._rows = self._rows, []
        self._write(rows)

    def _write(self, rows: list[list[Any]]) -> None:
        if rows:
            with open(self._path, "a", encoding="utf-8") as file:
                file.write("".join(json.dumps(row) + "\n" for row in rows))


def _connector_classes() -> list[type]:
    classes: list[type] = []
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
            NixlPullConnector,
            NixlPushConnector,
        )

        classes += [NixlPullConnector, NixlPushConnector]
    except ImportError:
        pass
    try:
        from kvpush.vllm.connector import KvPushConnector

        classes.append(KvPushConnector)
    except ImportError:
        pass
    return classes


def register() -> None:
    """vLLM's plugin hook: with ``KVPUSH_HOOK_TIMER_DIR`` set, times every connector hook of
    this process into that directory; without it, nothing."""
    directory = os.environ.get(ENV)
    if not directory:
        return
    timer = Timer(_Log(Path(directory)).record)
    for cls in _connector_classes():
        timer.wrap_object(cls, HOOKS)
