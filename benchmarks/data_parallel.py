"""Data parallelism on CPU: two replicas of the pipeline (``data_parallel_size=2``, each
PP=1 with one thread, one Ray stage actor each) against one replica (``data_parallel_size=1``
on the same Ray executor, PP=1, one thread), on one workload that saturates one replica.

The workload (``--workload``, default ``configs/workloads/pipeline-scaling.yaml``, at most
``--num-requests``; ``--quick``: ``configs/workloads/short.yaml``) runs through
``LLM.generate`` (greedy, EOS ignored, every request submitted at once) on the embedded
default model with the SARATHI scheduler. Both sides run on the ``ray`` executor, so the
driver, the control plane and the stage process are the same and only the number of
replicas differs. Only the ``generate`` call is timed, after the engine is built and a
small warm-up ``generate``; ``--repeat N`` alternates the two N times (a slow spell of a
shared machine hits both) and the recorded figure is the ratio of the median walls.

Printed and recorded: each side's wall and generated tokens/s, and DP=2's throughput over
DP=1's; a check that both sides' tokens are identical. Two replicas need two free cores:
on a machine shared with other work (the load average is recorded) the ratio is a floor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from common import load_args_workload, machine_line, random_prompts
from results import Run, add_record_flag, load_average

from sarathi_pp import LLM, SamplingParams
from sarathi_pp.executors.ray import start_ray

WORKLOAD = "configs/workloads/pipeline-scaling.yaml"
QUICK_WORKLOAD = "configs/workloads/short.yaml"
NUM_BYTE_TOKENS = 256  # prompts of byte ids of the builtin tokenizer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", help=f"an all_at_once workload YAML (default {WORKLOAD})")
    p.add_argument("--num-requests", type=int, help="at most this many of its requests")
    p.add_argument("--quick", action="store_true", help=f"the short workload ({QUICK_WORKLOAD})")
    p.add_argument("--repeat", type=int, default=3, help="alternated pairs (default 3)")
    p.add_argument("--chunk-size", type=int, default=256)
    add_record_flag(p)
    return p.parse_args(argv)


def run_one(dp: int, args: argparse.Namespace, prompts, params, warm) -> tuple[float, list]:
    """One side: build, warm up, time ``generate``; (wall seconds, token ids per request)."""
    with LLM(
        executor="ray", data_parallel_size=dp, num_threads_per_stage=1,
        chunk_size=args.chunk_size, prefault_kv_cache=True,
    ) as llm:  # fmt: skip
        llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        t0 = time.monotonic()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.monotonic() - t0
    return wall, [o.outputs[0].token_ids for o in outs]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run = Run("data_parallel", argv, quick=args.quick, enabled=not args.no_record)
    print(machine_line(1) + f"; usable cores (affinity) {len(os.sched_getaffinity(0))}")
    workload = load_args_workload(args, WORKLOAD, QUICK_WORKLOAD)
    requests = workload.requests(NUM_BYTE_TOKENS)
    prompts = [list(r.prompt_token_ids) for r in requests]
    params = [
        SamplingParams(max_tokens=r.output_tokens, temperature=0.0, ignore_eos=True)
        for r in requests
    ]
    num_out = sum(r.output_tokens for r in requests)
    warm = random_prompts([32, 32], NUM_BYTE_TOKENS, 1)
    print(f"workload: {workload.describe()}; load avg at the start {load_average()}")
    started = start_ray()
    walls: dict[int, list[float]] = {1: [], 2: []}
    same = True
    try:
        for i in range(args.repeat):
            (w1, t1), (w2, t2) = (run_one(dp, args, prompts, params, warm) for dp in (1, 2))
            walls[1].append(w1)
            walls[2].append(w2)
            same = same and t1 == t2
            print(f"pair {i + 1}/{args.repeat}: DP=1 {w1:.2f} s, DP=2 {w2:.2f} s: "
                  f"{w1 / w2:.2f}x", flush=True)  # fmt: skip
    finally:
        if started:
            import ray

            ray.shutdown()
    m1, m2 = statistics.median(walls[1]), statistics.median(walls[2])
    print(f"median: DP=1 {m1:.2f} s ({num_out / m1:.1f} tok/s), DP=2 {m2:.2f} s "
          f"({num_out / m2:.1f} tok/s): {m1 / m2:.2f}x; outputs identical: {same}")  # fmt: skip
    print(f"load avg (1 min) at the end: {load_average()}")
    run.settings.update(
        workload=workload.describe(), chunk_size=args.chunk_size, repeat=args.repeat,
        threads_per_stage=1, executor="ray",
    )  # fmt: skip
    run.measure("DP=2 generated tokens/s", num_out / m2, "tok/s", baseline=num_out / m1,
                baseline_label="one replica (DP=1)", better="higher",
                headline="data-parallel replicas, 2 over 1",
                detail=f"median of {args.repeat} alternated pairs; walls DP=1 "
                       f"{[round(w, 2) for w in walls[1]]}, DP=2 {[round(w, 2) for w in walls[2]]}")  # fmt: skip
    run.note("each replica is PP=1 with one thread; two replicas need two free cores, so on "
             "a machine shared with other work (see the load averages) the ratio is a floor.")  # fmt: skip
    run.check("DP=2's outputs identical to DP=1's", same)
    run.write()


if __name__ == "__main__":
    main()
