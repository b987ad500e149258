"""``sarathi-pp bench``: serve a workload through several schedulers (and a peer), side by side.

    sarathi-pp bench --config configs/tiny-llama-pp2.yaml --workload configs/workloads/mixed.yaml \\
        --schedulers sarathi,vllm,orca --run-dir runs/bench1
    sarathi-pp bench ... --capacity --slo-tbt-p99 0.5     # highest rate meeting the SLO
    sarathi-pp bench ... --peer hf                        # transformers' continuous batching
    sarathi-pp bench ... --peer hf,vllm                   # and vLLM (make peer-vllm)

Bad flags, configs, workloads and
run dirs are usage errors (exit 2) raised before any model loads.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sarathi_pp.cli.bench_args import (
    RUN_DIRS_HELP,
    add_bench_args,
    options_from_args,
    workload_from_args,
)
from sarathi_pp.cli.common import add_engine_args, config_from_args, progress_bar, user_errors


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="serving benchmark: schedulers (and a peer) on one workload",
        description="Serve a workload (arrivals, prompt and output lengths: "
        "configs/workloads/*.yaml) through each scheduler on the same live stages, one run "
        "dir each, and print throughput, TTFT, TBT, TPOT, end-to-end latency, scheduling "
        "delay and bubble fractions side by side.",
    )
    add_engine_args(p, run_dirs=RUN_DIRS_HELP)
    add_bench_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    with user_errors():
        # The bench's --run-dir holds one run dir per scheduler: not the engine's own.
        run_dir, overwrite = args.run_dir, args.overwrite
        args.run_dir = args.overwrite = None
        config = config_from_args(args)
        args.run_dir, args.overwrite = run_dir, overwrite
        options = options_from_args(args, config.scheduler.policy)
        workload = workload_from_args(args)
        from sarathi_pp.bench.suite import Bench

        print(f"workload: {workload.describe()}", file=sys.stderr)
        bench = Bench(config, workload, options, bar=progress_bar)
        bench.start()
    from sarathi_pp.bench.suite import PeerFailed

    try:
        comparison = bench.run()
    except PeerFailed as e:
        print(f"error: {e}", file=sys.stderr)
        print(f"the records so far are in {bench.dir}/ (comparison.json, one run dir per run)",
              file=sys.stderr)  # fmt: skip
        return 1
    print(bench.table(comparison))
    print(
        f"wrote {bench.dir}/ (comparison.json, tbt_cdf.png, ttft_cdf.png, one run dir per run)",
        file=sys.stderr,
    )
    return 0
