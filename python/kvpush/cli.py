"""The ``kvpush`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import kvpush


def _demo(args: argparse.Namespace) -> int:
    from kvpush.demo import run_demo

    ok = run_demo(
        requests=args.requests, layers=args.layers, seed=args.seed, secret=not args.no_secret
    )
    return 0 if ok else 1


def _version(_args: argparse.Namespace) -> int:
    print(f"kvpush {kvpush.__version__} (protocol kvpush/{kvpush.PROTOCOL_VERSION})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpush", description="Push-based KV-cache transfer for disaggregated vLLM serving."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo",
        help="walk the core through request lifecycles and verify every byte",
        description=(
            "Drives the rendezvous table, the planner and the kvpush/1 codec through request "
            "lifecycles in one process: P and D halves arrive in random order, registrations "
            "travel as signed frames, plans are applied by an in-process memcpy (the NIXL data "
            "path is not used here) and D's memory is checked byte for byte."
        ),
    )
    demo.add_argument("--requests", type=int, default=24, help="requests to run (default 24)")
    demo.add_argument("--layers", type=int, default=8, help="model layers (default 8)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.add_argument("--no-secret", action="store_true", help="send unsigned control messages")
    demo.set_defaults(run=_demo)

    version = commands.add_parser("version", help="print the kvpush and protocol versions")
    version.set_defaults(run=_version)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
