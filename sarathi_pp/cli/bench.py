"""``sarathi-pp bench``: serve a workload through several schedulers (and a peer), side by side.

    sarathi-pp bench --config configs/tiny-llama-pp2.yaml --workload configs/workloads/mixed.yaml \\
        --schedulers sarathi,vllm,orca --run-dir runs/bench1
    sarathi-pp bench ... --capacity --slo-tbt-p99 0.5     # highest rate meeting the SLO
    sarathi-pp bench ... --peer hf                        # transformers' continuous batching

Bad flags, configs, workloads and
run dirs are usage errors (exit 2) raised before any model loads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

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
    add_engine_args(p)
    g = p.add_argument_group("benchmark")
    g.add_argument("--workload", required=True, metavar="FILE", help="workload YAML")
    g.add_argument(
        "--schedulers",
        metavar="A,B,...",
        help="scheduler policies to compare, in order (default: the config's policy); the "
        "first is compared against each other one",
    )
    g.add_argument("--peer", choices=("hf",), help="also run transformers' generate_batch")
    g.add_argument("--rate", type=float, metavar="REQ/S", help="Poisson arrivals at this rate")
    g.add_argument("--num-requests", type=int, metavar="N", help="override the workload's count")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    g = p.add_argument_group("capacity search (--capacity)")
    g.add_argument(
        "--capacity",
        action="store_true",
        help="search the highest Poisson rate meeting the SLO, per scheduler",
    )
    g.add_argument("--slo-tbt-p99", type=float, metavar="S", help="SLO: P99 TBT in seconds")
    g.add_argument(
        "--slo-sched-delay-p50", type=float, metavar="S", help="SLO: P50 scheduling delay (s)"
    )
    g.add_argument("--start-rate", type=float, metavar="REQ/S", help="first probe's rate")
    g.add_argument("--max-probes", type=int, default=8, metavar="N", help="default: 8")
    g.add_argument(
        "--time-limit", type=float, metavar="S", help="stop probing after S seconds per scheduler"
    )
    p.set_defaults(func=run)


def parse_schedulers(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    if not names:
        raise ValueError(f"--schedulers: no scheduler in {text!r}")
    return names


def options_from_args(args: argparse.Namespace, default_policy: str) -> Any:
    from sarathi_pp.bench.capacity import Slo
    from sarathi_pp.bench.suite import BenchOptions

    if args.run_dir is None:
        raise ValueError("--run-dir is required: the benchmark writes one run dir per scheduler")
    slo = None
    if args.slo_tbt_p99 is not None:
        slo = Slo(args.slo_tbt_p99, args.slo_sched_delay_p50)
    elif args.slo_sched_delay_p50 is not None:
        raise ValueError("--slo-sched-delay-p50 needs --slo-tbt-p99 too")
    if slo is not None and not args.capacity:
        raise ValueError("an SLO is only used by the capacity search: add --capacity")
    return BenchOptions(
        schedulers=parse_schedulers(args.schedulers) if args.schedulers else (default_policy,),
        run_dir=Path(args.run_dir),
        peer=args.peer,
        overwrite=bool(args.overwrite),
        capacity=args.capacity,
        slo=slo,
        start_rate=args.start_rate,
        max_probes=args.max_probes,
        time_limit_s=args.time_limit,
        progress=args.progress,
    )


def workload_from_args(args: argparse.Namespace) -> Any:
    from sarathi_pp.bench.workload import load_workload

    w = load_workload(args.workload)
    if args.num_requests is not None:
        w = w.with_num_requests(args.num_requests)
    if args.rate is not None:
        w = w.with_rate(args.rate)
    return w


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
    comparison = bench.run()
    print(bench.table(comparison))
    print(
        f"wrote {bench.dir}/ (comparison.json, tbt_cdf.png, ttft_cdf.png, one run dir per run)",
        file=sys.stderr,
    )
    return 0
