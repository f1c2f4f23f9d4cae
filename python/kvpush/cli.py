"""The ``kvpush`` command line.

Its own commands are ``proxy`` and ``version``. Other packages add commands through the
:data:`COMMANDS_GROUP` entry-point group: kvpush's lab (``kvpush_lab``, its own package, which
the product never imports) adds ``demo``, ``bench`` and ``model`` there, and each is handed its
arguments untouched when asked for.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Sequence
from typing import Protocol

import kvpush

#: The entry-point group of the commands other packages add to ``kvpush``. Each entry names an
#: object shaped like :class:`Command`, e.g. ``demo = "kvpush_lab.cli:DEMO"``.
COMMANDS_GROUP = "kvpush.commands"

#: The lab's commands, named only so that asking for one without the lab installed says where
#: it is (their help and their code come from the lab, through :data:`COMMANDS_GROUP`).
LAB_COMMANDS = ("demo", "bench", "model")

#: kvpush's own commands, which no added command replaces.
OWN_COMMANDS = ("proxy", "version")


class Command(Protocol):
    """A command added through :data:`COMMANDS_GROUP`."""

    @property
    def help(self) -> str:
        """Its line in ``kvpush --help``."""
        ...

    def main(self, argv: Sequence[str]) -> int:
        """Runs the command with the arguments after its name; the exit code."""
        ...


def _added_commands() -> dict[str, importlib.metadata.EntryPoint]:
    """The commands installed packages add, by name in name order (the metadata's order is
    the packager's); the first of a name wins, and none replaces one of kvpush's own."""
    added: dict[str, importlib.metadata.EntryPoint] = {}
    for entry in importlib.metadata.entry_points(group=COMMANDS_GROUP):
        if entry.name not in OWN_COMMANDS:
            added.setdefault(entry.name, entry)
    return dict(sorted(added.items()))


def _load(entry: importlib.metadata.EntryPoint) -> Command | None:
    """The entry's command; None when its package is gone though its metadata is not (as if it
    were not installed). Anything else it lacks raises: its own error says what."""
    try:
        command: Command = entry.load()
    except ModuleNotFoundError as error:
        package = entry.value.partition(":")[0].partition(".")[0]
        if error.name is None or error.name.partition(".")[0] != package:
            raise
        return None
    return command


def _not_installed(name: str) -> int:
    print(
        f"kvpush {name}: this command is part of kvpush's lab (demos, benchmarks, model "
        "tools), which is not installed here. Install it with `pip install kvpush-lab` "
        "(from a source checkout: `pip install -e lab`), or run it from a source checkout "
        f"with `scripts/dev {name}`, which sets everything up.",
        file=sys.stderr,
    )
    return 2


def _proxy(args: argparse.Namespace) -> int:
    from kvpush.router import http

    return http.run(args)


def _version(_args: argparse.Namespace) -> int:
    print(f"kvpush {kvpush.__version__} (protocol kvpush/{kvpush.PROTOCOL_VERSION})")
    try:
        path = kvpush.nixl.library_path()
    except kvpush.exceptions.NixlUnavailableError as error:
        print(f"NIXL: not found ({error})")
    else:
        print(f"NIXL {kvpush.nixl.library_version(path) or '(version unknown)'}: {path}")
    return 0


def build_parser(added: dict[str, Command] | None = None) -> argparse.ArgumentParser:
    """The parser of kvpush's own commands, with ``added`` (by default: every installed
    package's, see :data:`COMMANDS_GROUP`) listed first."""
    if added is None:
        loaded = {name: _load(entry) for name, entry in _added_commands().items()}
        added = {name: command for name, command in loaded.items() if command is not None}
    parser = argparse.ArgumentParser(
        prog="kvpush", description="Push-based KV-cache transfer for disaggregated vLLM serving."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    for name, command in added.items():
        # Help and arguments are the command's own: they pass through untouched (see main).
        added_command = commands.add_parser(name, help=command.help, add_help=False)
        added_command.add_argument("arguments", nargs=argparse.REMAINDER)

    from kvpush.router import http

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
    http.add_arguments(proxy_command)
    proxy_command.set_defaults(run=_proxy)

    version = commands.add_parser("version", help="print the kvpush and protocol versions")
    version.set_defaults(run=_version)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else list(argv)
    own = bool(arguments) and arguments[0] in OWN_COMMANDS
    if arguments and not own:
        entry = _added_commands().get(arguments[0])
        command = _load(entry) if entry is not None else None
        if command is not None:
            return command.main(arguments[1:])
        if arguments[0] in LAB_COMMANDS:
            return _not_installed(arguments[0])
    # kvpush's own commands load no other package's; --help and mistakes list them all.
    args = build_parser({} if own else None).parse_args(arguments)
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
