"""``kvpush bench`` with no subcommand: every benchmark, one after the other, each writing its
sections of the benchmarks document (``docs/benchmarks.md``) and its plots (``docs/img/``).

The steps, in order (cheap and self-contained first, the vLLM servers last):

* ``core``: the Rust core's criterion benches (planner; rendezvous table vs ``Mutex<HashMap>``);
* ``control``: P's per-request control path and matching under load, kvpush vs vLLM's code;
* ``engine``: the connectors' time per engine step on vLLM's real scheduler, 1 to 512 in flight;
* ``layers``: P's engine-thread time per forward handing layers to the writer (layer-wise push);
* ``gil``: the endpoint calls an engine step makes, with another Python thread busy (they keep
  the GIL), beside a call as short that gives it up;
* ``idle``: an idle, warm P+D pair's CPU, kvpush endpoints vs NIXL agents;
* ``scale``: one P under 1, 256 and 1,024 D peers (threads, fds, memory, idle CPU, match
  latency) and P restarting under all of them;
* ``transfer``: the data path against plain NIXL WRITEs, UCX's default transports and tcp;
* ``serving``: kvpush vs vLLM's NixlPushConnector and NixlConnector on real vLLM pairs;
* ``engine-servers``: the connectors' time per engine step on real vLLM pairs, every hook timed
  in the servers' processes;
* ``client``: vLLM's own benchmark client (``vllm bench serve``) against every pair behind
  ``kvpush proxy``, upstream as shipped and at its best, and the aggregated floors.

A step that fails is reported and the others still run; the exit status says whether all ran.
They need vLLM and NIXL's Python API (``scripts/dev bench`` runs them in ``.venv-vllm``), and
``core`` a source checkout with cargo. Sections not written by a step (the profiling records at
the end of the document) are history: before/after figures of changes, kept as written.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from kvpush_lab.bench import report

STEPS = (
    "core",
    "control",
    "engine",
    "layers",
    "gil",
    "idle",
    "scale",
    "transfer",
    "serving",
    "engine-servers",
    "client",
)


def _core(doc: Path, quick: bool) -> int:
    from kvpush_lab.bench import core

    return core.main(argparse.Namespace(quick=quick, markdown=str(doc)))


def _control(doc: Path, quick: bool) -> int:
    from kvpush_lab.bench import control

    return control.main(argparse.Namespace(quick=quick, markdown=str(doc), img_dir=None))


def _engine(doc: Path, quick: bool) -> int:
    from kvpush_lab.bench import engine

    parser = argparse.ArgumentParser()
    engine.add_arguments(parser)
    return engine.main(parser.parse_args(["--markdown", str(doc), *(["--quick"] if quick else [])]))


def _gil(doc: Path, quick: bool) -> int:
    from kvpush_lab.bench import gil

    parser = argparse.ArgumentParser()
    gil.add_arguments(parser)
    return gil.main(parser.parse_args(["--markdown", str(doc), *(["--quick"] if quick else [])]))


def _layers(doc: Path, quick: bool) -> int:
    from kvpush_lab.bench import layers

    parser = argparse.ArgumentParser()
    layers.add_arguments(parser)
    return layers.main(parser.parse_args(["--markdown", str(doc), *(["--quick"] if quick else [])]))


def _idle(doc: Path, quick: bool) -> int:
    from kvpush_lab.bench import idle

    return idle.main(argparse.Namespace(seconds=2.0 if quick else 10.0, markdown=str(doc)))


def _scale(doc: Path, quick: bool) -> int:
    from kvpush_lab.bench import scale

    parser = argparse.ArgumentParser()
    scale.add_arguments(parser)
    argv = ["--markdown", str(doc), *(["--peers", "1,32", "--idle-seconds", "1"] if quick else [])]
    return scale.main(parser.parse_args(argv))


def _transfer(doc: Path, quick: bool) -> int:
    from kvpush_lab.bench import transfer

    sizes = {"gib": 0.05, "repeats": 1} if quick else {"gib": 1.0, "repeats": 3}
    codes = [
        transfer.main(argparse.Namespace(block_kib=16, ucx_tls=tls, markdown=str(doc), **sizes))
        for tls in transfer.UCX_TRANSPORTS
    ]
    return max(codes)


def _serving(doc: Path, quick: bool) -> int:
    from kvpush_lab.bench import serving

    parser = argparse.ArgumentParser()
    serving.add_arguments(parser)
    argv = ["--markdown", str(doc), *(["--quick"] if quick else [])]
    return serving.main(parser.parse_args(argv))


def _engine_servers(doc: Path, quick: bool) -> int:
    from kvpush_lab.bench import engine

    parser = argparse.ArgumentParser()
    engine.add_arguments(parser)
    argv = ["--servers", "--markdown", str(doc), *(["--quick"] if quick else [])]
    return engine.main(parser.parse_args(argv))


def _client(doc: Path, quick: bool) -> int:
    from kvpush_lab.bench import client

    parser = argparse.ArgumentParser()
    client.add_arguments(parser)
    return client.main(parser.parse_args(["--markdown", str(doc), *(["--quick"] if quick else [])]))


RUNNERS: dict[str, Callable[[Path, bool], int]] = {
    "core": _core,
    "control": _control,
    "engine": _engine,
    "layers": _layers,
    "gil": _gil,
    "idle": _idle,
    "scale": _scale,
    "transfer": _transfer,
    "serving": _serving,
    "engine-servers": _engine_servers,
    "client": _client,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--doc",
        default="docs/benchmarks.md",
        metavar="PATH",
        help="the benchmarks document to write (default docs/benchmarks.md; plots in its img/)",
    )
    parser.add_argument(
        "--only",
        default=",".join(STEPS),
        help=f"comma-separated steps to run, in the suite's order (default {','.join(STEPS)})",
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes everywhere: checks the suite runs"
    )


def main(args: argparse.Namespace) -> int:
    wanted = [step.strip() for step in args.only.split(",") if step.strip()]
    unknown = [step for step in wanted if step not in RUNNERS]
    if unknown:
        print(f"kvpush bench: unknown step(s) {', '.join(unknown)}; steps: {', '.join(STEPS)}")
        return 2
    doc = Path(args.doc)
    summary = report.Table(["step", "result", "wall"])
    failed = False
    for step in (s for s in STEPS if s in wanted):
        print(f"\n==== kvpush bench {step} ====", flush=True)
        started = time.monotonic()
        try:
            code = RUNNERS[step](doc, args.quick)
        except Exception as error:  # one step's crash must not hide the others' results
            print(f"kvpush bench {step}: {type(error).__name__}: {error}")
            code = 1
        failed |= code != 0
        outcome = "ok" if code == 0 else f"failed (exit {code})"
        summary.add(step, outcome, f"{time.monotonic() - started:.0f} s")
    print(f"\n==== kvpush bench: sections written to {doc} ====")
    print(summary.text())
    return 1 if failed else 0
