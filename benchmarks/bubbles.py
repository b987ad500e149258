"""Pipeline bubbles by scheduler: the same mixed workload at PP=2 on the embedded default
model through ``sarathi``, ``vllm``, ``orca`` and ``simple_chunking``, one run dir each,
then the bubble table side by side (``sarathi-pp report`` on the run dirs).

What it shows: prefill-prioritized (``vllm``) and iteration-level (``orca``) batching
alternate long and short micro-batches, so the stage behind waits (PB1/PB2/PB3 bubbles);
SARATHI's uniform hybrid micro-batches leave only the small residual variation (``hybrid``).
SARATHI's paper reports 6.29x fewer bubbles than the prefill-prioritized baseline.

    python benchmarks/bubbles.py --out runs/bubbles            # a few minutes on 2 cores
    python benchmarks/bubbles.py --out runs/bubbles --quick    # a smoke run

The workload is a file (``--workload``, default ``configs/workloads/bubbles.yaml``: 24
requests, prompts of 128/512/1024 random token ids, 48 output tokens; ``--quick``:
``short.yaml``), submitted all at once (arrival times other than 0 are refused: use
``sarathi-pp bench`` for those), greedy with EOS ignored.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from common import add_scheduling_flags, load_args_workload, load_average
from results import Run, add_record_flag, cores_note

from sarathi_pp import LLM, SamplingParams
from sarathi_pp.bench.workload import BenchRequest
from sarathi_pp.config import SCHEDULER_POLICIES
from sarathi_pp.report import write_report
from sarathi_pp.report.text import format_comparison

SCHEDULERS = ("sarathi", "vllm", "orca", "simple_chunking")
WORKLOAD = "configs/workloads/bubbles.yaml"
QUICK_WORKLOAD = "configs/workloads/short.yaml"
VOCAB_SIZE = 256  # prompts use byte ids of the builtin tokenizer (valid in any vocab >= 256)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny-llama-pp2.yaml")
    p.add_argument("--out", default="runs/bubbles", help="one run dir per scheduler below this")
    p.add_argument("--schedulers", default=",".join(SCHEDULERS))
    p.add_argument("--workload", default=None, help=f"workload YAML (default {WORKLOAD})")
    p.add_argument("--num-requests", type=int, default=None, help="default: the workload's")
    p.add_argument("--chunk-size", type=int, default=256)
    add_scheduling_flags(p)
    p.add_argument("--quick", action="store_true", help=f"default workload {QUICK_WORKLOAD}")
    add_record_flag(p)
    return p.parse_args(argv)


def schedulers(text: str) -> list[str]:
    """``--schedulers``: known policy names only (they name folders below ``--out``)."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SCHEDULER_POLICIES]
    if not names or unknown:
        print(
            f"bubbles.py: error: --schedulers {text!r}: unknown {unknown or 'none given'}; "
            f"valid: {', '.join(SCHEDULER_POLICIES)}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return names


def run_one(args, scheduler: str, requests: list[BenchRequest], run_dir: Path) -> float:
    # overwrite: the run dir's own files from an earlier run go (run_dir.RunDir.clear),
    # nothing else below --out is touched.
    llm = LLM.from_config(
        args.config,
        scheduler=scheduler,
        chunk_size=args.chunk_size,
        run_dir=str(run_dir),
        overwrite=True,
        num_threads_per_stage=1,
        num_microbatches_in_flight=args.microbatches_in_flight,
        balance_microbatches=args.balance,
        prefill_pacing=args.prefill_pacing,
    )
    try:
        prompts = [list(r.prompt_token_ids) for r in requests]
        params = [
            SamplingParams(max_tokens=r.output_tokens, temperature=0.0, ignore_eos=True)
            for r in requests
        ]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start
    finally:
        llm.shutdown()


def record(run: Run, names: list[str], summaries: list[dict], walls: list[float],
           num_tokens: int) -> None:  # fmt: skip
    """Per scheduler: its bubble fraction and throughput, against vllm's (the
    prefill-prioritised baseline SARATHI's paper compares with) where vllm ran."""
    by_name = dict(zip(names, zip(summaries, walls, strict=True), strict=True))
    base = by_name.get("vllm")
    for name, (summary, wall) in by_name.items():
        vs = base if base is not None and name != "vllm" else None
        run.measure(
            f"bubble fraction, {name}", 100 * summary["overall"]["bubble_fraction"], "%",
            baseline=100 * vs[0]["overall"]["bubble_fraction"] if vs else None,
            baseline_label="vllm" if vs else None, better="lower",
            headline="pipeline bubbles, SARATHI vs vLLM-style (PP=2)" if name == "sarathi" else None,
        )  # fmt: skip
        run.measure(
            f"generated tokens/s, {name}", num_tokens / wall, "tok/s",
            baseline=num_tokens / vs[1] if vs else None,
            baseline_label="vllm" if vs else None, better="higher",
        )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Run("bubbles", argv, quick=args.quick, enabled=not args.no_record)
    policies = schedulers(args.schedulers)  # before anything is written or removed
    workload = load_args_workload(args, WORKLOAD, QUICK_WORKLOAD)
    requests = workload.requests(VOCAB_SIZE)
    names, summaries, walls = [], [], []
    for scheduler in policies:
        run_dir = Path(args.out) / scheduler
        wall = run_one(args, scheduler, requests, run_dir)
        print(f"{scheduler}: {wall:.1f} s ({run_dir})", file=sys.stderr)
        names.append(scheduler)
        walls.append(wall)
        summaries.append(write_report(run_dir, plot=True))
    print(
        f"# {workload.describe()}; chunk {args.chunk_size}, PP=2, one thread per stage; "
        f"load average {load_average()}"
    )
    print(format_comparison(names, summaries))
    run.settings.update(workload=workload.describe(), config=args.config,
                        chunk_size=args.chunk_size, balance_microbatches=args.balance,
                        prefill_pacing=args.prefill_pacing,
                        microbatches_in_flight=args.microbatches_in_flight)  # fmt: skip
    record(run, names, summaries, walls, sum(r.output_tokens for r in requests))
    run.note(cores_note(2))
    run.note("Bubble fraction: the stages' idle share of the steady state (sarathi-pp "
             "report); tokens/s from the generate call's wall time.")  # fmt: skip
    run.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
