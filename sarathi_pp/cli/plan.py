"""``sarathi-pp plan``: the decode batch bound B and the chunk size for a workload, with the
arithmetic shown (``sarathi_pp/planner/`` has the formulas).

``planner.recommend`` makes the plan from the config, the checkpoint's config.json (no
weights are loaded) and this machine's placement; ``planner.render`` shows it. Prints a
YAML snippet (a ``scheduler:`` section) ready to paste into a config, or writes it to
``--output``; ``--json`` prints one JSON object instead of the text. Bad input (a budget
smaller than the parameters, zero output tokens, a profile CSV lacking columns, ...) is a
usage error (exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from sarathi_pp.checkpoint import load_checkpoint
from sarathi_pp.cli.common import add_engine_args, config_from_args, user_errors
from sarathi_pp.cli.plan_simulate import add_simulate_args, run_simulated
from sarathi_pp.executors import builtin_resolver
from sarathi_pp.placement import resolve_placement, resolve_schedule_ahead
from sarathi_pp.planner.chunk import pd_ratio_of
from sarathi_pp.planner.recommend import WorkloadInfo, make_plan
from sarathi_pp.planner.render import batch_lines, chunk_lines, plan_record, snippet

DEFAULT_MAX_OVERHEAD = 0.2  # the profile's overhead threshold for the smallest chunk


def add_parser(subparsers: Any) -> None:
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
    add_simulate_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.simulate:
        return run_simulated(args)
    from sarathi_pp.stages.worker.device import probe_resources  # torch: once the flags are good

    with user_errors():
        if args.run_dir is not None or args.overwrite:
            flag = "--run-dir" if args.run_dir is not None else "--overwrite"
            raise ValueError(f"{flag}: plan writes no run dir (--simulate does: one per probe)")
        config = config_from_args(args)
        if args.output is not None and not Path(args.output).parent.is_dir():
            raise FileNotFoundError(
                f"output folder {str(Path(args.output).parent)!r} does not exist"
            )
        checkpoint = load_checkpoint(config.model, builtin_resolver())
        resources = probe_resources()
        placement = resolve_placement(config, checkpoint.spec, resources)
        ahead = resolve_schedule_ahead(config, placement, resources)
        workload = workload_info(args, checkpoint.spec.vocab_size, checkpoint.max_model_len)
        plan = make_plan(
            config, checkpoint, placement, workload, args.profile, args.max_overhead, ahead.on
        )
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


def workload_info(args: argparse.Namespace, vocab_size: int, max_model_len: int) -> WorkloadInfo:
    """The workload of exactly one of ``--workload``, ``--pd-ratio`` and
    ``--prompt-tokens``/``--output-tokens``."""
    given = [
        name
        for name, v in (
            ("--workload", args.workload),
            ("--pd-ratio", args.pd_ratio),
            ("--prompt-tokens/--output-tokens", (args.prompt_tokens, args.output_tokens)),
        )
        if v not in (None, (None, None))
    ]
    if len(given) != 1:
        raise ValueError(
            "give one of --workload FILE, --pd-ratio X or --prompt-tokens P --output-tokens D"
            + (f" (got {' and '.join(given)})" if given else "")
        )
    if args.workload is not None:
        from sarathi_pp.bench.workload import load_workload

        w = load_workload(args.workload)
        p, d = w.mean_prompt_tokens(), w.mean_output_tokens()
        pd_ratio_of(p, d)  # ValueError for zero output tokens, before sampling
        sampled = w.requests(vocab_size, max_model_len)  # ValueError if one won't fit
        reqs = [(len(r.prompt_token_ids), r.output_tokens) for r in sampled]
        return WorkloadInfo.from_workload_file(args.workload, p, d, reqs)
    if args.pd_ratio is not None:
        if not args.pd_ratio > 0:
            raise ValueError(f"--pd-ratio must be > 0, got {args.pd_ratio}")
        return WorkloadInfo.from_ratio(args.pd_ratio, f"--pd-ratio {args.pd_ratio}")
    if args.prompt_tokens is None or args.output_tokens is None:
        raise ValueError("--prompt-tokens and --output-tokens go together")
    return WorkloadInfo.from_lengths(args.prompt_tokens, args.output_tokens)
