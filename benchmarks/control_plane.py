"""The control plane's cost by Ray executor: the same saturated workload at PP=2 through
``ray`` (a Ray task per stage per micro-batch, hidden states over torch.distributed) and
``ray_compiled`` (one Ray Compiled Graph), for ``sarathi``, ``vllm`` and ``orca``, one run
dir each, all from one run of this script.

Per run it prints the bubble fraction over the steady state with its two families
(``shape``: PB1-PB3 and ``hybrid``, what SARATHI removes; ``runtime``: what the runtime
adds) and the largest runtime classes, throughput, and per micro-batch (medians, in
microseconds, from the run's ``events.jsonl``; one clock for every process on one node),
and the bubble before and after the last prefill left stage 0 (``summary.json``'s
``prefill_split``: ``w/ pf`` while micro-batches could still carry a prefill chunk, ``tail``
the decode-only micro-batches after, ``tail%`` that part's share of the window):

- ``dispatch``: the driver hands micro-batch k to the executor -> stage 0 has it;
- ``return``: the last stage finished j -> the driver has its tokens (when it was waiting);
- ``driver``: the driver's own work per micro-batch: scheduling + submit + applying the
  tokens (from its ``issue`` records and the waits between);
- ``L``: the last stage computed j -> the micro-batch k that waited for j reached stage 0:
  the whole loop back, what stage 0 idles per micro-batch when the pipeline is full. j is
  the last micro-batch whose tokens the driver had when it began scheduling k (M before k
  while prompts remain, fewer in the decode-only tail); scheduled ahead (``ray+ahead``, M+1
  in flight), a micro-batch that takes decode inputs over the ring was handed over before
  its source j finished and waits at stage 0 for j's tokens: L is then the ring's latency (j
  computed -> the end of that wait). Counted over the micro-batches whose loop back stage 0
  sat through (free by the time j was computed): with more in flight than stages it is
  mostly busy then, the loop back hidden, and only the decode-only tail's count.

    python benchmarks/control_plane.py                  # bubbles.yaml, ~5 min on 2 cores
    python benchmarks/control_plane.py --quick          # short.yaml, a smoke run

On 2 cores the two stages take both and the driver competes with them: the figures are
ratios between rows of one run, not absolute costs.
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import sys
import time
from pathlib import Path

from common import load_args_workload, load_average
from results import Run, add_record_flag, cores_note

from sarathi_pp import LLM, SamplingParams
from sarathi_pp.bench.workload import BenchRequest
from sarathi_pp.report import write_report
from sarathi_pp.report.log import RunLog, load_log

# Name -> the engine settings it runs with: the task path without and with scheduling ahead
# (the token ring), and the compiled graph (which has no ring).
VARIANTS = {
    "ray": {"executor": "ray", "schedule_ahead": False},
    "ray+ahead": {"executor": "ray", "schedule_ahead": True},
    "ray_compiled": {"executor": "ray_compiled", "schedule_ahead": False},
}
EXECUTORS = tuple(VARIANTS)
SCHEDULERS = ("sarathi", "vllm", "orca")
WORKLOAD = "configs/workloads/bubbles.yaml"
QUICK_WORKLOAD = "configs/workloads/short.yaml"
VOCAB_SIZE = 256


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny-llama-pp2.yaml")
    p.add_argument("--out", default="runs/control_plane", help="run dirs below this")
    p.add_argument("--executors", default=",".join(EXECUTORS), help="of " + ", ".join(EXECUTORS))
    p.add_argument("--schedulers", default=",".join(SCHEDULERS))
    p.add_argument(
        "--microbatches-in-flight", default="", help="e.g. 2,3 (default: the library's, auto)"
    )
    p.add_argument("--workload", default=None, help=f"workload YAML (default {WORKLOAD})")
    p.add_argument("--num-requests", type=int, default=None, help="default: the workload's")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--quick", action="store_true", help=f"default workload {QUICK_WORKLOAD}")
    add_record_flag(p)
    return p.parse_args(argv)


def run_one(args, variant: str, scheduler: str, in_flight: int | None,
            requests: list[BenchRequest], run_dir: Path) -> float:  # fmt: skip
    extra = {"num_microbatches_in_flight": in_flight} if in_flight else {}
    llm = LLM.from_config(
        args.config, scheduler=scheduler, chunk_size=args.chunk_size, run_dir=str(run_dir),
        overwrite=True, num_threads_per_stage=1, **VARIANTS[variant], **extra,
    )  # fmt: skip
    try:
        prompts = [list(r.prompt_token_ids) for r in requests]
        params = [
            SamplingParams(max_tokens=r.output_tokens, temperature=0.0, ignore_eos=True)
            for r in requests
        ]
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up: compiles the graph
        llm.engine.start_run(run_dir, overwrite=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start
    finally:
        llm.shutdown()


def median_us(values: list[float]) -> float:
    return 1e6 * statistics.median(values) if values else float("nan")


def loop_costs(log: RunLog) -> dict[str, float]:
    """Per micro-batch medians in microseconds (see the module)."""
    first, last = log.by_mb(0), log.by_mb(log.num_stages - 1)
    issues = {i.mb: i for i in log.issues}
    # from the later of the hand-over and stage 0 turning free (else a stage still busy
    # with the micro-batch before would count as dispatch)
    dispatch = [first[k].input_ready - max(i.submit, first[k].wait_start)
                for k, i in issues.items() if k in first and i.submit is not None]  # fmt: skip
    ret = [w.end - max(w.start, last[w.mb].send_end) for w in log.waits if w.mb in last]
    # j: the micro-batch k waited for: scheduled ahead, its ring source (the newest one it
    # takes tokens of); else the last one whose tokens the driver had when it began to
    # schedule k (the one that freed k's slot; in the decode-only tail, with fewer in
    # flight, not the one M before)
    done_times = [t for _, t in log.dones]  # log.dones: (mb, t) by t
    source: dict[int, int] = {}
    for k, i in issues.items():
        if i.ring is not None:
            source[k] = i.ring
        elif n := bisect.bisect_right(done_times, i.t):
            source[k] = log.dones[n - 1][0]
    # stage 0 can start k: it has k (input_ready) and, scheduled ahead, the ring's tokens
    # (its wait for them ends at compute_start)
    can_start = {k: e.compute_start if issues.get(k) and issues[k].ring is not None
                 else e.input_ready for k, e in first.items()}  # fmt: skip
    # L from j's tokens existing (the last stage sends them on, to the driver or over the
    # ring, once it has computed j), over the micro-batches whose loop back stage 0 sat
    # through: it was free by then (with more in flight than stages it is mostly busy with
    # the micro-batch before, and the loop back is hidden)
    loop = [
        can_start[k] - last[j].compute_end
        for k, j in source.items()
        if k in first and j in last and first[k].wait_start <= last[j].compute_end
    ]
    # the driver's own time: from the tokens of j in hand to the next wait's start, less
    # what it spent blocked (nothing: it does not block between), per micro-batch
    waits = sorted(log.waits, key=lambda w: w.start)
    driver = [b.start - a.end for a, b in zip(waits, waits[1:]) if b.start >= a.end]
    build = [i.submit - i.t for i in issues.values() if i.submit is not None]
    return {
        "dispatch": median_us(dispatch),
        "return": median_us(ret),
        "driver": median_us(driver),
        "schedule": median_us(build),
        "L": median_us(loop),
    }


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:.1%}"


def record(run: Run, rows: list[tuple[str, float, dict, dict]], tokens: int) -> None:
    """Per run: tokens/s and the bubble (all, runtime's) against the same scheduler's plain
    ``ray`` run where there is one; L and the driver's time per micro-batch."""
    by_name = {name: (wall, s, c) for name, wall, s, c in rows}
    for name, (wall, s, c) in by_name.items():
        base_name = name.replace("-ray+ahead", "-ray").replace("-ray_compiled", "-ray")
        base = by_name.get(base_name) if base_name != name else None
        label = base_name if base else None
        o = s["overall"]
        bo = base[1]["overall"] if base else None
        window, base_window = o["window_s"] or 1.0, (bo["window_s"] or 1.0) if bo else 1.0
        run.measure(f"{name}: generated tokens/s", tokens / wall, "tok/s",
                    baseline=tokens / base[0] if base else None, baseline_label=label,
                    better="higher")  # fmt: skip
        run.measure(f"{name}: bubble fraction", 100 * o["bubble_fraction"], "%",
                    baseline=100 * bo["bubble_fraction"] if bo else None, baseline_label=label,
                    better="lower")  # fmt: skip
        run.measure(f"{name}: runtime bubbles", 100 * o["families_s"]["runtime"] / window, "%",
                    baseline=100 * bo["families_s"]["runtime"] / base_window if bo else None,
                    baseline_label=label, better="lower")  # fmt: skip
        run.measure(f"{name}: L per micro-batch", c["L"], "us",
                    baseline=base[2]["L"] if base else None, baseline_label=label,
                    better="lower")  # fmt: skip
        run.measure(f"{name}: driver per micro-batch", c["driver"], "us", better="lower")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Run("control_plane", argv, quick=args.quick, enabled=not args.no_record)
    executors = [e.strip() for e in args.executors.split(",") if e.strip()]
    unknown = [e for e in executors if e not in VARIANTS]
    if unknown:
        raise SystemExit(f"--executors: unknown {unknown}; valid: {', '.join(VARIANTS)}")
    policies = [s.strip() for s in args.schedulers.split(",") if s.strip()]
    in_flights = [int(x) for x in args.microbatches_in_flight.split(",") if x.strip()] or [None]
    workload = load_args_workload(args, WORKLOAD, QUICK_WORKLOAD)
    requests = workload.requests(VOCAB_SIZE)
    tokens = sum(r.output_tokens for r in requests)
    rows = []
    for scheduler in policies:
        for m in in_flights:
            for executor in executors:
                name = f"{scheduler}-{executor}" + (f"-m{m}" if m else "")
                run_dir = Path(args.out) / name
                wall = run_one(args, executor, scheduler, m, requests, run_dir)
                summary = write_report(run_dir, plot=False)
                costs = loop_costs(load_log(run_dir / "events.jsonl"))
                print(f"{name}: {wall:.1f} s ({run_dir})", file=sys.stderr)
                rows.append((name, wall, summary, costs))
    print(f"# {workload.describe()}; chunk {args.chunk_size}, PP=2, one thread per stage "
          f"(the driver competes with the stages for 2 cores); load average {load_average()}")  # fmt: skip
    print(f"{'run':<26}{'tok/s':>7}{'bubble':>8}{'shape':>7}{'runtime':>8}"
          f"{'w/ pf':>7}{'tail':>7}{'tail%':>7}  "
          f"{'dispatch':>9}{'return':>8}{'driver':>8}{'sched':>7}{'L':>8}  top runtime classes")  # fmt: skip
    for name, wall, s, c in rows:
        split = s["prefill_split"]
        o = s["overall"]
        window = o["window_s"] or 1.0
        fam = o["families_s"]
        runtime = {k: v for k, v in o["bubbles_s"].items()
                   if k not in ("PB1", "PB2", "PB3", "hybrid", "no_work") and v > 0}  # fmt: skip
        top = ", ".join(f"{k} {v / window:.1%}"
                        for k, v in sorted(runtime.items(), key=lambda kv: -kv[1])[:3])  # fmt: skip
        print(f"{name:<26}{tokens / wall:>7.0f}{o['bubble_fraction']:>8.1%}"
              f"{fam['shape'] / window:>7.1%}{fam['runtime'] / window:>8.1%}"
              f"{_pct(split['while_prefills']):>7}{_pct(split['decode_only']):>7}"
              f"{split['decode_only_share']:>7.1%}  "
              f"{c['dispatch']:>9.0f}{c['return']:>8.0f}{c['driver']:>8.0f}{c['schedule']:>7.0f}"
              f"{c['L']:>8.0f}  {top}")  # fmt: skip
    print(
        "(w/ pf, tail: the bubble before / after the last prefill left stage 0, tail% the "
        "window's share after; dispatch, return, driver, sched, L: medians per micro-batch "
        "in microseconds)"
    )
    run.settings.update(workload=workload.describe(), config=args.config,
                        chunk_size=args.chunk_size, in_flight=in_flights)  # fmt: skip
    record(run, rows, tokens)
    run.note(cores_note(2))
    run.note("Read the rows against each other (one run of the script), not as absolute "
             "costs; L, driver: medians per micro-batch from events.jsonl.")  # fmt: skip
    run.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
