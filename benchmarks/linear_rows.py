"""Small-row matmuls on CPU: ``F.linear`` (MKL) vs oneDNN with a prepacked weight
(``sarathi_pp.stages.linear.Linear``), on the embedded model's weight shapes.

A decode-only step multiplies a few rows ``[num_decodes, hidden]`` by every weight; a prefill
chunk many. This prints, per weight and row count, the best of ``--repeats`` interleaved
runs of each path and their ratio. Run from the repository root:
``python benchmarks/linear_rows.py [--threads N]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import add_threads_flag, load_average, machine_line, parse_int_list, set_threads  # noqa: E402

from sarathi_pp.stages.linear import Linear  # noqa: E402

SHAPES = {"qkv": (1536, 1024), "o": (1024, 1024), "gate_up": (5632, 1024), "down": (1024, 2816)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=parse_int_list, default=[1, 4, 8, 16, 32, 64, 256, 512])
    p.add_argument("--repeats", type=int, default=12)
    add_threads_flag(p)
    args = p.parse_args(argv)
    print(machine_line(set_threads(args.threads)))
    print(f"{'weight':<8} {'rows':>5} {'F.linear ms':>12} {'oneDNN ms':>10} {'speed-up':>9}")
    for name, shape in SHAPES.items():
        w = torch.randn(*shape)
        packed = Linear(w)
        if not packed.is_packed:
            raise SystemExit("oneDNN is unavailable (or SARATHI_PP_ONEDNN_LINEAR=0)")
        for rows in args.rows:
            x = torch.randn(rows, shape[1])
            best = {"mkl": float("inf"), "dnn": float("inf")}
            for _ in range(args.repeats + 2):  # interleaved: a slow spell hits both alike
                t0 = time.perf_counter()
                F.linear(x, w)
                t1 = time.perf_counter()
                packed(x)
                t2 = time.perf_counter()
                best["mkl"], best["dnn"] = min(best["mkl"], t1 - t0), min(best["dnn"], t2 - t1)
            print(
                f"{name:<8} {rows:>5} {best['mkl'] * 1e3:>12.2f} {best['dnn'] * 1e3:>10.2f} "
                f"{best['mkl'] / best['dnn']:>8.2f}x"
            )
    print(f"load avg (1 min) at the end: {load_average()}")


if __name__ == "__main__":
    main()
