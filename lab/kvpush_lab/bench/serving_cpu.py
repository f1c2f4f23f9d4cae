"""CPU time of whole process groups, read from ``/proc`` (Linux), for the idle-cost measurement.

A vLLM server runs in its own process group (:class:`kvpush_lab.servers.VllmServer`): the API
server, the engine core and its worker. :func:`snapshot` reads ``utime + stime`` of every
process in the given groups (and of each of their threads, to say which thread burns it);
:func:`usage` turns two snapshots into cores busy on average in between: 1.0 is one core
fully used. A process that exits between the snapshots drops out; one that starts counts
from zero.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
TICKS_PER_S = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/<pid>[/task/<tid>]/stat`` this module reads."""

    pid: int
    comm: str
    pgrp: int
    ticks: int  # utime + stime


def parse_stat(text: str) -> ProcStat:
    """One ``stat`` line. ``comm`` is in parentheses and may hold spaces and parentheses, so
    the fields after it are found from the last ``)``."""
    head, _, tail = text.rpartition(")")
    pid_text, _, comm = head.partition(" (")
    fields = tail.split()
    # fields[0] is field 3 (state): pgrp is field 5, utime 14, stime 15 (proc(5)).
    return ProcStat(int(pid_text), comm, int(fields[2]), int(fields[11]) + int(fields[12]))


def read_stat(path: Path) -> ProcStat | None:
    try:
        return parse_stat(path.read_text())
    except (OSError, ValueError, IndexError):
        return None


def thread_name(process: ProcStat, thread: ProcStat) -> str:
    """``main`` for the process's first thread; a thread that never named itself inherits the
    process's name, so it is called ``unnamed`` rather than mistaken for the main one."""
    if thread.pid == process.pid:
        return "main"
    return "unnamed" if thread.comm == process.comm else thread.comm


@dataclass(frozen=True)
class Snapshot:
    """CPU ticks per process and per thread of some process groups at one moment."""

    at: float
    #: pid -> (group, process name, ticks)
    processes: Mapping[int, tuple[int, str, int]]
    #: (pid, tid) -> (group, "process/thread" name, ticks)
    threads: Mapping[tuple[int, int], tuple[int, str, int]]


def snapshot(groups: Iterable[int]) -> Snapshot:
    """Every process whose process group is in ``groups``, with its threads."""
    wanted = set(groups)
    processes: dict[int, tuple[int, str, int]] = {}
    threads: dict[tuple[int, int], tuple[int, str, int]] = {}
    at = time.monotonic()
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        stat = read_stat(entry / "stat")
        if stat is None or stat.pgrp not in wanted:
            continue
        processes[stat.pid] = (stat.pgrp, stat.comm, stat.ticks)
        with contextlib.suppress(OSError):
            for task in (entry / "task").iterdir():
                thread = read_stat(task / "stat")
                if thread is not None:
                    threads[(stat.pid, thread.pid)] = (
                        stat.pgrp,
                        f"{stat.comm}/{thread_name(stat, thread)}",
                        thread.ticks,
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

    def cores(ticks: int) -> float:
        return ticks / TICKS_PER_S / seconds

    by_process: dict[str, float] = {}
    total = 0
    for pid, (pgrp, comm, ticks) in after.processes.items():
        if pgrp != group:
            continue
        previous = before.processes.get(pid)
        delta = ticks - (previous[2] if previous is not None else 0)
        total += delta
        by_process[comm] = by_process.get(comm, 0.0) + cores(delta)
    by_thread: dict[str, float] = {}
    for key, (pgrp, name, ticks) in after.threads.items():
        if pgrp != group:
            continue
        previous_thread = before.threads.get(key)
        delta = ticks - (previous_thread[2] if previous_thread is not None else 0)
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
