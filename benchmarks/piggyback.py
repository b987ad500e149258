"""Are piggybacked decodes nearly free? (SARATHI, arXiv 2308.16369, section 4.2.)

A decode-only step of N tokens streams every weight matrix once to do N rows of work: with
small N it is bound by memory bandwidth, so its cost per decode token is high. In a hybrid
step the same N decode rows ride along with a prefill chunk (SARATHI's decode-maximal
batching): the weights are streamed once for ``chunk + N`` rows, and the extra cost of
the N decodes is only their share of the matmul arithmetic plus their attention.

This script times, on the embedded default model and through ``ModelRunner.execute`` (the
exact path the engine uses: micro-batch -> metadata -> model -> sampler), three micro-batches:

* decode-only: N decodes, each with ``--decode-context`` tokens already in its KV cache;
* prefill-only: one prefill chunk of ``--chunk-size`` tokens at positions
  ``[--prefill-offset, --prefill-offset + --chunk-size)`` of a prompt whose first
  ``--prefill-offset`` tokens are already cached (a middle chunk of a chunked prefill);
* hybrid: that prefill chunk plus the same N decodes, in one micro-batch.

and prints, for each N, the cost per decode token in a decode-only step (time / N) and when
piggybacked ((hybrid - prefill-only) / N), and their ratio. The KV caches are filled first
(prefill micro-batches for every context), so attention reads real data. Each figure is the median
of ``--repeats`` runs after ``--warmup`` runs; the three kinds of steps are interleaved
within each repeat, so a slow spell on a shared machine hits them alike. Compare the
ratios, not the absolute times.

Run from the repository root: ``python benchmarks/piggyback.py [--quick]``.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py

from common import (  # noqa: E402
    add_threads_flag,
    copy_gbps,
    describe_rates,
    floor_s,
    is_busy,
    load_average,
    machine_line,
    matmul_rates,
    median,
    microbatch_flops,
    parse_int_list,
    random_prompts,
    set_threads,
    step_bytes,
    time_once,
)
from results import Run, add_record_flag  # noqa: E402

from sarathi_pp import LLM, SamplingParams  # noqa: E402
from sarathi_pp.microbatch import MicroBatch, ScheduledChunk  # noqa: E402
from sarathi_pp.model_spec import ModelSpec  # noqa: E402
from sarathi_pp.stages.kernels.cpu.paged_attention import kernel_threads  # noqa: E402
from sarathi_pp.stages.worker.model_runner import ModelRunner  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
QUICK = {
    "decodes": [1, 4],
    "chunk_size": 32,
    "prefill_offset": 32,
    "decode_context": 64,
    "num_blocks": 128,
    "repeats": 3,
    "warmup": 1,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny-llama.yaml", help="engine YAML config")
    p.add_argument(
        "--decodes", type=parse_int_list, default=[1, 4, 16], help="values of N, e.g. 1,4,16"
    )
    p.add_argument("--chunk-size", type=int, default=256, help="prefill chunk tokens")
    p.add_argument(
        "--prefill-offset", type=int, default=256, help="prompt tokens cached before the chunk"
    )
    p.add_argument(
        "--decode-context", type=int, default=512, help="tokens cached per decode sequence"
    )
    p.add_argument("--num-blocks", type=int, default=1024, help="KV cache blocks")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per step (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per step first")
    p.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    p.add_argument("--quick", action="store_true", help="small sizes: checks the script in < 60 s")
    add_threads_flag(p)
    add_record_flag(p)
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    for name in ("chunk_size", "decode_context", "num_blocks", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


@dataclass(frozen=True)
class Workload:
    """The chunks the timed micro-batches are made of (the KV caches behind them are filled)."""

    prefill: ScheduledChunk  # the middle chunk of seq 0's prompt
    decodes: tuple[ScheduledChunk, ...]  # one decode per sequence 1..max(N)


class BlockAllocator:
    """Hands out disjoint, consecutive block ids, so no two sequences share a KV slot."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.next_block = 0

    def table(self, num_tokens: int) -> tuple[int, ...]:
        n = -(-num_tokens // self.block_size)  # ceil
        if self.next_block + n > self.num_blocks:
            raise SystemExit(
                f"--num-blocks {self.num_blocks} is too small: the workload needs more than "
                f"{self.next_block + n} blocks of {self.block_size} tokens"
            )
        start, self.next_block = self.next_block, self.next_block + n
        return tuple(range(start, start + n))


def fill_kv(
    worker: ModelRunner, seq_id: int, tokens: list[int], table: tuple[int, ...], chunk: int
) -> None:
    """Run prefill micro-batches over ``tokens`` (in chunks of ``chunk``) so their K/V is cached."""
    for start in range(0, len(tokens), chunk):
        piece = ScheduledChunk(seq_id, start, tuple(tokens[start : start + chunk]), True, table)
        worker.execute(MicroBatch(0, (piece,)))


def build_workload(worker: ModelRunner, args: argparse.Namespace, block_size: int) -> Workload:
    vocab = worker.spec.vocab_size
    alloc = BlockAllocator(args.num_blocks, block_size)
    prompt_len = args.prefill_offset + args.chunk_size
    prompt = random_prompts([prompt_len], vocab, args.seed)[0]
    table = alloc.table(prompt_len)
    fill_kv(worker, 0, prompt[: args.prefill_offset], table, args.chunk_size)
    prefill = ScheduledChunk(
        0, args.prefill_offset, tuple(prompt[args.prefill_offset :]), True, table
    )
    contexts = random_prompts([args.decode_context + 1] * max(args.decodes), vocab, args.seed + 1)
    decodes = []
    for seq_id, tokens in enumerate(contexts, start=1):
        table = alloc.table(args.decode_context + 1)  # + 1: the decode token's own slot
        fill_kv(worker, seq_id, tokens[:-1], table, args.chunk_size)
        decodes.append(
            ScheduledChunk(seq_id, args.decode_context, (tokens[-1],), False, table, GREEDY, 1)
        )
    return Workload(prefill, tuple(decodes))


def make_microbatches(work: Workload, decode_counts: list[int]) -> dict[str, MicroBatch]:
    """``prefill`` plus ``decode N`` and ``hybrid N`` for every N."""
    ids = itertools.count(1)
    microbatches = {"prefill": MicroBatch(next(ids), (work.prefill,))}
    for n in decode_counts:
        microbatches[f"decode {n}"] = MicroBatch(next(ids), work.decodes[:n])
        microbatches[f"hybrid {n}"] = MicroBatch(next(ids), (work.prefill, *work.decodes[:n]))
    return microbatches


def measure(
    worker: ModelRunner, microbatches: dict[str, MicroBatch], warmup: int, repeats: int
) -> dict[str, float]:
    """Median seconds per micro-batch; every repeat runs all micro-batches once, interleaved.

    Re-running a micro-batch rewrites the same K/V to the same slots, so the cache stays valid."""
    times: dict[str, list[float]] = {name: [] for name in microbatches}
    for r in range(warmup + repeats):
        for name, microbatch in microbatches.items():
            t = time_once(lambda microbatch=microbatch: worker.execute(microbatch))
            if r >= warmup:
                times[name].append(t)
    return {name: median(ts) for name, ts in times.items()}


def record(run: Run, t: dict[str, float], decode_counts: list[int], chunk_size: int) -> None:
    """Per N: a decode token's cost piggybacked against alone (the table's ratio); the
    largest N is the headline."""
    prefill = t["prefill"]
    for n in decode_counts:
        run.measure(
            f"decode token cost piggybacked, N={n}", (t[f"hybrid {n}"] - prefill) / n * 1e3,
            "ms", baseline=t[f"decode {n}"] / n * 1e3, baseline_label="in a decode-only step",
            better="lower",
            headline="piggybacked decode token, cost vs alone" if n == max(decode_counts) else None,
        )  # fmt: skip
    run.measure("prefill-only step, per prefill token", prefill / chunk_size * 1e3, "ms",
                better="lower")  # fmt: skip


def print_table(t: dict[str, float], decode_counts: list[int]) -> None:
    ms = 1e3
    print(
        f"{'N':>4} {'decode-only':>12} {'per decode':>11} {'hybrid':>9} {'prefill-only':>13} "
        f"{'piggybacked':>12} {'ratio':>7}"
    )
    print(
        f"{'':>4} {'step ms':>12} {'tok ms':>11} {'step ms':>9} {'step ms':>13} {'per tok ms':>12} {'':>7}"
    )
    prefill = t["prefill"]
    for n in decode_counts:
        decode, hybrid = t[f"decode {n}"], t[f"hybrid {n}"]
        per_decode = decode / n
        piggy = (hybrid - prefill) / n
        print(
            f"{n:>4} {decode * ms:>12.2f} {per_decode * ms:>11.2f} {hybrid * ms:>9.2f} "
            f"{prefill * ms:>13.2f} {piggy * ms:>12.2f} {piggy / per_decode:>7.3f}"
        )
    print(
        "ratio = piggybacked / decode-only cost per decode token (<< 1: piggybacked decodes "
        "are nearly free)."
    )


def print_floors(
    t: dict[str, float],
    microbatches: dict[str, MicroBatch],
    spec: ModelSpec,
    dtype: str,
    rates: tuple[dict[str, float], float],
) -> None:
    """Each step against its floors (``common.floor_s``): the compute floor at the matmul rate
    and the bandwidth floor at the copy rate, both measured in this run."""
    matmul, gbps = rates
    gflops = max(matmul.values())
    print(
        f"floors: matmul {describe_rates(matmul)}, copy {gbps:.1f} GB/s (read + write), "
        "both measured in this run"
    )
    print(
        f"{'step':<12} {'ms':>9} {'GFLOP':>7} {'compute':>8} {'MB read':>8} {'bandwidth':>10} "
        f"{'step /':>7} {'of matmul':>10}"
    )
    print(
        f"{'':<12} {'':>9} {'':>7} {'floor ms':>8} {'':>8} {'floor ms':>10} {'floor':>7} {'rate':>10}"
    )
    for name, microbatch in microbatches.items():
        flops = microbatch_flops(spec, microbatch)
        nbytes = step_bytes(spec, dtype, microbatch)
        compute, bandwidth = floor_s(flops, nbytes, gflops, gbps)
        step = t[name]
        print(
            f"{name:<12} {step * 1e3:>9.2f} {flops / 1e9:>7.2f} {compute * 1e3:>8.2f} "
            f"{nbytes / 1e6:>8.0f} {bandwidth * 1e3:>10.2f} {step / max(compute, bandwidth):>6.2f}x "
            f"{compute / step:>10.1%}"
        )
    print(
        "step / floor = step time over the larger floor (1.00x: at the floor); of matmul rate = "
        "the step's FLOP/s over the matmul rate."
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run = Run("piggyback", argv, quick=args.quick, enabled=not args.no_record)
    num_threads = set_threads(args.threads)
    llm = LLM.from_config(args.config, num_kv_blocks=args.num_blocks)
    engine = llm.engine
    worker = engine.executor.runner
    print(machine_line(num_threads))
    print(
        f"model: {engine.model_dir} ({engine.spec.num_params() / 1e6:.0f}M params, "
        f"{worker.stage.dtype}, {worker.device}); block size {engine.block_size}, "
        f"{args.num_blocks} KV blocks"
    )
    print(
        f"prefill chunk: {args.chunk_size} tokens at [{args.prefill_offset}, "
        f"{args.prefill_offset + args.chunk_size}); each decode: {args.decode_context} tokens cached; "
        f"median of {args.repeats} runs after {args.warmup} warm-up"
    )
    work = build_workload(worker, args, engine.block_size)
    rates = (matmul_rates(), copy_gbps())
    microbatches = make_microbatches(work, args.decodes)
    times = measure(worker, microbatches, args.warmup, args.repeats)
    threads = f" (kernel threads: {kernel_threads()})" if worker.backend == "cpu_paged" else ""
    print(
        f"attention backend: {worker.backend}{threads}; element-wise ops: {worker.model.ops.name}"
    )
    print(f"prefill-only: {times['prefill'] / args.chunk_size * 1e3:.3f} ms per prefill token")
    print_table(times, args.decodes)
    print_floors(times, microbatches, engine.spec, worker.stage.dtype, rates)
    busy = " (busy: above the CPU count, rerun on a quiet machine)" if is_busy() else ""
    print(f"load avg (1 min) at the end: {load_average()}{busy}")
    run.settings.update(
        config=args.config, chunk_size=args.chunk_size, prefill_offset=args.prefill_offset,
        decode_context=args.decode_context, repeats=args.repeats, threads=num_threads,
        backend=worker.backend,
    )  # fmt: skip
    record(run, times, args.decodes, args.chunk_size)
    run.note("Medians of --repeats interleaved runs through ModelRunner.execute; ratio << 1: "
             "piggybacked decodes are nearly free. hybrid - prefill-only is small against both, "
             "so on a busy machine the ratio swings, most at N=1.")  # fmt: skip
    run.write()
    llm.shutdown()


if __name__ == "__main__":
    main()
