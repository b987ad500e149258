"""``sarathi-pp bench`` at PP=2 over Ray: every scheduler's run dir on the same stage actors
records both stages, and the online loop with arrivals gives the tokens of PP=1."""

from __future__ import annotations

import json

import yaml

from sarathi_pp import LLM
from sarathi_pp.bench.runner import serve
from sarathi_pp.bench.workload import workload_from_dict
from sarathi_pp.cli import main
from sarathi_pp.report.log import load_log

WORKLOAD = {
    "name": "pp2",
    "num_requests": 5,
    "seed": 2,
    "prompt_tokens": {"choice": [20, 90]},
    "output_tokens": {"uniform": [3, 7]},
    "arrivals": {"kind": "poisson", "rate": 10.0},
}


def test_bench_pp2_one_run_dir_per_scheduler(ray_cluster, llama_dir, tmp_path, capsys):
    workload = tmp_path / "w.yaml"
    workload.write_text(yaml.safe_dump(WORKLOAD))
    out = tmp_path / "bench"
    argv = ["bench", "--model", str(llama_dir), "--pipeline-parallel-size", "2",
            "--set", "model.max_model_len=160", "--chunk-size", "32", "--workload", str(workload),
            "--schedulers", "sarathi,vllm", "--run-dir", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    comparison = json.loads((out / "comparison.json").read_text())
    for run in comparison["runs"]:
        assert len(run["stages"]) == 2
        log = load_log(out / run["run_dir"] / "events.jsonl")
        assert log.num_stages == 2 and log.config["scheduler"]["policy"] == run["name"]
        # every micro-batch of this run (and none of the other's) on both stages
        mbs = [sorted(e.mb for e in stage) for stage in log.stages]
        assert mbs[0] == mbs[1] and len(mbs[0]) == len(set(mbs[0])) > 0
    a, b = (load_log(out / r["run_dir"] / "events.jsonl") for r in comparison["runs"])
    assert not {e.mb for e in a.stages[0]} & {e.mb for e in b.stages[0]}
    assert "stage 1" in capsys.readouterr().out


def test_serve_pp2_with_arrivals_equals_pp1(ray_cluster, llama_dir):
    w = workload_from_dict(WORKLOAD)
    tokens = []
    for pp in (2, 1):
        llm = LLM(str(llama_dir), pipeline_parallel_size=pp, max_model_len=160, chunk_size=32)
        try:
            outs = serve(llm.engine, w.requests(llm.engine.spec.vocab_size, 160))
        finally:
            llm.shutdown()
        for o in outs:
            assert o.metrics.first_scheduled_time >= o.metrics.arrival_time
        tokens.append([o.outputs[0].token_ids for o in outs])
    assert tokens[0] == tokens[1]
