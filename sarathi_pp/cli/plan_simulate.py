"""``sarathi-pp plan --simulate``: the flags and the run (``plan.py`` hands over when
``--simulate`` is given). The chunk size comes from simulations of the workload
(``sim/chunk_search.py``), on the analytic model (``--hardware``, ``--tp``) or this
machine's profile (``--profile``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from sarathi_pp.cli.common import config_from_args, user_errors


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulated planning (--simulate; needs --workload FILE)")
    g.add_argument(
        "--simulate", action="store_true",
        help="choose the chunk size maximizing simulated throughput under --slo-tbt-p99",
    )  # fmt: skip
    g.add_argument("--slo-tbt-p99", type=float, metavar="S", help="SLO: P99 TBT in seconds")
    g.add_argument("--hardware", metavar="FILE|NAME", help="analytic model on this GPU")
    g.add_argument("--tp", type=int, default=1, metavar="T", help="GPUs per stage (default 1)")
    g.add_argument(
        "--chunk-sizes", metavar="N,N,...",
        help="candidates (default 128,256,384,512,768,1024,1536,2048)",
    )  # fmt: skip


def run_simulated(args: argparse.Namespace) -> int:
    from sarathi_pp.bench.workload import load_workload
    from sarathi_pp.sim.chunk_search import DEFAULT_CHUNK_SIZES, search_chunk_size
    from sarathi_pp.sim.hardware import load_hardware
    from sarathi_pp.sim.setup import SimSetup

    with user_errors():
        if args.workload is None:
            raise ValueError("--simulate needs --workload FILE (arrivals and lengths)")
        if args.slo_tbt_p99 is None:
            raise ValueError("--simulate needs --slo-tbt-p99 SECONDS")
        config = config_from_args(args)
        sizes = DEFAULT_CHUNK_SIZES
        if args.chunk_sizes:
            try:
                sizes = tuple(int(x) for x in args.chunk_sizes.split(",") if x.strip())
            except ValueError:
                raise ValueError(f"--chunk-sizes: not integers: {args.chunk_sizes!r}") from None
        setup = SimSetup(
            hardware=load_hardware(args.hardware) if args.hardware else None,
            profile=Path(args.profile) if args.profile and not args.hardware else None,
            tp=args.tp,
        )
        workload = load_workload(args.workload)
    print(f"simulating {workload.describe()} on {setup.describe()}", file=sys.stderr)
    run_dir = Path(args.run_dir) if args.run_dir else None
    result = search_chunk_size(config, workload, setup, args.slo_tbt_p99, sizes, run_dir)
    for line in result.lines():
        print(line)
    best: Any = result.best
    if best is not None:
        print(f"scheduler:\n  policy: sarathi\n  chunk_size: {best.chunk_size}")
    return 0 if best is not None else 1
