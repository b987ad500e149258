"""Entry point for ``ray job submit --working-dir . -- python -m sarathi_pp.launch.ray_job
--config configs/tiny-llama-pp2.yaml [generate flags]``.

Inside a Ray job ``RAY_ADDRESS`` points at the cluster, so the Ray executor connects to it
instead of starting a local Ray; otherwise this is ``sarathi-pp generate``, flag for flag,
with the stages forced onto Ray actors.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from sarathi_pp.cli import build_parser, generate
from sarathi_pp.cli import main as cli_main
from sarathi_pp.cli.common import PROG

# ``ray job submit --working-dir D`` runs the job inside Ray's copy of D:
# <session>/runtime_resources/working_dir_files/_ray_pkg_<hash>/
RAY_WORKING_DIR_COPY = "working_dir_files"
RAY_JOB_PROG = "python -m sarathi_pp.launch.ray_job"


def usage() -> str:
    """``sarathi-pp generate``'s help under this entry point's name (its flags are
    generate's), and what differs: the stages always run as Ray actors."""
    subcommands = argparse.ArgumentParser().add_subparsers()
    generate.add_parser(subcommands)
    parser = subcommands.choices["generate"]
    parser.prog = RAY_JOB_PROG
    return (
        parser.format_help() + f"\n{RAY_JOB_PROG} is {PROG} generate with the stages on Ray actors "
        "(parallel.executor=ray), connected to RAY_ADDRESS inside a Ray job.\n"
    )


def check_written_paths(argv: list[str], cwd: Path) -> None:
    """``ValueError`` for a relative ``--output`` or ``--run-dir`` when the job runs in
    Ray's copy of the working dir: the files would land in that copy (not where the job was
    submitted from), and the next identical submit reuses it ('run dir is not empty')."""
    if RAY_WORKING_DIR_COPY not in cwd.parts:
        return
    args, _ = build_parser().parse_known_args(["generate", *argv])
    for flag, path in (("--output", args.output), ("--run-dir", args.run_dir)):
        if path is not None and path != "-" and not os.path.isabs(path):
            raise ValueError(
                f"{flag} {path!r} is relative, and this job runs in Ray's copy of its "
                f"working dir ({cwd}): give an absolute path on the node that runs the job"
                + (" (or --output - for the job's log)" if flag == "--output" else "")
            )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(usage(), end="")
        return 0
    try:
        check_written_paths(argv, Path.cwd())
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return cli_main(["generate", *argv, "--set", "parallel.executor=ray"])


if __name__ == "__main__":
    sys.exit(main())
