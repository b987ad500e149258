"""The ``sarathi-pp`` command line: one module per subcommand (``generate``, ``report``,
``bench``, ``plan``, ``profile``, ``serve``, ``simulate``), each with
``add_parser(subparsers)`` and ``run(args) -> int``; ``common`` has what they share
(``bench_args``: the serving flags of ``bench`` and ``simulate``). Subcommands import
those, never each other; this module imports the subcommands.

``main()`` stays thin: parse, run the subcommand; a usage error exits with status 2 (see
``common``).
"""

from __future__ import annotations

import argparse
import sys

from sarathi_pp.cli import bench, generate, plan, profile, report, serve, simulate
from sarathi_pp.cli.common import PROG, UsageError, sigterm_as_interrupt

SUBCOMMANDS = (generate, report, bench, plan, profile, serve, simulate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="SARATHI (chunked prefills + decode-maximal batching) LLM inference.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in SUBCOMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``sarathi-pp``; returns the exit status (see ``common``).

    Usage errors raise ``SystemExit(2)``, as argparse does for bad flags.
    """
    args = build_parser().parse_args(argv)
    sigterm_as_interrupt()
    try:
        return args.func(args)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    sys.exit(main())
