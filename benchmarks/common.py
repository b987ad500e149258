"""Helpers shared by the benchmark scripts: threads, machine description, timing, workloads,
FLOPs.

Not part of the package: the scripts run from the repository root
(``python benchmarks/piggyback.py``), and this module sits next to them.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from collections.abc import Callable

import torch

from sarathi_pp.bench.workload import Workload, load_workload
from sarathi_pp.microbatch import MicroBatch
from sarathi_pp.model_spec import DTYPE_BYTES, ModelSpec
from sarathi_pp.stages.model.linear import Linear, available_kinds


def parse_int_list(text: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]`` (argparse ``type=``)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def add_threads_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)"
    )


def set_threads(num_threads: int | None) -> int:
    """Apply ``--threads`` (if given); returns the thread count torch will use."""
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"--threads must be >= 1, got {num_threads}")
        torch.set_num_threads(num_threads)
    return torch.get_num_threads()


def _cpu_model() -> str:
    """The CPU's model name: ``platform.processor()`` is often empty or just ``x86_64`` on Linux."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> str:
    """The 1-minute load average (above the core count: other processes compete)."""
    return f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "n/a"


def is_busy() -> bool:
    """True when the 1-minute load average exceeds the number of CPUs."""
    return hasattr(os, "getloadavg") and os.getloadavg()[0] > (os.cpu_count() or 1)


def machine_line(num_threads: int) -> str:
    load = f" load avg (1 min) {load_average()}"
    return (
        f"machine: {_cpu_model()} ({platform.processor() or platform.machine()}), "
        f"{os.cpu_count()} logical CPUs, torch {torch.__version__}, "
        f"torch threads {num_threads};{load}"
    )


def machine_info() -> dict[str, object]:
    """The machine as a results record keeps it (``results.Run``): what ``machine_line``
    prints, as fields, and the GPU if torch sees one."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu": _cpu_model(),
        "arch": platform.machine(),
        "logical_cpus": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "gpu": gpu,
        "num_gpus": torch.cuda.device_count() if gpu else 0,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def time_once(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes (``time.perf_counter``; CPU work is synchronous)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median(values: list[float]) -> float:
    return statistics.median(values)


def random_prompts(lengths: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    """One list of random token ids per length, from ``seed``."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def load_args_workload(args: argparse.Namespace, default: str, quick: str) -> Workload:
    """The workload of ``--workload`` (or ``default``, or ``quick`` under ``--quick``), at
    most ``--num-requests``; refuses arrival times: ``generate`` submits every request at
    once."""
    try:
        workload = load_workload(args.workload or (quick if args.quick else default))
        if args.num_requests is not None:
            workload = workload.with_num_requests(args.num_requests)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    if workload.arrivals.kind != "all_at_once":
        raise SystemExit(
            f"error: {workload.describe()}: this script submits every request at t=0; "
            "use an all_at_once workload (sarathi-pp bench replays arrival times)"
        )
    return workload


# --- model FLOPs -----------------------------------------------------------------------------
# Counted as in the SARATHI / PaLM MFU convention: a multiply-add is 2 FLOPs; elementwise ops
# (norms, rope, softmax, SiLU) are left out.
def linear_flops_per_token(spec: ModelSpec) -> int:
    """Every non-embedding weight is used once per token in a matmul: 2 x parameters."""
    return 2 * spec.num_layers * spec.layer_params()


def lm_head_flops(spec: ModelSpec) -> int:
    """One sampled row: [hidden] @ [hidden, vocab]."""
    return 2 * spec.hidden_size * spec.vocab_size


def attention_flops(spec: ModelSpec, context_len: int) -> int:
    """One query token attending to ``context_len`` keys, all layers: QK^T and PV are each
    2 x context x (heads x head_dim) FLOPs (GQA shares K/V but not the multiply-adds)."""
    q_dim = spec.num_heads * spec.head_dim
    return spec.num_layers * 2 * 2 * context_len * q_dim  # 2 matmuls (QK^T, PV), 2 FLOPs/MAC


def chunk_flops(spec: ModelSpec, start: int, num_tokens: int, num_sampled: int) -> int:
    """Tokens at positions ``[start, start + num_tokens)`` (each attends to ``pos + 1`` keys),
    of which ``num_sampled`` rows go through lm_head."""
    # sum of (pos + 1) for pos in [start, start + num_tokens)
    context_sum = num_tokens * start + num_tokens * (num_tokens + 1) // 2
    return (
        num_tokens * linear_flops_per_token(spec)
        + attention_flops(spec, context_sum)
        + num_sampled * lm_head_flops(spec)
    )


def _best_rate(fn: Callable[[], object], flops: int, seconds: float) -> float:
    """GFLOP/s of ``fn`` (``flops`` per call): the best of five bursts of ``seconds / 5``, a peak
    rate, the least disturbed by other processes."""
    for _ in range(3):  # warm-up: thread pool, allocator
        fn()
    best = 0.0
    for _ in range(5):
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 5:
            fn()
            reps += 1
        best = max(best, flops * reps / (time.perf_counter() - t0) / 1e9)
    return best


def matmul_rates(
    m: int = 256, k: int = 1024, n: int = 2816, seconds: float = 1.0
) -> dict[str, float]:
    """The machine's fp32 matmul rate in GFLOP/s by way of computing ``[m, k] @ [k, n]``:
    ``torch.mm`` (MKL) and every packed kind of ``sarathi_pp.stages.model.linear.Linear`` that runs
    here (the engine's own: on an AVX-512 EPYC, 2 threads, oneDNN's prepacked kernel ran 202
    GFLOP/s against MKL's 160, and the engine's steps ran above a floor taken from
    ``torch.mm`` alone). The best of them is the peak a compute floor is taken at. The
    default shape is one 256-row chunk through tiny-llama's gate projection."""
    a = torch.randn(m, k)
    b = torch.randn(k, n)
    rates = {"torch.mm": _best_rate(lambda: a @ b, 2 * m * k * n, seconds)}
    weight = b.t().contiguous()  # Linear computes x W^T with W [out, in]
    for kind in available_kinds():
        if kind != "f_linear":
            lin = Linear(weight.clone(), kind=kind)
            rates[kind] = _best_rate(lambda lin=lin: lin(a), 2 * m * k * n, seconds)
    return rates


def describe_rates(rates: dict[str, float]) -> str:
    """``"152.3 GFLOP/s (onednn; torch.mm 111.5)"``: the best rate, its kind, the others."""
    best = max(rates, key=rates.__getitem__)
    others = ", ".join(f"{kind} {r:.1f}" for kind, r in rates.items() if kind != best)
    return f"{rates[best]:.1f} GFLOP/s ({best}" + (f"; {others})" if others else ")")


# --- floors ----------------------------------------------------------------------------------
# A step can go no faster than its FLOPs at the measured matmul rate (compute floor), nor than
# the bytes it must move at the measured copy rate (bandwidth floor): the weights once, plus
# every chunk's K/V context once. Both rates are measured in the same run as the step times.
def copy_gbps(nbytes: int = 256 * 2**20, seconds: float = 1.0) -> float:
    """The machine's best multi-threaded memory rate in GB/s, bytes read + written: ``copy_``
    of ``nbytes`` (far above the caches) with torch's threads; the best of five bursts."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: page faults
    best = 0.0
    for _ in range(5):
        reps, t0 = 0, time.perf_counter()
        while reps < 2 or time.perf_counter() - t0 < seconds / 5:
            dst.copy_(src)
            reps += 1
        best = max(best, 2 * nbytes * reps / (time.perf_counter() - t0) / 1e9)  # 2: read + write
    return best


def step_bytes(spec: ModelSpec, dtype: str, microbatch: MicroBatch) -> int:
    """Bytes a step must read at least: every layer's weights once (the final norm and lm_head
    when it samples) + each chunk's K/V over its whole context (``end`` tokens)."""
    dtype_bytes = DTYPE_BYTES[dtype]
    weights = spec.num_layers * spec.layer_params()
    if any(c.do_sample for c in microbatch.chunks):
        weights += spec.hidden_size + spec.embedding_params()  # norm + lm_head
    kv = sum(c.end for c in microbatch.chunks) * spec.kv_bytes_per_token(spec.num_layers, dtype)
    return weights * dtype_bytes + kv


def microbatch_flops(spec: ModelSpec, microbatch: MicroBatch) -> int:
    return sum(
        chunk_flops(spec, c.start, c.num_tokens, int(c.do_sample)) for c in microbatch.chunks
    )


def floor_s(flops: int, nbytes: int, gflops: float, gbps: float) -> tuple[float, float]:
    """(compute floor, bandwidth floor) in seconds."""
    return flops / (gflops * 1e9), nbytes / (gbps * 1e9)


def add_scheduling_flags(
    p: argparse.ArgumentParser, runs: str = "", in_flight_of: str = "", in_flight_note: str = ""
) -> None:
    """The flags that run a benchmark at the library's defaults or at the rule before them:
    ``--microbatches-in-flight``, ``--balance/--no-balance`` and ``--prefill-pacing``.
    ``runs`` names the runs the last two apply to (``"both runs"``, say); ``in_flight_of``
    and ``in_flight_note`` start and end the in-flight help."""
    p.add_argument(
        "--microbatches-in-flight",
        type=in_flight_arg,
        default="auto",
        help=f"{in_flight_of}auto (the library's default: the stages), stages or a number (3 on "
        f"two stages: throughput first){in_flight_note}",
    )
    where = f" in {runs}" if runs else ""
    p.add_argument(
        "--balance",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"scheduler.balance_microbatches{where} (--no-balance: the rule before it)",
    )
    p.add_argument(
        "--prefill-pacing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help=f"scheduler.prefill_pacing{where} (off: the library's default)",
    )


def in_flight_arg(text: str) -> int | str | None:
    """``--microbatches-in-flight``: ``auto``, ``stages`` (null: the number of stages) or
    a number >= 1."""
    if text in ("auto", "stages"):
        return None if text == "stages" else text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"auto, stages or a number >= 1, got {text!r}")
    return value
