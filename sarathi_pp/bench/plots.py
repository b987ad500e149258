"""CDF plots of the serving benchmark: TBT (every inter-token gap, pooled) and TTFT per run.

One PNG per metric, one line per run (scheduler or peer), so the tails compare at a glance.
matplotlib with the Agg backend (no display needed).
"""

from __future__ import annotations

from pathlib import Path

from sarathi_pp.records.run_dir import TBT_CDF_FILE, TTFT_CDF_FILE
from sarathi_pp.report.request_metrics import RequestRow, tbt_pool


def metric_values(rows: list[RequestRow]) -> dict[str, list[float]]:
    """``{"tbt": [...], "ttft": [...]}`` in seconds, for one run."""
    tbt, _ = tbt_pool(rows)
    return {"tbt": tbt, "ttft": [r.ttft_s for r in rows if r.ttft_s is not None]}


def draw_cdfs(runs: dict[str, list[RequestRow]], out_dir: Path, title: str = "") -> list[Path]:
    """Write ``tbt_cdf.png`` and ``ttft_cdf.png`` into ``out_dir``; the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = {name: metric_values(rows) for name, rows in runs.items()}
    written = []
    for key, filename, label in (
        ("tbt", TBT_CDF_FILE, "time between tokens (ms)"),
        ("ttft", TTFT_CDF_FILE, "time to first token (s)"),
    ):
        scale = 1e3 if key == "tbt" else 1.0
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, v in values.items():
            xs = sorted(x * scale for x in v[key])
            if not xs:
                continue
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", label=f"{name} (n={len(xs)})")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction ≤ x")
        ax.set_ylim(0, 1.01)
        if key == "tbt":
            ax.set_xscale("log")
        ax.axhline(0.99, color="grey", lw=0.6, ls=":")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        ax.set_title(f"{key.upper()} CDF" + (f"\n{title}" if title else ""), fontsize=9)
        fig.tight_layout()
        path = out_dir / filename
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
