"""The ``oobleck`` command line: one sub-command per module, each with a ``register(subparsers)``.

A sub-command that runs another command (``oobleck join JOBID -- SCRIPT ARGS``) sets the default
``trailing=[]``: everything after the first ``--`` is its ``args.trailing``, wherever its options stand
(argparse alone would let a positional ``nargs="*"`` swallow nothing and then refuse what follows ``--``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Sub-command modules; each defines ``register(subparsers)`` that adds its parsers and sets ``func``.
_COMMAND_MODULES = (
    "lightning_oobleck.cli.consolidate",
    "lightning_oobleck.cli.join",
    "lightning_oobleck.cli.plan",
    "lightning_oobleck.cli.simulate",
    "lightning_oobleck.cli.submit",
    "lightning_oobleck.cli.timeline",
)


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="oobleck", description="Fault-tolerant pipeline training (Oobleck)."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    head, trailing = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = build_parser()
    args = parser.parse_args(head)
    if not hasattr(args, "trailing") and "--" in argv:
        parser.error(f"oobleck {args.command} takes no command after '--'")
    args.trailing = trailing
    try:
        return int(args.func(args) or 0)
    except (CliError, ValueError) as e:
        print(f"oobleck {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a missing or unreadable file: its name and the reason, in one line
        name = f": {e.filename}" if e.filename else ""
        print(f"oobleck {args.command}: error: {e.strerror or e}{name}", file=sys.stderr)
        return 2
