"""``benchmarks/vs_vllm.py``'s record: ours over vLLM's per PP size, and the agreement."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from results import Run  # noqa: E402
from vs_vllm import record  # noqa: E402


def test_record_gives_ratios_and_agreement():
    def reqs(tps: float, ttft: float, tbt: float) -> dict:
        return {"generated_tokens_per_s": tps, "ttft_s": {"p50": ttft}, "tbt_s": {"p99": tbt}}

    comparison = {
        "runs": [
            {"name": "sarathi", "requests": reqs(30.0, 2.0, 0.1)},
            {"name": "peer-vllm", "requests": reqs(20.0, 1.0, 0.2), "note": "vLLM 0.32.0",
             "token_agreement": {"num_identical": 31, "num_compared": 32}},
        ]
    }  # fmt: skip
    run = Run("vs_vllm", [], enabled=False)
    record(run, 2, comparison)
    by_name = {m["name"]: m for m in run.measures}
    assert by_name["generated tokens/s, PP=2"]["ratio"] == 1.5
    assert by_name["generated tokens/s, PP=2"]["headline"] == "throughput vs vLLM (PP=2)"
    assert by_name["TTFT p50, PP=2"]["ratio"] == 2.0
    agreement = by_name["requests identical to vLLM token for token, PP=2"]
    assert (agreement["value"], agreement["unit"]) == (31, "of 32")
