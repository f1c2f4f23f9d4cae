"""The ``kvpush`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import kvpush

#: Commands of kvpush's lab (``kvpush_lab``, its own package): the product never imports it, and
#: hands these commands over to it, arguments and all, when it is installed.
LAB_COMMANDS = {
    "demo": "a vLLM prefill/decode pair on localhost with kvpush (--core: the core alone)",
    "bench": "benchmarks against the baselines kvpush replaces (tables and ratios)",
    "model": "make a tiny random-weight model locally: kvpush model make PATH [--layers N ...]",
}


def _lab(argv: Sequence[str]) -> int:
    """Runs ``argv`` (``demo ...``, ``bench ...``, ``model ...``) with the lab's CLI."""
    try:
        from kvpush_lab import cli as lab_cli
    except ModuleNotFoundError as error:
        if error.name != "kvpush_lab":
            raise  # the lab is there but something it needs is not: its own error says what
        print(
            f"kvpush {argv[0]}: this command is part of kvpush's lab (demos, benchmarks, model "
            "tools), which is not installed here. Install it with `pip install kvpush-lab` "
            "(from a source checkout: `pip install -e lab`), or run it from a source checkout "
            f"with `scripts/dev {argv[0]}`, which sets everything up.",
            file=sys.stderr,
        )
        return 2
    return lab_cli.main(argv)


def _proxy(args: argparse.Namespace) -> int:
    from kvpush import proxy

    return proxy.run(args)


def _version(_args: argparse.Namespace) -> int:
    print(f"kvpush {kvpush.__version__} (protocol kvpush/{kvpush.PROTOCOL_VERSION})")
    try:
        path = kvpush.nixl.library_path()
    except kvpush.exceptions.NixlUnavailableError as error:
        print(f"NIXL: not found ({error})")
    else:
        print(f"NIXL {kvpush.nixl.library_version(path) or '(version unknown)'}: {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpush", description="Push-based KV-cache transfer for disaggregated vLLM serving."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    for name, summary in LAB_COMMANDS.items():
        # Help and arguments are the lab's: they pass through untouched (see main).
        lab_command = commands.add_parser(name, help=summary, add_help=False)
        lab_command.add_argument("arguments", nargs=argparse.REMAINDER)

    from kvpush import proxy

    proxy_command = commands.add_parser(
        "proxy",
        help="OpenAI-compatible router: both legs of each request to P and D at once",
        description=(
            "Serves /v1/completions and /v1/chat/completions (streaming too), /v1/models and "
            "/health. Push mode: each request goes to a prefill server with max_tokens=1 and to "
            "a decode server with the prefill server's coordinates (configured, or learned from "
            "its first answer), concurrently, with one X-Request-Id and one transfer_id; pull "
            "mode: prefill first, then decode with its kv_transfer_params. D's answer is relayed "
            "to the client as it comes. Each leg goes to the healthy instance with the fewest "
            "legs in flight. Logs one line per request."
        ),
    )
    proxy.add_arguments(proxy_command)
    proxy_command.set_defaults(run=_proxy)

    version = commands.add_parser("version", help="print the kvpush and protocol versions")
    version.set_defaults(run=_version)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else list(argv)
    if arguments and arguments[0] in LAB_COMMANDS:
        return _lab(arguments)
    args = build_parser().parse_args(arguments)
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
