"""``sarathi-pp plan``: the decode batch bound B and the chunk size for a workload, with the
arithmetic shown (``sarathi_pp/planner.py`` has the formulas).

``plan_build.py`` assembles the plan from the config and the checkpoint's config.json only
(no weights are loaded); ``plan_render.py`` shows it. Prints a YAML snippet (a
``scheduler:`` section) ready to paste into a config, or writes it to ``--output``;
``--json`` prints one JSON object instead of the text.

Registered by ``sarathi_pp.launch.cli.build_parser`` through ``add_plan_parser``. Bad
input (a budget smaller than the parameters, zero output tokens, a profile CSV lacking
columns, ...) is a usage error (exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from sarathi_pp.launch.plan_build import make_plan
from sarathi_pp.launch.plan_render import batch_lines, chunk_lines, plan_record, snippet

DEFAULT_MAX_OVERHEAD = 0.2  # the profile's overhead threshold for the smallest chunk


def add_plan_parser(subparsers: Any) -> None:
    from sarathi_pp.launch.cli import add_engine_args  # cli imports this module

    p = subparsers.add_parser(
        "plan",
        help="plan max_num_seqs (B) and chunk_size for a workload",
        description="Compute the decode batch bound B = floor((M_G - M_S) / (L x m_kv)) of "
        "every stage and the chunk size C = P/D x ceil((B - 1) / n), clamped and rounded to "
        "the matmul tile; print the arithmetic and a YAML snippet for the config.",
    )
    add_engine_args(p)
    g = p.add_argument_group("workload (one of)")
    g.add_argument("--workload", metavar="FILE", help="workload YAML (configs/workloads/)")
    g.add_argument("--pd-ratio", type=float, metavar="X", help="mean prompt / output tokens")
    g.add_argument("--prompt-tokens", type=int, metavar="P", help="prompt tokens per request")
    g.add_argument("--output-tokens", type=int, metavar="D", help="output tokens per request")
    g = p.add_argument_group("machine profile")
    g.add_argument(
        "--profile",
        metavar="FILE",
        help="profile CSV of `sarathi-pp profile`: its smallest acceptable chunk replaces "
        "min_chunk_size and its tile (when found) tile_size",
    )
    g.add_argument(
        "--max-overhead",
        type=float,
        default=DEFAULT_MAX_OVERHEAD,
        metavar="F",
        help=f"overhead of chunked prefill the profile's chunk may cost (default {DEFAULT_MAX_OVERHEAD})",
    )
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print one JSON object instead")
    g.add_argument("--output", metavar="FILE", help="write the YAML snippet there")
    p.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    from sarathi_pp.launch.cli import config_from_args, user_errors

    with user_errors():
        config = config_from_args(args)
        if args.output is not None and not Path(args.output).parent.is_dir():
            raise FileNotFoundError(
                f"output folder {str(Path(args.output).parent)!r} does not exist"
            )
        plan = make_plan(config, args)
    text = snippet(plan)
    if args.json:
        print(json.dumps(plan_record(plan), indent=2))
    else:
        print("\n".join(batch_lines(plan) + chunk_lines(plan)))
        if args.output is None:
            print("YAML snippet for the config:")
            print(text, end="")
    if args.output is not None:
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"sarathi-pp: wrote the YAML snippet to {args.output}", file=sys.stderr)
    return 0
