"""Small-row matmuls on CPU: every kind of ``sarathi_pp.stages.model.linear.Linear`` that runs here
(``f_linear``: MKL through F.linear; ``onednn``: a prepacked oneDNN weight; ``panel_gemm``: our
packed C kernel), on the embedded model's weight shapes.

A decode-only step multiplies a few rows ``[num_decodes, hidden]`` by every weight; a prefill
chunk many. This prints, per weight and row count, the best of ``--repeats`` interleaved
runs of each kind (ms), the best kind, and each kind's time over the best, plus the rows' FLOP
rate of the best kind. Run from the repository root:
``python benchmarks/linear_rows.py [--rows 1,8,32] [--threads N] [--quick]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py

import torch  # noqa: E402
from common import add_threads_flag, load_average, machine_line, parse_int_list, set_threads  # noqa: E402
from results import Run, add_record_flag  # noqa: E402

from sarathi_pp.stages.model.linear import Linear, available_kinds, choose_kind  # noqa: E402

SHAPES = {"qkv": (1536, 1024), "o": (1024, 1024), "gate_up": (5632, 1024), "down": (1024, 2816)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=parse_int_list, default=[1, 4, 8, 16, 32, 64, 256, 512])
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--quick", action="store_true", help="rows 1,8,64, 3 repeats: a few seconds")
    add_threads_flag(p)
    add_record_flag(p)
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.repeats = [1, 8, 64], 3
    run = Run("linear_rows", argv, quick=args.quick, enabled=not args.no_record)
    print(machine_line(set_threads(args.threads)))
    kinds = available_kinds()
    run.settings.update(kinds=kinds, repeats=args.repeats, threads=torch.get_num_threads())
    print(
        f"kinds that run here: {', '.join(kinds)}; chosen: {choose_kind(torch.randn(1024, 1024))}"
    )
    head = " ".join(f"{k + ' ms':>14}" for k in kinds)
    print(f"{'weight':<8} {'rows':>5} {head}  {'best':>10} {'GFLOP/s':>8}  others / best")
    for name, shape in SHAPES.items():
        w = torch.randn(*shape)
        linears = {kind: Linear(w, kind=kind) for kind in kinds}
        for rows in args.rows:
            x = torch.randn(rows, shape[1])
            best = dict.fromkeys(kinds, float("inf"))
            for _ in range(args.repeats + 2):  # interleaved: a slow spell hits all alike
                for kind, lin in linears.items():
                    t0 = time.perf_counter()
                    lin(x)
                    best[kind] = min(best[kind], time.perf_counter() - t0)
            winner = min(best, key=best.__getitem__)
            times = " ".join(f"{best[k] * 1e3:>14.3f}" for k in kinds)
            gflops = 2 * rows * shape[0] * shape[1] / best[winner] / 1e9
            ratios = ", ".join(f"{k} {best[k] / best[winner]:.2f}x" for k in kinds if k != winner)
            print(f"{name:<8} {rows:>5} {times}  {winner:>10} {gflops:>8.1f}  {ratios}")
            run.measure(
                f"{name} {shape[0]}x{shape[1]}, {rows} rows: best kind",
                best[winner] * 1e3,
                "ms",
                baseline=best["f_linear"] * 1e3 if "f_linear" in best else None,
                baseline_label="f_linear (MKL)",
                better="lower",
                detail=f"{winner}, {gflops:.1f} GFLOP/s",
            )
    print(f"load avg (1 min) at the end: {load_average()}")
    run.note(
        "Best of --repeats interleaved runs per kind; ratio < 1: the best kind beats F.linear."
    )
    run.write()


if __name__ == "__main__":
    main()
