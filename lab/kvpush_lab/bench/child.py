"""Running one measurement in a process of its own: its threads, file descriptors and memory
are then the measurement's alone, and nothing it leaves running outlives it."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any


def _call(function: Callable[..., Any], args: tuple[Any, ...], queue: Any) -> None:
    try:
        queue.put(("ok", function(*args)))
    except Exception as error:  # reported by the parent, naming the measurement
        queue.put(("error", f"{type(error).__name__}: {error}"))


def run_in_child(
    function: Callable[..., Any], args: tuple[Any, ...], timeout: float, what: str
) -> Any:
    """``function(*args)`` in a spawned process (``function`` must be importable by name): its
    result, or :class:`RuntimeError` naming ``what`` when it raised or gave nothing within
    ``timeout`` seconds. The process is killed if it does not end after that."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_call, args=(function, args, queue))
    child.start()
    try:
        status, value = queue.get(timeout=timeout)
    except Exception as error:  # queue.Empty: the child hung or died without a word
        raise RuntimeError(f"{what}: no result within {timeout:g} s ({error!r})") from None
    finally:
        child.join(timeout=60.0)
        if child.is_alive():
            child.kill()
    if status != "ok":
        raise RuntimeError(f"{what}: {value}")
    return value
