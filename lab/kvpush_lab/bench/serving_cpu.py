"""CPU time of whole process groups (Linux), for the idle-cost measurement.

A vLLM server runs in its own process group (:class:`kvpush_lab.servers.VllmServer`): the API
server, the engine core and its worker. :func:`snapshot` takes user + system CPU seconds of
every process in the given groups (and of each of their threads, to say which thread burns it)
from psutil; :func:`usage` turns two snapshots into cores busy on average in between: 1.0 is
one core fully used. A process that exits between the snapshots drops out; one that starts
counts from zero.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil


def comm(pid: int, tid: int | None = None) -> str | None:
    """The kernel's name of a process (its first thread) or of one of its threads: what
    ``pthread_setname_np`` and ``prctl(PR_SET_NAME)`` set. psutil reports threads' times but
    not their names, and stretches a process's 15-byte name from its command line, so the
    names are read here; None once the thread has gone."""
    try:
        return Path(f"/proc/{pid}/task/{tid or pid}/comm").read_text().rstrip("\n")
    except OSError:
        return None


def thread_name(pid: int, process: str, tid: int, thread: str) -> str:
    """``main`` for the process's first thread; a thread that never named itself inherits the
    process's name, so it is called ``unnamed`` rather than mistaken for the main one."""
    if tid == pid:
        return "main"
    return "unnamed" if thread == process else thread


@dataclass(frozen=True)
class Snapshot:
    """CPU seconds per process and per thread of some process groups at one moment."""

    at: float
    #: pid -> (group, process name, CPU seconds)
    processes: Mapping[int, tuple[int, str, float]]
    #: (pid, tid) -> (group, "process/thread" name, CPU seconds)
    threads: Mapping[tuple[int, int], tuple[int, str, float]]


def snapshot(groups: Iterable[int]) -> Snapshot:
    """Every process whose process group is in ``groups``, with its threads."""
    wanted = set(groups)
    processes: dict[int, tuple[int, str, float]] = {}
    threads: dict[tuple[int, int], tuple[int, str, float]] = {}
    at = time.monotonic()
    for process in psutil.process_iter():
        # A process or thread that ends between listing and reading is left out.
        with contextlib.suppress(psutil.Error, OSError):
            group = os.getpgid(process.pid)
            if group not in wanted:
                continue
            name = comm(process.pid)
            if name is None:
                continue
            with process.oneshot():
                times = process.cpu_times()
                tasks = process.threads()
            processes[process.pid] = (group, name, times.user + times.system)
            for task in tasks:
                thread = comm(process.pid, task.id)
                if thread is not None:
                    threads[(process.pid, task.id)] = (
                        group,
                        f"{name}/{thread_name(process.pid, name, task.id, thread)}",
                        task.user_time + task.system_time,
                    )
    return Snapshot(at, processes, threads)


@dataclass(frozen=True)
class GroupUsage:
    """Average cores busy over an interval, for one process group."""

    group: int
    seconds: float
    cores: float
    #: process name -> cores (names can repeat across pids: summed)
    processes: Mapping[str, float]
    #: the busiest threads, "process/thread" -> cores, busiest first
    threads: Mapping[str, float]


def usage(before: Snapshot, after: Snapshot, group: int, top_threads: int = 4) -> GroupUsage:
    """Cores used by ``group`` between two snapshots (process totals include exited threads)."""
    seconds = max(after.at - before.at, 1e-9)

    def cores(cpu_seconds: float) -> float:
        return cpu_seconds / seconds

    by_process: dict[str, float] = {}
    total = 0.0
    for pid, (pgrp, name, used) in after.processes.items():
        if pgrp != group:
            continue
        previous = before.processes.get(pid)
        delta = used - (previous[2] if previous is not None else 0.0)
        total += delta
        by_process[name] = by_process.get(name, 0.0) + cores(delta)
    by_thread: dict[str, float] = {}
    for key, (pgrp, name, used) in after.threads.items():
        if pgrp != group:
            continue
        previous_thread = before.threads.get(key)
        delta = used - (previous_thread[2] if previous_thread is not None else 0.0)
        by_thread[name] = by_thread.get(name, 0.0) + cores(delta)
    busiest = sorted(by_thread.items(), key=lambda item: -item[1])[:top_threads]
    return GroupUsage(
        group,
        seconds,
        cores(total),
        dict(sorted(by_process.items(), key=lambda item: -item[1])),
        {name: value for name, value in busiest if value > 0},
    )


def measure(groups: Mapping[str, int], seconds: float) -> dict[str, GroupUsage]:
    """Cores used by each named group over the next ``seconds``."""
    before = snapshot(groups.values())
    time.sleep(seconds)
    after = snapshot(groups.values())
    return {name: usage(before, after, group) for name, group in groups.items()}
