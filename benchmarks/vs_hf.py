"""Throughput of sarathi-pp vs Hugging Face continuous batching, and our model FLOP/s.

The same requests (random token-id prompts of ``--prompt-lens`` tokens, cycled over
``--num-requests``, all submitted at once, ``--output-len`` tokens each, greedy, EOS
ignored) go through

* ``LLM.generate`` (the config's scheduler, by default SARATHI with 256-token chunks), and
* transformers' continuous batching, ``model.generate_batch`` (paged KV cache, its own
  FIFO scheduler), on the same model folder and torch thread count,

one after the other in one process. Both are warmed up first on other prompts (HF's manager
is built and kept, so the timed call excludes its set-up; our ``LLM`` is built before timing
too). Printed: wall time, generated tokens/s and requests/s of each and their ratio, and
how many requests produce identical greedy tokens in both (near-ties may flip a token
through float rounding: a few mismatches are not a bug on their own).

Efficiency: model FLOPs of the workload (``common.chunk_flops``: 2 x non-embedding params
per token fed, 2 x hidden x vocab per sampled row, 4 x context x hidden per token and layer
for attention) divided by wall time, against the machine's fp32 matmul rate measured here.
Our steps are also timed one by one (a wrapper around ``StageWorker.execute``), so FLOP/s is
shown per kind of step (prefill-only, hybrid, decode-only) and the time outside the model
(scheduling, bookkeeping) is the wall time minus the step times.

Run from the repository root: ``python benchmarks/vs_hf.py [--quick]``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py

import torch  # noqa: E402
from common import (  # noqa: E402
    add_threads_flag,
    chunk_flops,
    is_busy,
    load_average,
    machine_line,
    matmul_gflops,
    parse_int_list,
    random_prompts,
    set_threads,
)

from sarathi_pp import LLM, SamplingParams  # noqa: E402
from sarathi_pp.model_spec import ModelSpec  # noqa: E402
from sarathi_pp.plan import MicroBatchPlan  # noqa: E402

QUICK = {"num_requests": 4, "output_len": 8, "prompt_lens": [32, 64]}
# Prompts use the byte ids of the builtin tokenizer (valid in any vocab of >= 256 ids).
NUM_BYTE_TOKENS = 256


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny-llama.yaml", help="engine YAML config")
    p.add_argument("--scheduler", default=None, help="override the config's scheduler policy")
    p.add_argument("--chunk-size", type=int, default=None, help="override the config's chunk size")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64, help="generated tokens per request")
    p.add_argument("--prompt-lens", type=parse_int_list, default=[128, 512, 1024], help="cycled")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--hf-attn", default="sdpa", help="HF attn_implementation: sdpa or eager")
    p.add_argument(
        "--hf-max-batch-tokens",
        type=int,
        default=None,
        help="HF ContinuousBatchingConfig.max_batch_tokens (default: HF's, 8192)",
    )
    p.add_argument("--skip-hf", action="store_true", help="run our engine only")
    p.add_argument("--quick", action="store_true", help="small sizes: checks the script in < 60 s")
    add_threads_flag(p)
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.num_requests < 1 or args.output_len < 1:
        raise SystemExit("--num-requests and --output-len must be >= 1")
    return args


@dataclass
class RunResult:
    name: str
    wall_s: float
    tokens: list[list[int]]  # generated token ids, per request in prompt order
    step_s: dict[str, float] = field(default_factory=dict)  # ours: seconds per plan kind
    step_flops: dict[str, int] = field(default_factory=dict)  # ours: FLOPs per plan kind
    num_steps: dict[str, int] = field(default_factory=dict)


def plan_flops(spec: ModelSpec, plan: MicroBatchPlan) -> int:
    return sum(chunk_flops(spec, c.start, c.num_tokens, int(c.do_sample)) for c in plan.chunks)


def workload_flops(spec: ModelSpec, prompt_lens: list[int], output_len: int) -> int:
    """Useful FLOPs: each request feeds its prompt then all but its last generated token
    (prompt + output - 1 tokens at positions 0..), and samples ``output_len`` rows."""
    return sum(chunk_flops(spec, 0, n + output_len - 1, output_len) for n in prompt_lens)


# --- ours ------------------------------------------------------------------------------------
def time_steps(worker, spec: ModelSpec, result: RunResult) -> None:
    """Wrap ``worker.execute`` (an instance attribute, this LLM only) to add each step's
    seconds and FLOPs to ``result``, keyed by the plan's kind."""
    execute = worker.execute

    def timed(plan: MicroBatchPlan, *rest):
        t0 = time.perf_counter()
        out = execute(plan, *rest)
        kind = plan.kind
        result.step_s[kind] = result.step_s.get(kind, 0.0) + time.perf_counter() - t0
        result.step_flops[kind] = result.step_flops.get(kind, 0) + plan_flops(spec, plan)
        result.num_steps[kind] = result.num_steps.get(kind, 0) + 1
        return out

    worker.execute = timed


def run_ours(
    args: argparse.Namespace, prompts: list[list[int]], warm: list[list[int]]
) -> tuple[RunResult, LLM]:
    overrides = {"scheduler": args.scheduler, "chunk_size": args.chunk_size}
    llm = LLM.from_config(args.config, **{k: v for k, v in overrides.items() if v is not None})
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(
        warm, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False
    )
    result = RunResult("sarathi-pp", 0.0, [])
    time_steps(llm.engine.executor.worker, llm.engine.spec, result)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result.wall_s = time.perf_counter() - t0
    result.tokens = [o.outputs[0].token_ids for o in outputs]
    return result, llm


# --- Hugging Face ----------------------------------------------------------------------------
def hf_cb_config(args: argparse.Namespace, prompts: list[list[int]]):
    """Cache sized to hold every request at once (HF cannot read free memory on CPU
    without psutil); no prefix sharing (we have none, and warm-up must not prefill for us)."""
    from transformers import ContinuousBatchingConfig

    page_size = 256  # HF's default
    num_blocks = sum(-(-(len(p) + args.output_len) // page_size) for p in prompts) + len(prompts)
    return ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=num_blocks,
        max_batch_tokens=args.hf_max_batch_tokens,
        max_requests_per_batch=len(prompts),
        allow_block_sharing=False,
    )


def run_hf(
    args: argparse.Namespace, model_dir: str, prompts: list[list[int]], warm: list[list[int]]
) -> RunResult:
    from transformers import AutoModelForCausalLM, GenerationConfig

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # psutil nags
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=args.hf_attn
    )
    cb = hf_cb_config(args, prompts)
    # eos_token_id=-1: HF's "no EOS" (None falls back to the model config's EOS).
    gen = GenerationConfig(max_new_tokens=args.output_len, do_sample=False, eos_token_id=-1)
    kwargs = {
        "generation_config": gen,
        "continuous_batching_config": cb,
        "persistent_manager": True,
    }
    model.generate_batch(inputs=warm, warmup=False, **kwargs)  # builds and keeps the manager
    t0 = time.perf_counter()
    out = model.generate_batch(inputs=prompts, warmup=False, **kwargs)
    wall = time.perf_counter() - t0
    model.destroy_cached_continuous_batching_manager()
    results = list(out.values())  # in input order
    if len(results) != len(prompts):
        raise RuntimeError(f"HF returned {len(results)} of {len(prompts)} requests")
    return RunResult(
        f"HF generate_batch ({model.config._attn_implementation})",
        wall,
        [list(r.generated_tokens) for r in results],
    )


# --- report ----------------------------------------------------------------------------------
def print_throughput(runs: list[RunResult], num_requests: int, output_len: int) -> None:
    print(f"{'':<34} {'wall s':>8} {'gen tok/s':>10} {'req/s':>8}")
    for r in runs:
        gen = num_requests * output_len
        print(
            f"{r.name:<34} {r.wall_s:>8.2f} {gen / r.wall_s:>10.1f} {num_requests / r.wall_s:>8.3f}"
        )
    if len(runs) == 2:
        print(f"throughput ratio ours / HF: {runs[1].wall_s / runs[0].wall_s:.2f}x")


def print_flops(runs: list[RunResult], total_flops: int, rates: list[float]) -> float:
    """Returns the peak used: the best of the matmul rates measured before and after the
    runs (they differ much only when the machine's load changed meanwhile)."""
    peak_gflops = max(rates)
    print(
        f"model FLOPs of the workload: {total_flops / 1e9:.0f} GFLOP; fp32 matmul rate "
        f"{rates[0]:.1f} GFLOP/s before the runs, {rates[1]:.1f} after; peak = {peak_gflops:.1f}"
    )
    if min(rates) < 0.8 * peak_gflops:
        print(
            "  warning: the matmul rate changed by > 20% during the run (other processes?): "
            "the FLOP/s and the ours/HF ratio are unreliable"
        )
    for r in runs:
        rate = total_flops / r.wall_s / 1e9
        print(
            f"  {r.name:<32} {rate:>7.1f} GFLOP/s = {rate / peak_gflops:>5.1%} of peak (wall time)"
        )
    return peak_gflops


def print_step_breakdown(ours: RunResult, peak_gflops: float) -> None:
    """Our FLOP/s by kind of step, and the time spent outside ``StageWorker.execute``."""
    print(
        f"{'sarathi-pp steps':<16} {'steps':>6} {'time s':>8} {'GFLOP':>8} {'GFLOP/s':>8} {'of peak':>8}"
    )
    for kind in ("prefill", "hybrid", "decode"):
        n = ours.num_steps.get(kind, 0)
        if not n:
            continue
        secs, flops = ours.step_s[kind], ours.step_flops[kind]
        rate = flops / secs / 1e9
        print(
            f"{kind:<16} {n:>6} {secs:>8.2f} {flops / 1e9:>8.0f} {rate:>8.1f} {rate / peak_gflops:>8.1%}"
        )
    in_steps = sum(ours.step_s.values())
    print(
        f"outside StageWorker.execute (scheduler, bookkeeping, outputs): "
        f"{ours.wall_s - in_steps:.2f} s of {ours.wall_s:.2f} s wall"
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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    num_threads = set_threads(args.threads)
    print(machine_line(num_threads))
    rate_before = matmul_gflops()
    lens = [args.prompt_lens[i % len(args.prompt_lens)] for i in range(args.num_requests)]
    prompts = random_prompts(lens, NUM_BYTE_TOKENS, args.seed)
    warm = random_prompts([min(lens)] * 2, NUM_BYTE_TOKENS, args.seed + 1)
    print(
        f"workload: {args.num_requests} requests, prompt lengths {args.prompt_lens} cycled "
        f"({sum(lens)} prompt tokens), {args.output_len} output tokens each, greedy, EOS ignored"
    )
    ours, llm = run_ours(args, prompts, warm)
    cfg = llm.engine.config.scheduler
    ours.name = f"sarathi-pp ({cfg.policy}, chunk {cfg.chunk_size})"
    spec, model_dir = llm.engine.spec, llm.engine.model_dir
    llm.shutdown()
    runs = [ours]
    if not args.skip_hf:
        runs.append(run_hf(args, model_dir, prompts, warm))
    rates = [rate_before, matmul_gflops()]
    print_throughput(runs, args.num_requests, args.output_len)
    peak = print_flops(runs, workload_flops(spec, lens, args.output_len), rates)
    print_step_breakdown(ours, peak)
    if not args.skip_hf:
        print_agreement(ours, runs[1])
    busy = " (busy: above the CPU count, rerun on a quiet machine)" if is_busy() else ""
    print(f"load avg (1 min) at the end: {load_average()}{busy}")


if __name__ == "__main__":
    main()
