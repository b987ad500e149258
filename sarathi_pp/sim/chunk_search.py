"""``sarathi-pp plan --simulate``: the chunk size that maximizes throughput under a TBT SLO,
found by simulating the workload with ``sarathi`` at each candidate chunk size (what
Sarathi-Serve did with Vidur). Small chunks keep every micro-batch short (low TBT) but
run the matmuls on few rows; large ones the reverse."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sarathi_pp.bench.workload import Workload
from sarathi_pp.config import EngineConfig
from sarathi_pp.sim.setup import SimSetup, build_cluster

DEFAULT_CHUNK_SIZES = (128, 256, 384, 512, 768, 1024, 1536, 2048)


@dataclass(frozen=True, slots=True)
class ChunkProbe:
    chunk_size: int
    tokens_per_s: float
    tbt_p99_s: float
    ttft_p50_s: float
    meets_slo: bool


@dataclass(frozen=True)
class ChunkSearch:
    probes: tuple[ChunkProbe, ...]
    slo_tbt_p99_s: float

    @property
    def best(self) -> ChunkProbe | None:
        """The highest throughput among the chunk sizes meeting the SLO (None: none does)."""
        ok = [p for p in self.probes if p.meets_slo]
        return max(ok, key=lambda p: p.tokens_per_s, default=None)

    def lines(self) -> list[str]:
        out = [f"{'chunk':>6} {'tokens/s':>10} {'TBT p99 ms':>11} {'TTFT p50 ms':>12}  SLO"]
        for p in self.probes:
            mark = "ok" if p.meets_slo else "no"
            out.append(
                f"{p.chunk_size:>6} {p.tokens_per_s:>10.1f} {p.tbt_p99_s * 1e3:>11.2f} "
                f"{p.ttft_p50_s * 1e3:>12.2f}  {mark}"
            )
        b = self.best
        limit = f"TBT p99 <= {self.slo_tbt_p99_s * 1e3:.1f} ms"
        out.append(
            f"best: chunk_size {b.chunk_size} ({b.tokens_per_s:.1f} tokens/s, {limit})"
            if b
            else f"no chunk size meets {limit}: use the smallest, lower the load or add GPUs"
        )
        return out


def search_chunk_size(
    config: EngineConfig,
    workload: Workload,
    setup: SimSetup,
    slo_tbt_p99_s: float,
    chunk_sizes: tuple[int, ...] = DEFAULT_CHUNK_SIZES,
    run_dir: Path | None = None,
) -> ChunkSearch:
    """Simulate ``workload`` with ``sarathi`` at every chunk size (each its own cluster, so
    no run leaves state for the next); run dirs under ``run_dir/chunk-<n>/`` if given."""
    if not slo_tbt_p99_s > 0:
        raise ValueError(f"--slo-tbt-p99 must be > 0 seconds, got {slo_tbt_p99_s!r}")
    if not chunk_sizes or min(chunk_sizes) < 1:
        raise ValueError(f"chunk sizes must be integers >= 1, got {chunk_sizes!r}")
    probes = []
    for c in chunk_sizes:
        cluster = build_cluster(config.replace(scheduler="sarathi", chunk_size=c), setup)
        try:
            requests = workload.requests(cluster.spec.vocab_size, cluster.max_model_len)
            d = (run_dir or Path(".")) / f"chunk-{c}"
            summary = _serve(cluster, requests, d if run_dir else None)
        finally:
            cluster.shutdown()
        r = summary
        probes.append(
            ChunkProbe(c, r["generated_tokens_per_s"], r["tbt_s"]["p99"], r["ttft_s"]["p50"],
                       r["tbt_s"]["p99"] <= slo_tbt_p99_s)
        )  # fmt: skip
    return ChunkSearch(tuple(probes), slo_tbt_p99_s)


def _serve(cluster: Any, requests: list, run_dir: Path | None) -> dict[str, Any]:
    """The requests summary of one probe (its records in ``run_dir``, or a temporary one)."""
    if run_dir is not None:
        return cluster.serve_run(requests, run_dir)["requests"]
    with tempfile.TemporaryDirectory() as tmp:
        return cluster.serve_run(requests, Path(tmp) / "run")["requests"]
