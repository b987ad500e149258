"""``sarathi-pp simulate``: the real engine loop and schedulers on a simulated cluster.

    sarathi-pp simulate --model configs/models/llama-13b --hardware configs/hardware/a6000.yaml \\
        --workload configs/workloads/mixed.yaml --schedulers sarathi,orca --run-dir runs/sim1
    sarathi-pp simulate --model configs/models/gpt3-175b --hardware a100-80gb --tp 8 --pp 8 ...
    sarathi-pp simulate --config configs/tiny-llama.yaml --profile runs/p/profile.csv ...
    sarathi-pp simulate ... --replicas 8 --routing round_robin      # R copies of the pipeline
    sarathi-pp simulate ... --capacity --slo-tbt-p99 0.2            # the bench's capacity search

Writes what ``sarathi-pp bench`` writes (a run dir per scheduler, ``comparison.json``,
the CDF plots) and prints the same table. Bad flags, hardware or model files are usage
errors (exit 2) raised before anything runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from sarathi_pp.cli.bench_args import (
    RUN_DIRS_HELP,
    add_bench_args,
    options_from_args,
    workload_from_args,
)
from sarathi_pp.cli.common import add_engine_args, config_from_args, user_errors
from sarathi_pp.routing import ROUTINGS


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="the engine and schedulers on a simulated cluster (analytic or profiled costs)",
        description="Serve a workload through each scheduler with the real engine loop, "
        "scheduler and block manager, the stages replaced by a cost model: analytic "
        "(--hardware: a roofline per operator on a GPU of configs/hardware/) or profiled "
        "(--profile: a sarathi-pp profile CSV of this machine). Writes the records of "
        "sarathi-pp bench, which sarathi-pp report reads.",
    )
    add_engine_args(p, run_dirs=RUN_DIRS_HELP)
    add_bench_args(p, peer=False)
    g = p.add_argument_group("simulated cluster")
    g.add_argument("--hardware", metavar="FILE|NAME", help="configs/hardware/NAME.yaml")
    g.add_argument("--profile", metavar="CSV", help="a sarathi-pp profile CSV (this machine)")
    g.add_argument("--tp", type=int, default=1, metavar="T", help="GPUs per stage (default 1)")
    g.add_argument(
        "--pp", type=int, metavar="P", help="pipeline stages (= --pipeline-parallel-size)"
    )
    g.add_argument("--replicas", type=int, default=1, metavar="R", help="copies of the pipeline")
    g.add_argument(
        "--routing",
        default="round_robin",
        choices=ROUTINGS,
        help="the runtime's router (sarathi_pp/routing.py): least_loaded = fewest pending tokens",
    )
    g.add_argument(
        "--pp-link", default="network", choices=("network", "nvlink"),
        help="what carries the pipeline sends (default network: a stage per node)",
    )  # fmt: skip
    g.add_argument("--driver-s", type=float, default=0.0, metavar="S",
                   help="the driver's own time per micro-batch (default 0: an ideal runtime)")  # fmt: skip
    g.add_argument("--dispatch-s", type=float, default=0.0, metavar="S",
                   help="driver -> stage 0 per micro-batch (default 0)")  # fmt: skip
    g.add_argument("--return-s", type=float, metavar="S",
                   help="last stage -> driver (default: the link's latency)")  # fmt: skip
    g.add_argument("--send-s", type=float, default=0.0, metavar="S",
                   help="added to every stage-to-stage send (default 0)")  # fmt: skip
    p.set_defaults(func=run)


def setup_from_args(args: argparse.Namespace) -> Any:
    from sarathi_pp.sim.executor import Overheads
    from sarathi_pp.sim.hardware import load_hardware
    from sarathi_pp.sim.setup import SimSetup

    return SimSetup(
        hardware=load_hardware(args.hardware) if args.hardware else None,
        profile=Path(args.profile) if args.profile else None,
        tp=args.tp,
        replicas=args.replicas,
        routing=args.routing,
        pp_link=args.pp_link,
        overheads=Overheads(args.driver_s, args.dispatch_s, args.return_s, args.send_s),
    )


def run(args: argparse.Namespace) -> int:
    with user_errors():
        if args.pp is not None:
            if args.pipeline_parallel_size not in (None, args.pp):
                raise ValueError("--pp and --pipeline-parallel-size disagree")
            args.pipeline_parallel_size = args.pp
        run_dir, overwrite = args.run_dir, args.overwrite  # one run dir per scheduler
        args.run_dir = args.overwrite = None
        config = config_from_args(args)
        args.run_dir, args.overwrite = run_dir, overwrite
        options = options_from_args(args, config.scheduler.policy)
        workload = workload_from_args(args)
        setup = setup_from_args(args)
        from sarathi_pp.sim.suite import SimBench

        print(f"workload: {workload.describe()}; {setup.describe()}", file=sys.stderr)
        bench = SimBench(config, workload, options, setup)
        bench.start()
    start = time.perf_counter()
    comparison = bench.run()
    print(bench.table(comparison))
    print(
        f"wrote {bench.dir}/ (comparison.json, tbt_cdf.png, ttft_cdf.png, one run dir per run) "
        f"in {time.perf_counter() - start:.1f} s",
        file=sys.stderr,
    )
    return 0
