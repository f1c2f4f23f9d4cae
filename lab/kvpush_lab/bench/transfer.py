"""``kvpush bench transfer``: kvpush's data path against a plain NIXL WRITE driven from Python.

One request moves a whole paged KV cache (1 GiB by default, in 16 KiB blocks: 32 layers x K/V x
1,024 blocks of 16 tokens x 4 heads x 128 x fp16) from P to D, two spawned processes on this
machine, over NIXL's UCX backend on loopback. Each process holds its cache once, pre-touched, and
three ways of moving it:

* ``kvpush``: P's :class:`~kvpush.Endpoint` reports the KV ready, D's expects it; P's native
  writer plans the runs, merges what is contiguous on both sides, posts one WRITE and polls it;
* ``plain NIXL, prepped``: a Python NIXL agent per side, as vLLM's connector drives one: P
  prepares a descriptor list of every block of every region for itself and for D once, then per
  request computes indices, ``make_prepped_xfer`` (NIXL merges consecutive indices) and
  ``transfer``, and polls to DONE; D sends a notification carrying its block ids and waits for
  the completion notification;
* ``plain NIXL, initialize_xfer``: the same, with per-request descriptor lists
  (``get_xfer_descs`` + ``initialize_xfer``, no merging): the NIXL call kvpush's writer makes.

Two block orders: ``contiguous`` (D's blocks in P's order) and ``fragmented`` (D's blocks a
random permutation in which no two neighbours merge). Paths alternate within each round and a
warm-up round is discarded; tables give best / median over the repeats, then the ratios.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import kvpush
from kvpush._native import lab
from kvpush_lab.bench.report import cpu_model, load_average
from kvpush_lab.bench.worker import BenchWorker, Method
from kvpush_lab.cache import CacheShape
from kvpush_lab.peer import PeerError, RemoteWorker

LAYOUTS = ("contiguous", "fragmented")
PATHS = ("kvpush", "prepped", "initialize")
LABELS = {
    "kvpush": "kvpush",
    "prepped": "plain NIXL, prepped (Python)",
    "initialize": "plain NIXL, initialize_xfer (Python)",
}
UcxTls = Literal["default", "tcp"]
UCX_TRANSPORTS: dict[str, str] = {
    "default": (
        "UCX's own choice with `UCX_NET_DEVICES=lo`: cma (`process_vm_writev`) for the WRITE, "
        "which copies inside the post, and tcp on lo for notifications"
    ),
    "tcp": (
        "`UCX_TLS=tcp UCX_NET_DEVICES=lo`: the WRITE streams over TCP on loopback and "
        "completes asynchronously, while the initiator polls"
    ),
}
#: How long a worker may take to start: import, allocate, pre-touch, create its agents.
STARTUP_TIMEOUT_S = 120.0
SECTION = "## Data path"


class BenchError(RuntimeError):
    """The benchmark could not run or a transfer failed; the message says which and where."""


@dataclass(frozen=True)
class BenchConfig:
    """What to measure. The cache is ``layers`` x K/V regions of equal block arrays."""

    gib: float = 1.0
    block_kib: int = 16
    repeats: int = 3
    ucx_tls: UcxTls = "default"
    layers: int = 32
    heads: int = 4
    head_dim: int = 128
    seed: int = 0

    def geometry(self) -> CacheShape:
        token_bytes = self.heads * self.head_dim * 2
        block_bytes = self.block_kib * 1024
        if block_bytes % token_bytes:
            raise BenchError(f"--block-kib {self.block_kib}: not a whole number of 1 KiB tokens")
        blocks = int(self.gib * 2**30) // (2 * self.layers * block_bytes)
        if blocks < 2:
            raise BenchError(
                f"--gib {self.gib:g} holds fewer than 2 blocks of {self.block_kib} KiB per "
                f"layer and K/V ({2 * self.layers} regions): make it larger"
            )
        if self.repeats < 1:
            raise BenchError("--repeats must be at least 1")
        return CacheShape(
            self.layers, blocks, block_bytes // token_bytes, self.heads, self.head_dim
        )

    def env(self) -> dict[str, str]:
        """UCX settings for both workers: loopback only (else TCP also uses other interfaces)."""
        env = {"UCX_NET_DEVICES": "lo"}
        if self.ucx_tls == "tcp":
            env["UCX_TLS"] = "tcp"
        return env

    @property
    def transfer_timeout_s(self) -> float:
        """The bound on one transfer: far above any healthy one, so only a stuck one hits it."""
        return 30.0 + 30.0 * self.gib

    def command(self, markdown: str | None = None) -> str:
        line = (
            f"kvpush bench transfer --gib {self.gib:g} --block-kib {self.block_kib} "
            f"--repeats {self.repeats} --ucx-tls {self.ucx_tls}"
        )
        return f"{line} --markdown {markdown}" if markdown else line


@dataclass(frozen=True)
class Sample:
    """One transfer as measured. ``plan_s`` is None where the path's planning is not separable
    from its post (kvpush: see :attr:`BenchResult.planning`)."""

    bytes: int
    descriptors: int
    plan_s: float | None
    control_s: float
    total_s: float
    d_view_s: float


@dataclass
class BenchResult:
    config: BenchConfig
    geometry: CacheShape
    started: datetime.datetime
    samples: dict[tuple[str, str], list[Sample]] = field(default_factory=dict)
    #: kvpush's planner alone (``Planner.plan`` on the same layouts, in this process), per layout.
    planning: dict[str, list[float]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    elapsed_s: float = 0.0


def scattered(blocks: int, rng: random.Random) -> list[int]:
    """A permutation of ``range(blocks)`` in which no two neighbours are consecutive ids and
    which does not both start at 0 and end at ``blocks - 1``: against P's blocks in order, no
    two runs merge on D, within a region or across into the next one."""
    order = list(range(blocks))
    for _ in range(10_000):
        rng.shuffle(order)
        joined = any(order[i + 1] == order[i] + 1 for i in range(blocks - 1))
        if not joined and not (order[0] == 0 and order[-1] == blocks - 1):
            return order
    raise BenchError(f"found no unmergeable order of {blocks} blocks")


def block_orders(blocks: int, seed: int) -> dict[str, tuple[list[int], list[int]]]:
    """P's and D's block lists per layout; P's blocks are always in order."""
    ordered = list(range(blocks))
    return {
        "contiguous": (ordered, ordered),
        "fragmented": (ordered, scattered(blocks, random.Random(seed))),
    }


class TransferBench:
    """One run: both workers, the warm-up round and the measured rounds."""

    def __init__(self, config: BenchConfig, progress: Callable[[str], None]) -> None:
        self.config = config
        self.geometry = config.geometry()
        self.orders = block_orders(self.geometry.num_blocks, config.seed)
        self.progress = progress
        self.sequence = 0
        self.result = BenchResult(config, self.geometry, datetime.datetime.now().astimezone())
        self.wait = config.transfer_timeout_s + 15.0

    def run(self) -> BenchResult:
        started = time.perf_counter()
        self.result.notes["load_before"] = load_average()
        env = self.config.env()
        p, d = (
            RemoteWorker(
                env,
                BenchWorker,
                name=f"{role.upper()} worker",
                wait=None,  # both start (allocate, pre-touch) at once; _measure waits
                role=role,
                shape=self.geometry,
            )
            for role in ("p", "d")
        )
        try:
            self._measure(p, d)
        finally:
            d.close()
            p.close()
        self.result.notes["load_after"] = load_average()
        self.result.elapsed_s = time.perf_counter() - started
        return self.result

    def _measure(self, p: RemoteWorker, d: RemoteWorker) -> None:
        g = self.geometry
        hello_p = p.started(STARTUP_TIMEOUT_S)
        hello_d = d.started(STARTUP_TIMEOUT_S)
        self.progress(
            f"P and D up: {g.bytes / 2**30:.2f} GiB each ({g.layers} layers x K/V x {g.num_blocks} "
            f"blocks of {g.block_bytes // 1024} KiB), pre-touched in "
            f"{hello_p['pretouch_s']:.2f} s / {hello_d['pretouch_s']:.2f} s"
        )
        prepared = p.call("connect", STARTUP_TIMEOUT_S, "connect", peer=hello_d)
        d.call("connect", STARTUP_TIMEOUT_S, "connect", peer=hello_p)
        self.result.notes["setup"] = (
            f"pre-touching each cache took {hello_p['pretouch_s']:.2f} s (P) and "
            f"{hello_d['pretouch_s']:.2f} s (D); P's two global descriptor lists "
            f"(`prep_xfer_dlist`, {g.descriptors:,} entries each) {prepared['prep_dlists_s']:.3f} s"
        )
        self._measure_planning(hello_p["base"], hello_d["base"])

        rounds = self.config.repeats + 1
        steps = rounds * len(LAYOUTS) * len(PATHS)
        step = 0
        for round_ in range(rounds):
            warm_up = round_ == 0
            # Rotating the order spreads slow drifts of a shared machine over every path.
            paths = PATHS[round_ % len(PATHS) :] + PATHS[: round_ % len(PATHS)]
            for layout in LAYOUTS:
                for path in paths:
                    step += 1
                    if path == "kvpush":
                        sample = self._kvpush(p, d, hello_p["address"], layout)
                    else:
                        sample = self._nixl(p, d, layout, path)  # type: ignore[arg-type]
                    suffix = " (warm-up, discarded)" if warm_up else ""
                    self.progress(
                        f"[{step}/{steps}] {layout} {LABELS[path]}: {sample.total_s:.3f} s{suffix}"
                    )
                    if not warm_up:
                        self.result.samples.setdefault((layout, path), []).append(sample)

    def _measure_planning(self, p_base: int, d_base: int) -> None:
        """kvpush's planner alone on the same layouts: the part of kvpush's control time that
        comes before NIXL's post (which, under cma, also does the copy)."""
        g = self.geometry
        planner = lab.Planner(g.layout(p_base), g.layout(d_base))
        tokens = g.num_blocks * g.block_tokens
        for layout, (p_blocks, d_blocks) in self.orders.items():
            times = []
            for _ in range(max(5, self.config.repeats)):
                started = time.perf_counter()
                planner.plan("cmpl-bench-plan-0", tokens, [p_blocks], [d_blocks])
                times.append(time.perf_counter() - started)
            self.result.planning[layout] = times

    def _next(self) -> int:
        self.sequence += 1
        return self.sequence

    def _check(self, received: dict[str, Any], what: str) -> None:
        wrong = int(received["wrong_blocks"])
        if wrong:
            raise BenchError(
                f"{what}: {wrong} of {self.geometry.descriptors} of D's blocks do not hold the "
                "KV of P's matching block after the transfer reported success"
            )

    def _kvpush(self, p: RemoteWorker, d: RemoteWorker, source: str, layout: str) -> Sample:
        p_blocks, d_blocks = self.orders[layout]
        sequence = self._next()
        request_id = f"cmpl-bench{sequence}-0"
        transfer_id = f"bench-{layout}-{sequence}"
        what = f"kvpush transfer {transfer_id}"
        timeout = self.config.transfer_timeout_s
        p.call(
            "kvpush_ready",
            self.wait,
            what,
            request_id=request_id,
            transfer_id=transfer_id,
            blocks=p_blocks,
            sequence=sequence,
        )
        received = d.call(
            "kvpush_receive",
            self.wait,
            what,
            request_id=request_id,
            transfer_id=transfer_id,
            source=source,
            d_blocks=d_blocks,
            p_blocks=p_blocks,
            sequence=sequence,
            timeout=timeout,
        )
        sent = p.call("kvpush_sent", self.wait, what, request_id=request_id, timeout=timeout)
        self._check(received, what)
        timeline = sent["timeline"]
        return Sample(
            bytes=int(sent["bytes"]),
            descriptors=int(sent["runs"]),
            plan_s=None,
            control_s=timeline["posted"] - timeline["matched"],
            total_s=timeline["completed"] - timeline["matched"],
            d_view_s=float(received["d_view_s"]),
        )

    def _nixl(self, p: RemoteWorker, d: RemoteWorker, layout: str, method: Method) -> Sample:
        p_blocks, d_blocks = self.orders[layout]
        sequence = self._next()
        tag = f"bench-{layout}-{method}-{sequence}"
        what = f"NIXL ({method}) transfer {tag}"
        timeout = self.config.transfer_timeout_s
        # P waits for D's go while D sends it: both progress their agents as they wait.
        p.post(
            "nixl_send", tag=tag, method=method, blocks=p_blocks, sequence=sequence, timeout=timeout
        )
        received = d.call(
            "nixl_receive",
            self.wait,
            what,
            tag=tag,
            d_blocks=d_blocks,
            p_blocks=p_blocks,
            sequence=sequence,
            timeout=timeout,
        )
        sent = p.reply(self.wait, what)
        self._check(received, what)
        return Sample(
            bytes=int(sent["bytes"]),
            descriptors=int(sent["descriptors"]),
            plan_s=float(sent["plan_s"]),
            control_s=float(sent["control_s"]),
            total_s=float(sent["total_s"]),
            d_view_s=float(received["d_view_s"]),
        )


def run(config: BenchConfig, progress: Callable[[str], None] = print) -> BenchResult:
    """Runs the benchmark; raises :class:`BenchError` if it cannot run or a transfer fails
    (:class:`~kvpush_lab.peer.PeerError` if a worker does)."""
    return TransferBench(config, progress).run()


# ---- report ---------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 10:
        return f"{ms:.1f}"
    if ms >= 1:
        return f"{ms:.2f}"
    return f"{ms:.3f}"


def _best_median(values: Sequence[float]) -> str:
    return f"{_ms(min(values))} / {_ms(statistics.median(values))}"


def _count(values: Sequence[int]) -> str:
    low, high = min(values), max(values)
    return f"{low:,}" if low == high else f"{low:,}-{high:,}"


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _row(label: str, samples: list[Sample], planning: list[float] | None) -> str:
    nbytes = samples[0].bytes
    totals = [s.total_s for s in samples]
    plans = [s.plan_s for s in samples if s.plan_s is not None]
    plan = f"{_best_median(planning)} ¹" if planning is not None else _best_median(plans)
    gbps = f"{_gbps(nbytes, min(totals)):.2f} / {_gbps(nbytes, statistics.median(totals)):.2f}"
    cells = [
        label,
        f"{nbytes:,}",
        _count([s.descriptors for s in samples]),
        plan,
        _best_median([s.control_s for s in samples]),
        _best_median(totals),
        gbps,
        _best_median([s.d_view_s for s in samples]),
    ]
    return "| " + " | ".join(cells) + " |"


def _median(samples: list[Sample], attribute: str) -> float:
    return statistics.median(float(getattr(s, attribute)) for s in samples)


def ratios(result: BenchResult, layout: str, baseline: str) -> dict[str, float]:
    """kvpush over ``baseline`` on medians: throughput (above 1: kvpush faster), control time
    and D's view (below 1: kvpush cheaper)."""
    ours = result.samples[(layout, "kvpush")]
    theirs = result.samples[(layout, baseline)]
    return {
        "throughput": _median(theirs, "total_s") / _median(ours, "total_s"),
        "control": _median(ours, "control_s") / _median(theirs, "control_s"),
        "d_view": _median(ours, "d_view_s") / _median(theirs, "d_view_s"),
    }


def report(result: BenchResult) -> str:
    """The tables (markdown) and ratio lines of one run."""
    g = result.geometry
    c = result.config
    lines = [
        f"One request of {g.bytes:,} B: {g.layers} layers x K/V x {g.num_blocks:,} blocks of "
        f"{g.block_bytes // 1024} KiB ({g.descriptors:,} blocks), P to D in two processes; "
        f"UCX: {c.ucx_tls}. Each cell: best / median of {c.repeats} "
        f"repeat{'s' if c.repeats > 1 else ''} (after a warm-up).",
        "",
    ]
    headers = [
        "path",
        "bytes",
        "descriptors",
        "plan ms",
        "control ms",
        "total ms",
        "GB/s",
        "D: ask→KV ms",
    ]
    orders = {
        "contiguous": "D's blocks in P's order",
        "fragmented": "D's blocks a random permutation: no two neighbours merge",
    }
    for layout in LAYOUTS:
        lines += [f"**{layout}** ({orders[layout]})", ""]
        lines += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        for path in PATHS:
            planning = result.planning[layout] if path == "kvpush" else None
            lines.append(_row(LABELS[path], result.samples[(layout, path)], planning))
        lines.append("")
        for baseline in ("prepped", "initialize"):
            r = ratios(result, layout, baseline)
            lines.append(
                f"- ratio kvpush / {LABELS[baseline]}, {layout}: throughput "
                f"**{r['throughput']:.2f}x**, control time **{r['control']:.2f}x**, "
                f"D's view {r['d_view']:.2f}x"
            )
        lines.append("")
    lines.append(
        "¹ kvpush's planner alone (`Planner.plan` on the same layouts, in the coordinating "
        "process); its writer builds NIXL's descriptor list inside the post, which the control "
        "column includes. Ratios are of medians: throughput above 1 and times below 1 favour "
        "kvpush."
    )
    return "\n".join(lines)


# ---- docs/benchmarks.md ---------------------------------------------------------------------

INTRO = """\
`kvpush bench transfer` (`lab/kvpush_lab/bench/transfer.py`) pushes one request's whole KV cache
from P to D, two spawned processes on one machine, over NIXL's UCX backend on loopback, and in
the same run writes the same bytes with a plain NIXL WRITE driven from Python, the way vLLM's
connector drives NIXL. Both processes hold their cache once (numpy, written page by page before
anything is timed); all three paths use the same memory, sizes and block orders.

* **kvpush**: P calls `Endpoint.ready`, then D calls `Endpoint.expect`; P's native writer plans
  the runs (merging what is contiguous on both sides), builds one NIXL descriptor per run, posts
  one WRITE with the DONE notification and polls it every 200 µs.
* **plain NIXL, prepped (Python)**: one `nixl_agent` per side over the same buffer. P prepares a
  descriptor list of every block of every region, for itself and for D, once (`prep_xfer_dlist`,
  not timed). Per request, D sends a notification carrying its block ids; P computes the indices,
  calls `make_prepped_xfer` (NIXL merges consecutive indices) and `transfer`, and polls
  `check_xfer_state` to DONE; D waits for the completion notification.
* **plain NIXL, initialize_xfer (Python)**: the same, with per-request descriptor lists
  (`get_xfer_descs` + `initialize_xfer`, no merging by NIXL): the call kvpush's writer makes.

The Python agents run with `enable_prog_thread=False` and poll every 200 µs, kvpush's writer
cadence: NIXL's Python API hard-wires the progress thread's poll delay to 0, so that thread spins
a whole core, which on a small machine slows both paths and measures the scheduler instead.

Columns: **descriptors**: kvpush's runs after merging; for NIXL, the descriptors NIXL posted
(`descCount` telemetry). **plan**: block ids to descriptors before the post (kvpush: its planner
alone, see ¹). **control**: P's per-request work up to the post's return: kvpush's
`matched`→`posted` on P's event timeline; NIXL's go-received→`transfer()` returned. With UCX's
cma transport the copy itself runs inside the post, so there control is nearly the whole
transfer; under `UCX_TLS=tcp` the post returns early. **total**: the same start to the WRITE
seen DONE by the polling initiator; **GB/s** = bytes / total (10⁹ B/s). **D: ask→KV**: on D,
from `expect()` (kvpush) or sending the go (NIXL) to holding the completion notification. After
each transfer D checks a per-repeat stamp in every block it named. Paths alternate within each
round, and a warm-up round is discarded.
"""


def _subsection_heading(tls: str) -> str:
    return f"### UCX transports: {tls}"


def machine_notes(result: BenchResult) -> str:
    model = cpu_model()
    versions = []
    for dist in ("nixl-cu12", "nixl-cu13"):
        try:
            versions.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return (
        f"{os.cpu_count()} cores ({model}), Linux {platform.release()}, Python "
        f"{platform.python_version()}, kvpush {kvpush.__version__}, {', '.join(versions)}. "
        f"The machine is shared (load average {result.notes['load_before']} before, "
        f"{result.notes['load_after']} after): absolute numbers are noisy; the ratios are what "
        "matters."
    )


def subsection(result: BenchResult, markdown: str | None) -> str:
    c = result.config
    return "\n".join(
        [
            _subsection_heading(c.ucx_tls),
            "",
            f"Measured {result.started:%Y-%m-%d %H:%M %Z} in {result.elapsed_s:.0f} s with:",
            "",
            "```bash",
            c.command(markdown),
            "```",
            "",
            f"Transports: {UCX_TRANSPORTS[c.ucx_tls]}. Machine: {machine_notes(result)}",
            f"Not timed: {result.notes['setup']}.",
            "",
            report(result),
            "",
        ]
    )


def update_markdown(path: Path, result: BenchResult, markdown: str | None = None) -> None:
    """Writes this run into the "Data path" section of ``path``: the section's introduction is
    rewritten, this UCX setting's subsection replaced, other subsections and sections kept."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == SECTION), None)
    if start is None:
        before, after, body = lines, [], []
    else:
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
        before, body, after = lines[:start], lines[start + 1 : end], lines[end:]
    subsections: dict[str, list[str]] = {}
    heading = None
    for line in body:
        if line.startswith("### "):
            heading = line.strip()
            subsections[heading] = []
        if heading is not None:
            subsections[heading].append(line)
    subsections[_subsection_heading(result.config.ucx_tls)] = subsection(
        result, markdown
    ).splitlines()
    ordered = [_subsection_heading(t) for t in UCX_TRANSPORTS]
    ordered += [h for h in subsections if h not in ordered]
    section = [SECTION, "", *INTRO.splitlines(), ""]
    for h in ordered:
        if h in subsections:
            section += [*_strip_blank(subsections[h]), ""]
    head = _strip_blank(before)
    out = [*head, "", *section] if head else section
    if after:
        out += after
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(_strip_blank(out)) + "\n")


def _strip_blank(lines: list[str]) -> list[str]:
    start, end = 0, len(lines)
    while start < end and not lines[start].strip():
        start += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    return lines[start:end]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvpush bench transfer``'s options."""
    parser.add_argument(
        "--gib", type=float, default=1.0, help="KV bytes per request, in GiB (default 1.0)"
    )
    parser.add_argument(
        "--block-kib", type=int, default=16, help="bytes per block and region, in KiB (default 16)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="measured repeats per path (default 3)"
    )
    parser.add_argument(
        "--ucx-tls",
        choices=list(UCX_TRANSPORTS),
        default="default",
        help="UCX transports: UCX's default (cma on one host) or UCX_TLS=tcp (default: default)",
    )
    parser.add_argument(
        "--markdown", metavar="PATH", help="also write the results into PATH's Data path section"
    )


def main(args: argparse.Namespace) -> int:
    """Runs one transfer benchmark, prints its report and, with ``--markdown``, writes it."""
    config = BenchConfig(
        gib=args.gib, block_kib=args.block_kib, repeats=args.repeats, ucx_tls=args.ucx_tls
    )
    try:
        result = run(config, progress=lambda line: print(line, flush=True))
    except (BenchError, PeerError) as error:
        print(f"kvpush bench transfer: {error}", file=sys.stderr)
        return 1
    print()
    print(report(result))
    if args.markdown:
        update_markdown(Path(args.markdown), result, args.markdown)
        print(f"\nwrote the Data path section of {args.markdown}")
    return 0
