"""``kvpush demo``, ``kvpush bench`` and ``kvpush model``: the lab's commands.

The product's CLI (:mod:`kvpush.cli`) finds them through the ``kvpush.commands`` entry points
the lab declares (lab/pyproject.toml: :data:`DEMO`, :data:`BENCH`, :data:`MODEL`) and hands
each its arguments untouched; ``kvpush-lab`` and ``python -m kvpush_lab.cli`` run them too.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


def _demo(args: argparse.Namespace) -> int:
    if args.core:
        from kvpush_lab.demo import run_demo

        ok = run_demo(
            requests=args.requests or 24,
            layers=args.layers,
            seed=args.seed,
            secret=not args.no_secret,
        )
        return 0 if ok else 1

    from kvpush_lab import demo_vllm

    return demo_vllm.run(
        demo_vllm.DemoOptions(
            requests=args.requests or 8,
            lengths=tuple(args.lengths),
            max_tokens=args.max_tokens,
            keep_running=args.keep_running,
            run_dir=Path(args.run_dir) if args.run_dir else None,
            model_dir=Path(args.model_dir) if args.model_dir else None,
            seed=args.seed,
        )
    )


def _model(args: argparse.Namespace) -> int:
    from kvpush_lab.model import main as make_model

    return make_model(args.options)


def add_demo(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = commands.add_parser(
        "demo",
        help="a vLLM prefill/decode pair on localhost with kvpush: TTFT and per-request timelines",
        description=(
            "Makes a tiny random-weight model (nothing is downloaded), starts a vLLM prefill "
            "server and a decode server with kvpush's connector and kvpush's proxy, streams "
            "completions through the proxy and prints TTFT, each request's transfer timeline "
            "and where D's KV came from. Needs the vLLM CPU stack (scripts/setup-vllm); "
            "`scripts/dev demo` sets everything up. With --core: the core alone, in one "
            "process (rendezvous table, planner, kvpush/1 codec, an in-process memcpy standing "
            "in for NIXL), D's memory checked byte for byte."
        ),
    )
    demo.add_argument(
        "--core", action="store_true", help="the in-process core walkthrough instead (no vLLM)"
    )
    demo.add_argument("--requests", type=int, help="requests to send (default 8; with --core 24)")
    demo.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[256, 1024, 2048],
        metavar="N",
        help="prompt lengths in tokens, used in turn (default 256 1024 2048)",
    )
    demo.add_argument(
        "--max-tokens", type=int, default=16, help="tokens to generate per request (default 16)"
    )
    demo.add_argument(
        "--keep-running",
        action="store_true",
        help="leave the servers and the proxy up after the report, until Ctrl-C",
    )
    demo.add_argument(
        "--run-dir", help="where logs and timelines go (default ~/.cache/kvpush/runs/<time>)"
    )
    demo.add_argument(
        "--model-dir",
        help="where the tiny model is made or reused (default ~/.cache/kvpush/tiny-qwen3)",
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.add_argument("--layers", type=int, default=8, help="--core: model layers (default 8)")
    demo.add_argument(
        "--no-secret", action="store_true", help="--core: send unsigned control messages"
    )
    demo.set_defaults(run=_demo)


def add_bench(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvpush_lab.bench import (
        client,
        control,
        core,
        engine,
        gil,
        idle,
        layers,
        scale,
        serving,
        suite,
        transfer,
    )

    bench = commands.add_parser(
        "bench",
        help="benchmarks (print tables and ratios; assert nothing); alone: all of them",
        description=suite.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    suite.add_arguments(bench)
    bench.set_defaults(run=suite.main)
    benches = bench.add_subparsers(dest="bench", required=False, metavar="BENCH")
    for name, module, summary in (
        ("transfer", transfer, "kvpush's data path against a plain NIXL WRITE driven from Python"),
        ("core", core, "the Rust core's criterion benches: planner, table vs Mutex<HashMap>"),
        ("idle", idle, "CPU an idle, warm P+D pair burns: kvpush endpoints vs NIXL agents"),
        ("scale", scale, "one P under 1-1,024 D peers, and P restarting under all of them"),
        ("control", control, "P's per-request control path and matching: kvpush vs vLLM's code"),
        ("engine", engine, "connector time per engine step on vLLM's scheduler, 1-512 in flight"),
        ("layers", layers, "P's engine-thread time per forward handing layers to the writer"),
        ("gil", gil, "the engine step's endpoint calls keep the GIL: timed with a thread busy"),
        ("serving", serving, "kvpush vs vLLM's NixlPushConnector and NixlConnector, real servers"),
        ("client", client, "vllm bench serve: P/D pairs behind kvpush proxy, aggregated floors"),
    ):
        command = benches.add_parser(
            name,
            help=summary,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(command)
        command.set_defaults(run=module.main)


def add_model(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    model = commands.add_parser(
        "model",
        help="make a tiny random-weight model locally: kvpush model make PATH [--layers N ...]",
        description="Model tools (need transformers and tokenizers, as vLLM installs them).",
    )
    model.add_argument("action", choices=["make"])
    model.add_argument("options", nargs=argparse.REMAINDER, help="PATH and options (see --help)")
    model.set_defaults(run=_model)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpush", description="kvpush's lab: demos, benchmarks and model tools."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add_demo(commands)
    add_bench(commands)
    add_model(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.run(args)
    return code


@dataclass(frozen=True)
class Command:
    """One of the lab's commands as ``kvpush`` lists it (``help``) and runs it (``main``)."""

    name: str
    help: str

    def main(self, argv: Sequence[str]) -> int:
        """Runs ``kvpush NAME ARGV...``: ``argv`` are the arguments after the command's name."""
        return main([self.name, *argv])


DEMO = Command(
    "demo", "a vLLM prefill/decode pair on localhost with kvpush (--core: the core alone)"
)
BENCH = Command("bench", "benchmarks against the baselines kvpush replaces (tables and ratios)")
MODEL = Command(
    "model", "make a tiny random-weight model locally: kvpush model make PATH [--layers N ...]"
)
#: The commands this module answers, each an entry point of ``kvpush.commands``.
COMMANDS = (DEMO, BENCH, MODEL)


if __name__ == "__main__":
    sys.exit(main())
