"""Attention over the paged KV cache, one layer, in one process: the portable path (gather
the context into a buffer, then SDPA) vs the in-place C kernels
(``sarathi_pp.stages.kernels.cpu.paged_attention``). Decodes against the bandwidth floor of reading that
layer's K/V once at the copy rate measured in the same run; a prefill chunk over its cached
prefix (``--prefill``) in GFLOP/s against the matmul rate measured in the same run.

Shapes default to one layer of the embedded model (16 heads, 4 KV heads, head_dim 64,
float32); block tables are shuffled (blocks scattered over the cache, as after many frees).
The two paths run interleaved, best of ``--repeats``: compare their ratio. Run from the
repository root: ``python benchmarks/paged_attention.py [--decodes 32] [--context 1024]
[--prefill 256]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py

import torch  # noqa: E402
from common import (  # noqa: E402
    add_threads_flag,
    copy_gbps,
    describe_rates,
    load_average,
    machine_line,
    matmul_rates,
    set_threads,
)
from results import Run, add_record_flag  # noqa: E402

from sarathi_pp.stages.kernels.cpu.paged_attention import kernel_threads, load_kernel, load_prefill  # noqa: E402
from sarathi_pp.stages.model.attention import (  # noqa: E402
    ATTENTION_BACKENDS,
    AttentionMetadata,
    PrefillSlice,
)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decodes", type=int, default=32)
    p.add_argument("--context", type=int, default=1024, help="tokens cached per decode")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument(
        "--prefill",
        type=int,
        default=256,
        help="then a prefill chunk of this many tokens after --context cached ones (0: none)",
    )
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--quick", action="store_true", help="8 decodes x 256 context, prefill 64")
    add_threads_flag(p)
    add_record_flag(p)
    args = p.parse_args(argv)
    if args.quick:
        args.decodes, args.context, args.prefill, args.repeats = 8, 256, 64, 5
    run = Run("paged_attention", argv, quick=args.quick, enabled=not args.no_record)
    print(machine_line(set_threads(args.threads)))
    if load_kernel() is None:
        raise SystemExit("error: the C kernel did not build (see the warning above)")
    print(f"kernel threads: {kernel_threads()}")
    run.settings.update(
        heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
        block_size=args.block_size, repeats=args.repeats, kernel_threads=kernel_threads(),
    )  # fmt: skip
    bs, n = args.block_size, args.decodes
    per_seq = -(-(args.context + 1) // bs)
    num_blocks = 2 * n * per_seq  # half of the cache unused, as a real cache mostly is
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = (
        torch.randn(num_blocks * bs, args.kv_heads, args.head_dim, generator=g) for _ in range(2)
    )
    tables = torch.randperm(num_blocks, generator=g)[: n * per_seq].view(n, per_seq)
    lens = torch.full((n,), args.context + 1)
    meta = AttentionMetadata(
        positions=lens - 1,
        slot_mapping=torch.empty(0, dtype=torch.long),
        num_prefill_tokens=0,
        prefills=[],
        decode_blocks=tables,
        decode_mask=(torch.arange(per_seq * bs) < lens[:, None])[:, None, None],
        decode_lens=lens,
        block_size=bs,
    )
    q = torch.randn(n, args.heads, args.head_dim, generator=g)
    paths = {
        name: ATTENTION_BACKENDS[name](args.heads, args.kv_heads, args.head_dim)
        for name in ("torch", "cpu_paged")
    }
    gbps = copy_gbps()
    best = {name: float("inf") for name in paths}
    for _ in range(args.repeats + 1):
        for name, attn in paths.items():
            t0 = time.perf_counter()
            attn._decode(q, k_cache, v_cache, meta)
            best[name] = min(best[name], time.perf_counter() - t0)
    kv_bytes = 2 * n * (args.context + 1) * args.kv_heads * args.head_dim * 4  # 2: K, V
    floor = kv_bytes / (gbps * 1e9)
    print(
        f"{n} decodes x {args.context} context, block size {bs}, shuffled tables: K/V "
        f"{kv_bytes / 1e6:.0f} MB; copy rate {gbps:.1f} GB/s (read + write) -> floor {floor * 1e3:.2f} ms"
    )
    for name, t in best.items():
        print(f"  {name:<10} {t * 1e3:8.2f} ms  {t / floor:6.1f}x the floor")
    print(f"  in place / gather + SDPA: {best['cpu_paged'] / best['torch']:.2f}")
    shape = f"{n} decodes x {args.context} context"
    run.measure(
        f"decode attention, {shape}", best["cpu_paged"] * 1e3, "ms",
        baseline=best["torch"] * 1e3, baseline_label="gather + SDPA", better="lower",
        headline="paged decode attention, in place / gather + SDPA",
    )  # fmt: skip
    run.measure(
        f"decode attention over its K/V bandwidth floor, {shape}", best["cpu_paged"] / floor,
        "x", better="lower", detail=f"floor {floor * 1e3:.2f} ms at {gbps:.1f} GB/s copy rate",
    )  # fmt: skip
    if args.prefill > 0:
        prefill(args, paths, k_cache, v_cache, g, run)
    print(f"load avg (1 min) at the end: {load_average()}")
    run.note("One layer, float32, shuffled block tables; the two paths interleaved, best of "
             "--repeats each.")  # fmt: skip
    run.write()


def prefill(args, paths, k_cache, v_cache, g, run: Run) -> None:
    """One chunk of ``--prefill`` tokens at position ``--context`` over its shuffled blocks."""
    bs, start, n = args.block_size, args.context, args.prefill
    if load_prefill() is None:
        print("prefill: no in-place kernel on this CPU (it needs AVX-512 or AVX2 + FMA)")
        return
    need = -(-(start + n) // bs)
    if need > k_cache.shape[0] // bs:
        raise SystemExit(f"error: --context + --prefill needs {need} blocks; raise --decodes")
    chunk = PrefillSlice(0, n, start, torch.randperm(k_cache.shape[0] // bs, generator=g)[:need])
    q, k, v = (
        torch.randn(n, h, args.head_dim, generator=g)
        for h in (args.heads, args.kv_heads, args.kv_heads)
    )
    rates = matmul_rates()
    best = {name: float("inf") for name in paths}
    for _ in range(args.repeats + 1):
        for name, attn in paths.items():
            t0 = time.perf_counter()
            attn._prefill(q, k, v, k_cache, v_cache, chunk, bs)
            best[name] = min(best[name], time.perf_counter() - t0)
    # each token attends to pos + 1 keys: QK^T and PV, 2 FLOPs per multiply-add
    flops = 4 * (n * start + n * (n + 1) // 2) * args.heads * args.head_dim
    peak = max(rates.values())
    print(
        f"prefill chunk of {n} tokens at [{start}, {start + n}), block size {bs}, shuffled: "
        f"{flops / 1e9:.2f} GFLOP; matmul rate {describe_rates(rates)}"
    )
    for name, t in best.items():
        rate = flops / t / 1e9
        print(f"  {name:<10} {t * 1e3:8.2f} ms  {rate:6.1f} GFLOP/s  {rate / peak:6.1%} of it")
    print(f"  in place / gather + SDPA: {best['cpu_paged'] / best['torch']:.2f}")
    run.measure(
        f"prefill attention, {n} tokens after {start}", flops / best["cpu_paged"] / 1e9,
        "GFLOP/s", baseline=flops / best["torch"] / 1e9, baseline_label="gather + SDPA",
        better="higher", detail=f"{flops / best['cpu_paged'] / 1e9 / peak:.1%} of the matmul rate",
    )  # fmt: skip


if __name__ == "__main__":
    main()
