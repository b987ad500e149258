"""Throughput of sarathi-pp vs Hugging Face continuous batching, and our model FLOP/s.

``sarathi-pp bench --config configs/tiny-llama.yaml --workload configs/workloads/mixed.yaml
--peer hf --run-dir DIR`` is the latency/throughput comparison; this script adds the FLOP
breakdown (and checks that both engines generate the same tokens).

The requests of one all-at-once workload (``--workload``, default
``configs/workloads/mixed.yaml``: 32 requests, random token-id prompts of 128/512/1024
tokens, 64 output tokens each; ``--quick``: ``configs/workloads/short.yaml``;
``--num-requests`` keeps the first n), drawn over the model's vocabulary as ``sarathi-pp
bench`` draws them, greedy, EOS ignored, go through

* ``LLM.generate`` (the config's scheduler, by default SARATHI with 256-token chunks), and
* the HF peer, ``sarathi_pp.bench.peer_hf.run_hf_peer``: transformers' continuous batching
  (``model.generate_batch``: paged KV cache, its own FIFO scheduler) on the same model
  folder, dtype and torch thread count,

one after the other in one process. Our ``LLM`` is built and warmed up on other prompts
before its timed ``generate``; the peer warms its persistent manager up on two short
prompts before its timed ``generate_batch`` (HF's own dummy-batch warm-up is skipped).

Time: both engines are timed from their request metrics, first arrival to last finish (as
the ``requests`` summary of ``sarathi-pp bench``): the peer's run includes loading the
model and its warm-up, so its wall time means nothing here. Printed: that time, generated
tokens/s and requests/s of each and their ratio, and how many requests produce identical
greedy tokens in both (near-ties may flip a token through float rounding: a few mismatches
are not a bug on their own).

Efficiency: model FLOPs of the workload (``common.chunk_flops``: 2 x non-embedding params
per token fed, 2 x hidden x vocab per sampled row, 4 x context x hidden per token and layer
for attention) divided by that time, against the machine's fp32 matmul rate measured here.
Our steps are also timed one by one (a wrapper around ``ModelRunner.execute``), so FLOP/s is
shown per kind of step (prefill-only, hybrid, decode-only) and the time outside the model
(scheduling, bookkeeping) is the wall time of our ``generate`` minus the step times. Each
step has two floors (``common.floor_s``): its FLOPs at the matmul rate and its bytes (the
weights once, every chunk's K/V context once) at the copy rate, both measured in this run;
a kind's "larger floor" sums each step's larger one. Decode-only steps are also shown by
their number of decodes, with the floor that binds each size: with few decodes a step
reads more than it computes, with many it computes more (the machine's FLOPs per byte
decide where).

Run from the repository root: ``python benchmarks/vs_hf.py [--quick]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py

import torch  # noqa: E402
from common import (  # noqa: E402
    add_threads_flag,
    chunk_flops,
    copy_gbps,
    describe_rates,
    floor_s,
    is_busy,
    load_args_workload,
    load_average,
    machine_line,
    matmul_rates,
    microbatch_flops,
    random_prompts,
    set_threads,
    step_bytes,
)
from results import Run, add_record_flag  # noqa: E402

from sarathi_pp import LLM, SamplingParams  # noqa: E402
from sarathi_pp.bench.runner import request_params  # noqa: E402
from sarathi_pp.bench.workload import BenchRequest, Workload  # noqa: E402
from sarathi_pp.microbatch import MicroBatch  # noqa: E402
from sarathi_pp.model_spec import DTYPE_BYTES, ModelSpec  # noqa: E402
from sarathi_pp.outputs import RequestOutput  # noqa: E402

WORKLOAD = "configs/workloads/mixed.yaml"
QUICK_WORKLOAD = "configs/workloads/short.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny-llama.yaml", help="engine YAML config")
    p.add_argument("--scheduler", default=None, help="override the config's scheduler policy")
    p.add_argument("--chunk-size", type=int, default=None, help="override the config's chunk size")
    p.add_argument("--workload", default=None, help=f"workload YAML (default {WORKLOAD})")
    p.add_argument("--num-requests", type=int, default=None, help="default: the workload's")
    p.add_argument("--hf-attn", default="sdpa", help="HF attn_implementation: sdpa or eager")
    p.add_argument(
        "--hf-max-batch-tokens",
        type=int,
        default=None,
        help="HF max_batch_tokens (default: the peer's, 8192 or the workload's prefill if less)",
    )
    p.add_argument("--skip-hf", action="store_true", help="run our engine only")
    p.add_argument(
        "--prefault",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="cache.prefault for our engine: map its KV cache at start-up, so no step pays a "
        "page's first touch (20-40 us per 4 KB page in VMs whose host backs memory on demand); "
        "--no-prefault: the pages are mapped inside the run, as the engine's default does",
    )
    p.add_argument(
        "--quick", action="store_true", help=f"workload {QUICK_WORKLOAD}: checks the script"
    )
    add_threads_flag(p)
    add_record_flag(p)
    return p.parse_args(argv)


class Step(NamedTuple):
    """One ``ModelRunner.execute`` call."""

    seconds: float
    flops: int
    nbytes: int  # common.step_bytes: the weights once + every chunk's K/V context once
    num_decodes: int
    context: int  # tokens of K/V the step's chunks attend over, summed


def total(steps: list[Step]) -> Step:
    """``steps`` (at least one) summed field by field."""
    return Step(*(sum(column) for column in zip(*steps, strict=True)))


@dataclass
class StepTotals:
    """Our ``ModelRunner.execute`` calls, each kept (so every step can be held to its own
    floors), keyed by the micro-batch's kind (prefill, hybrid, decode)."""

    by_kind: dict[str, list[Step]] = field(default_factory=dict)

    def add(self, kind: str, step: Step) -> None:
        self.by_kind.setdefault(kind, []).append(step)


def larger_floor_s(steps: list[Step], gflops: float, gbps: float) -> float:
    """The sum over ``steps`` of each step's larger floor: what the steps could take at
    best (a step is held to whichever of its compute and bandwidth floors is larger)."""
    return sum(max(floor_s(s.flops, s.nbytes, gflops, gbps)) for s in steps)


@dataclass
class RunResult:
    name: str
    span_s: float  # first arrival to last finish, from the request metrics
    tokens: list[list[int]]  # generated token ids, per request in workload order
    num_failed: int = 0
    wall_s: float = 0.0  # ours: the generate call
    steps: StepTotals = field(default_factory=StepTotals)  # ours only


def from_outputs(name: str, outputs: list[RequestOutput]) -> RunResult:
    """Tokens and time span (first arrival to last finish, ``time.monotonic()``)."""
    finished = [o.metrics.finished_time for o in outputs if o.metrics.finished_time is not None]
    if not finished:
        raise RuntimeError(f"{name}: no request finished: {outputs[0].error}")
    span = max(finished) - min(o.metrics.arrival_time for o in outputs)
    tokens = [list(o.outputs[0].token_ids) if o.outputs else [] for o in outputs]
    return RunResult(name, span, tokens, num_failed=sum(o.error is not None for o in outputs))


def workload_flops(spec: ModelSpec, requests: list[BenchRequest]) -> int:
    """Useful FLOPs: each request feeds its prompt then all but its last generated token
    (prompt + output - 1 tokens at positions 0..), and samples ``output_tokens`` rows."""
    return sum(
        chunk_flops(spec, 0, len(r.prompt_token_ids) + r.output_tokens - 1, r.output_tokens)
        for r in requests
    )


# --- ours ------------------------------------------------------------------------------------
def build_llm(args: argparse.Namespace) -> LLM:
    overrides = {
        "scheduler": args.scheduler,
        "chunk_size": args.chunk_size,
        "prefault_kv_cache": args.prefault,
    }
    llm = LLM.from_config(args.config, **{k: v for k, v in overrides.items() if v is not None})
    if not hasattr(llm.engine.executor, "runner"):
        llm.shutdown()
        raise SystemExit("error: the step timing needs the single-process executor (PP=1)")
    return llm


def time_steps(worker, spec: ModelSpec, totals: StepTotals) -> None:
    """Wrap ``worker.execute`` (an instance attribute, this LLM only) to add each step's
    seconds, FLOPs and floor bytes to ``totals``, keyed by the micro-batch's kind."""
    dtype = worker.stage.dtype
    execute = worker.execute

    def timed(microbatch: MicroBatch, *rest):
        t0 = time.perf_counter()
        out = execute(microbatch, *rest)
        seconds = time.perf_counter() - t0
        chunks = microbatch.chunks
        totals.add(
            microbatch.kind,
            Step(
                seconds,
                microbatch_flops(spec, microbatch),
                step_bytes(spec, dtype, microbatch),
                microbatch.num_decode_tokens,
                sum(c.end for c in chunks),
            ),
        )
        return out

    worker.execute = timed


def run_ours(llm: LLM, requests: list[BenchRequest]) -> RunResult:
    spec = llm.engine.spec
    # warm-up prompts unlike the timed ones (seed 1): nothing of them is reused
    warm = random_prompts([min(len(r.prompt_token_ids) for r in requests)] * 2, spec.vocab_size, 1)
    llm.generate(
        warm, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False
    )
    cfg = llm.engine.config.scheduler
    steps = StepTotals()
    time_steps(llm.engine.executor.runner, spec, steps)
    prompts = [list(r.prompt_token_ids) for r in requests]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, [request_params(r) for r in requests], use_tqdm=False)
    wall = time.perf_counter() - t0
    result = from_outputs(f"sarathi-pp ({cfg.policy}, chunk {cfg.chunk_size})", outputs)
    result.wall_s, result.steps = wall, steps
    return result


# --- Hugging Face ----------------------------------------------------------------------------
def run_peer(
    args: argparse.Namespace,
    model_dir: str,
    dtype: str,
    requests: list[BenchRequest],
    num_threads: int,
) -> RunResult:
    from sarathi_pp.bench.peer_hf import run_hf_peer

    peer = run_hf_peer(
        model_dir,
        requests,
        dtype=dtype,
        num_threads=num_threads,
        attn_implementation=args.hf_attn,
        max_batch_tokens=args.hf_max_batch_tokens,
    )
    print(f"peer: {peer.note}")
    return from_outputs(f"HF {peer.mode} ({args.hf_attn})", peer.outputs)


# --- report ----------------------------------------------------------------------------------
def print_throughput(runs: list[RunResult]) -> None:
    print(f"{'':<34} {'time s':>8} {'gen tok/s':>10} {'req/s':>8} {'failed':>6}")
    for r in runs:
        gen = sum(len(t) for t in r.tokens)
        done = len(r.tokens) - r.num_failed
        print(
            f"{r.name:<34} {r.span_s:>8.2f} {gen / r.span_s:>10.1f} {done / r.span_s:>8.3f} "
            f"{r.num_failed:>6}"
        )
    print("  time = first arrival to last finish (request metrics)")
    if len(runs) == 2:
        print(f"throughput ratio ours / HF: {runs[1].span_s / runs[0].span_s:.2f}x")


def print_flops(runs: list[RunResult], total_flops: int, measured: list[dict[str, float]]) -> float:
    """Returns the peak used: the best of the matmul rates (``common.matmul_rates``: every way
    of computing a matmul here) measured before and after the runs (they differ much only when
    the machine's load changed meanwhile)."""
    rates = [max(r.values()) for r in measured]
    peak_gflops = max(rates)
    print(
        f"model FLOPs of the workload: {total_flops / 1e9:.0f} GFLOP; fp32 matmul rate "
        f"{describe_rates(measured[0])} before the runs, {describe_rates(measured[1])} after; "
        f"peak = {peak_gflops:.1f}"
    )
    if min(rates) < 0.8 * peak_gflops:
        print(
            "  warning: the matmul rate changed by > 20% during the run (other processes?): "
            "the FLOP/s and the ours/HF ratio are unreliable"
        )
    for r in runs:
        rate = total_flops / r.span_s / 1e9
        print(f"  {r.name:<32} {rate:>7.1f} GFLOP/s = {rate / peak_gflops:>5.1%} of peak")
    return peak_gflops


def print_step_breakdown(ours: RunResult, peak_gflops: float, gbps: float, dtype: str) -> None:
    """Our FLOP/s by kind of step against both floors (``common.floor_s``; ``gbps``: the copy
    rate measured in this run), the decode-only steps by size, and the time spent outside
    ``ModelRunner.execute``."""
    print(
        f"{'sarathi-pp steps':<16} {'steps':>6} {'time s':>8} {'GFLOP':>8} {'GFLOP/s':>8} "
        f"{'of peak':>8} {'compute':>8} {'bandwidth':>9} {'larger':>8} {'time /':>7}"
    )
    print(
        f"{'':<16} {'':>6} {'':>8} {'':>8} {'':>8} {'':>8} {'floor s':>8} {'floor s':>9} "
        f"{'floor s':>8} {'larger':>7}"
    )
    by_kind = ours.steps.by_kind
    over = {}  # kind -> its time over its (bandwidth, compute, larger) floor
    for kind in ("prefill", "hybrid", "decode"):
        if kind not in by_kind:
            continue
        t = total(by_kind[kind])
        rate = t.flops / t.seconds / 1e9
        compute, bandwidth = floor_s(t.flops, t.nbytes, peak_gflops, gbps)
        larger = larger_floor_s(by_kind[kind], peak_gflops, gbps)
        print(
            f"{kind:<16} {len(by_kind[kind]):>6} {t.seconds:>8.2f} {t.flops / 1e9:>8.0f} {rate:>8.1f} "
            f"{rate / peak_gflops:>8.1%} {compute:>8.2f} {bandwidth:>9.2f} {larger:>8.2f} "
            f"{t.seconds / larger:>6.2f}x"
        )
        over[kind] = (t.seconds / bandwidth, t.seconds / compute, t.seconds / larger)
    print(
        "  larger floor: each step's larger floor (compute or bandwidth), summed over the "
        "kind's steps"
    )
    if "decode" in by_kind:  # issue 15's target names the bandwidth floor
        bandwidth_x, compute_x, larger_x = over["decode"]
        print(
            f"decode-only steps: {bandwidth_x:.2f}x their bandwidth floor, {compute_x:.2f}x "
            f"their compute floor, {larger_x:.2f}x their larger floors (by size below)"
        )
        print_decode_sizes(by_kind["decode"], peak_gflops, gbps, DTYPE_BYTES[dtype])
    in_steps = sum(total(steps).seconds for steps in by_kind.values())
    print(
        f"outside ModelRunner.execute (scheduler, bookkeeping, outputs): "
        f"{ours.wall_s - in_steps:.2f} s of {ours.wall_s:.2f} s generate() wall"
    )


DECODE_SIZES = ((1, 4), (5, 8), (9, 16), (17, 32), (33, 64), (65, 128), (129, 1 << 30))


def print_decode_sizes(
    decode_steps: list[Step], peak_gflops: float, gbps: float, weight_bytes: int
) -> None:
    """Decode-only steps grouped by their number of decodes: per step, its time and both
    floors. A step of B decodes multiplies B rows by every weight: its FLOPs grow with B and
    its bytes barely (the weights dominate), so from some B on the compute floor is the
    larger one: 2 B FLOPs per weight of ``weight_bytes`` bytes, so about where
    2 B / weight_bytes passes the machine's FLOPs per byte, peak / copy rate (the K/V read
    moves it up a little)."""
    print(
        f"  {'decodes':<9} {'steps':>5} {'time s':>7} {'ms/step':>8} {'context':>8} "
        f"{'compute':>8} {'bandwidth':>9} {'time /':>7} {'time /':>7}   bound"
    )
    print(
        f"  {'':<9} {'':>5} {'':>7} {'':>8} {'/ decode':>8} {'ms/step':>8} {'ms/step':>9} "
        f"{'bandw.':>7} {'compute':>7}"
    )
    for lo, hi in DECODE_SIZES:
        group = [s for s in decode_steps if lo <= s.num_decodes <= hi]
        if not group:
            continue
        n, t = len(group), total(group)
        secs = t.seconds
        compute, bandwidth = floor_s(t.flops, t.nbytes, peak_gflops, gbps)
        context = t.context / t.num_decodes
        label = f"{lo}" if lo == hi else (f"{lo}-{hi}" if hi < 1 << 30 else f"{lo}+")
        print(
            f"  {label:<9} {n:>5} {secs:>7.2f} {1e3 * secs / n:>8.2f} {context:>8.0f} "
            f"{1e3 * compute / n:>8.2f} {1e3 * bandwidth / n:>9.2f} {secs / bandwidth:>6.2f}x "
            f"{secs / compute:>6.2f}x   {'compute' if compute > bandwidth else 'bandwidth'}"
        )
    print(
        f"  (machine balance: {peak_gflops / gbps:.1f} FLOP per byte of the copy rate; a "
        f"decode-only step is compute-bound from about "
        f"{weight_bytes * peak_gflops / gbps / 2:.0f} decodes)"
    )


def print_agreement(ours: RunResult, hf: RunResult) -> None:
    pairs = list(zip(ours.tokens, hf.tokens, strict=True))
    same = sum(a == b for a, b in pairs)
    prefix = []  # identical leading tokens per request
    for a, b in pairs:
        k = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        prefix.append(k)
    lens = {len(t) for t in ours.tokens + hf.tokens}
    print(
        f"greedy agreement: {same}/{len(ours.tokens)} requests identical token for token; "
        f"mean identical prefix {sum(prefix) / len(prefix):.1f} tokens; output lengths {sorted(lens)}"
    )


def record(run: Run, runs: list[RunResult], total_flops: int, peak_gflops: float) -> None:
    """Throughput and FLOP/s, ours against HF's from the same run (when HF ran), our time
    over the workload's compute floor, and the greedy agreement."""
    ours, hf = runs[0], runs[1] if len(runs) > 1 else None

    def gen_rate(r: RunResult) -> float:
        return sum(len(t) for t in r.tokens) / r.span_s

    run.measure(
        "generated tokens/s", gen_rate(ours), "tok/s",
        baseline=gen_rate(hf) if hf else None, baseline_label=hf.name if hf else None,
        better="higher", headline="throughput vs Hugging Face continuous batching",
        detail=ours.name,
    )  # fmt: skip
    run.measure(
        "model GFLOP/s", total_flops / ours.span_s / 1e9, "GFLOP/s",
        baseline=total_flops / hf.span_s / 1e9 if hf else None,
        baseline_label=hf.name if hf else None, better="higher",
        detail=f"ours {total_flops / ours.span_s / 1e9 / peak_gflops:.1%} of the "
        f"{peak_gflops:.1f} GFLOP/s matmul rate",
    )  # fmt: skip
    run.measure("time over the workload's compute floor",
                ours.span_s / (total_flops / (peak_gflops * 1e9)), "x", better="lower")  # fmt: skip
    if hf:
        same = sum(a == b for a, b in zip(ours.tokens, hf.tokens, strict=True))
        run.measure("requests identical to HF token for token", same,
                    f"of {len(ours.tokens)}", better="higher")  # fmt: skip


def workload_requests(llm: LLM, workload: Workload) -> list[BenchRequest]:
    """Over the model's vocabulary, checked against its max_model_len (as ``sarathi-pp
    bench`` draws them)."""
    try:
        return workload.requests(llm.engine.spec.vocab_size, llm.engine.max_model_len)
    except ValueError as e:
        llm.shutdown()
        raise SystemExit(f"error: {e}") from None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run = Run("vs_hf", argv, quick=args.quick, enabled=not args.no_record)
    workload = load_args_workload(args, WORKLOAD, QUICK_WORKLOAD)
    print(machine_line(set_threads(args.threads)))
    rate_before, copy_before = matmul_rates(), copy_gbps()
    llm = build_llm(args)
    num_threads = torch.get_num_threads()  # what our engine runs with (the config may set it)
    kv = llm.engine.executor.runner.kv
    if kv.prefault_s is not None:
        print(
            f"KV cache: {kv.nbytes() / 2**30:.2f} GiB mapped at start-up in {kv.prefault_s:.1f} s "
            "(cache.prefault; --no-prefault: its pages are mapped as the run first writes them)"
        )
    requests = workload_requests(llm, workload)
    print(
        f"workload: {workload.describe()} ({sum(len(r.prompt_token_ids) for r in requests)} "
        f"prompt tokens, {sum(r.output_tokens for r in requests)} output tokens), greedy, "
        f"EOS ignored; {num_threads} torch threads"
    )
    try:
        ours = run_ours(llm, requests)
        spec, model_dir = llm.engine.spec, llm.engine.model_dir
        dtype = llm.engine.placement.dtype
    finally:
        llm.shutdown()
    runs = [ours]
    if not args.skip_hf:
        runs.append(run_peer(args, model_dir, dtype, requests, num_threads))
    rates = [rate_before, matmul_rates()]
    gbps = max(copy_before, copy_gbps())
    print_throughput(runs)
    total_flops = workload_flops(spec, requests)
    peak = print_flops(runs, total_flops, rates)
    floor = total_flops / (peak * 1e9)
    print(
        f"compute floor of the workload: {floor:.1f} s (its FLOPs at the peak); ours "
        f"{ours.span_s / floor:.2f}x it; copy rate {copy_before:.1f} GB/s before the runs, "
        f"best {gbps:.1f} (read + write)"
    )
    print_step_breakdown(ours, peak, gbps, dtype)
    if not args.skip_hf:
        print_agreement(ours, runs[1])
    busy = " (busy: above the CPU count, rerun on a quiet machine)" if is_busy() else ""
    print(f"load avg (1 min) at the end: {load_average()}{busy}")
    run.settings.update(workload=workload.describe(), threads=num_threads, hf_attn=args.hf_attn)
    record(run, runs, total_flops, peak)
    run.note("Both engines one after the other in one process, each timed from its request "
             "metrics (first arrival to last finish); a busy spell during one moves the ratio.")  # fmt: skip
    if min(max(r.values()) for r in rates) < 0.8 * peak:
        run.note("The matmul rate changed by > 20% during the run: the ratio is unreliable.")
    run.write()


if __name__ == "__main__":
    main()
