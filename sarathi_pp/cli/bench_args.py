"""The serving flags ``sarathi-pp bench`` and ``sarathi-pp simulate`` share: the workload,
the schedulers, the capacity search; and the ``BenchOptions`` and ``Workload`` they make."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sarathi_pp.bench.peers import PEERS, parse_peers

RUN_DIRS_HELP = (
    "required: DIR/<scheduler>/ gets each run's records (what sarathi-pp report reads), "
    "DIR/ the comparison (comparison.json, CDF plots)"
)


def add_bench_args(p: argparse.ArgumentParser, peer: bool = True) -> None:
    g = p.add_argument_group("benchmark")
    g.add_argument("--workload", required=True, metavar="FILE", help="workload YAML")
    g.add_argument(
        "--schedulers",
        metavar="A,B,...",
        help="scheduler policies to compare, in order (default: the config's policy); the "
        "first is compared against each other one",
    )
    if peer:
        g.add_argument(
            "--peer",
            metavar="NAME[,NAME]",
            help=f"also serve the workload with a peer engine ({', '.join(PEERS)}: "
            "transformers' continuous batching, vLLM from its own venv: make peer-vllm), "
            "one or several, comma-separated",
        )
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
        peers=parse_peers(args.peer) if getattr(args, "peer", None) else (),
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
