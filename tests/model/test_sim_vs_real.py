"""The simulator runs the engine's own scheduling: with the profiled model at PP=1 and every
request present at t=0, its micro-batches are those of a real run, one for one."""

from __future__ import annotations

from pathlib import Path

import pytest

from sarathi_pp.bench.runner import serve_run
from sarathi_pp.bench.workload import workload_from_dict
from sarathi_pp.config import make_config
from sarathi_pp.engine import LLMEngine
from sarathi_pp.planner.profile_csv import ProfileRow, write_profile
from sarathi_pp.report import load_log
from sarathi_pp.sim.setup import SimSetup, build_cluster


def issued(run_dir: Path) -> list[tuple[str, int, int]]:
    log = load_log(run_dir / "events.jsonl")
    return [(i.kind, i.num_prefill_tokens, i.num_decode_tokens) for i in log.issues]


@pytest.mark.parametrize("policy", ["sarathi", "orca"])
def test_simulated_microbatches_equal_a_real_runs(llama_dir: Path, tmp_path: Path, policy: str):
    workload = workload_from_dict(
        {"num_requests": 6, "seed": 3, "prompt_tokens": {"choice": [20, 70, 150]},
         "output_tokens": {"choice": [3, 9]}}
    )  # fmt: skip
    config = make_config(
        model=str(llama_dir), scheduler=policy, chunk_size=64, tile_align=False,
        num_kv_blocks=64, block_size=8, device="cpu", dtype="float32",
    )  # fmt: skip
    engine = LLMEngine(config)
    try:
        requests = workload.requests(engine.spec.vocab_size, engine.max_model_len)
        serve_run(engine, requests, tmp_path / "real")
    finally:
        engine.shutdown()
    csv = tmp_path / "profile.csv"
    write_profile(
        csv, [ProfileRow(0, p, d, 0, 1e-3 + 1e-5 * (p + d)) for p in (0, 64) for d in (1, 8)]
    )
    cluster = build_cluster(config, SimSetup(profile=csv))
    cluster.serve_run(requests, tmp_path / "sim")
    real, sim = issued(tmp_path / "real"), issued(tmp_path / "sim")
    assert len(real) > 6 and sim == real
