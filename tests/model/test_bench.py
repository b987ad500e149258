"""The serving benchmark end to end on the tiny random Llama: the online loop with arrivals,
``sarathi-pp bench`` (schedulers side by side, the peer, the capacity search) and its
bad-input errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sarathi_pp import LLM, SamplingParams
from sarathi_pp.bench.runner import serve
from sarathi_pp.bench.workload import load_workload, workload_from_dict
from sarathi_pp.cli import main
from sarathi_pp.config import make_config
from sarathi_pp.engine import LLMEngine
from sarathi_pp.report.request_metrics import load_requests

MAX_LEN = 160


def engine_args(model_dir: Path) -> list[str]:
    return [
        "--model",
        str(model_dir),
        "--set",
        f"model.max_model_len={MAX_LEN}",
        "--dtype",
        "float32",
    ]


def write_workload(tmp_path: Path, **over) -> Path:
    spec = {
        "name": "tiny",
        "num_requests": 6,
        "seed": 3,
        "prompt_tokens": {"choice": [12, 40, 90]},
        "output_tokens": {"uniform": [4, 9]},
        "arrivals": {"kind": "all_at_once"},
        **over,
    }
    path = tmp_path / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_serve_honours_arrivals_and_matches_offline_generation(llama_dir):
    w = workload_from_dict(
        {
            "num_requests": 5,
            "seed": 1,
            "prompt_tokens": {"choice": [10, 70]},
            "output_tokens": {"uniform": [3, 8]},
            "arrivals": {"kind": "poisson", "rate": 8.0},
        }
    )
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=MAX_LEN, chunk_size=32)
    requests = w.requests(llm.engine.spec.vocab_size, MAX_LEN)
    assert any(r.arrival_s > 0.1 for r in requests)
    outs = serve(llm.engine, requests)
    start = min(o.metrics.arrival_time - r.arrival_s for o, r in zip(outs, requests))
    for o, r in zip(outs, requests):
        m = o.metrics
        assert o.request_id == r.request_id
        assert m.arrival_time == pytest.approx(start + r.arrival_s)
        assert m.first_scheduled_time >= m.arrival_time  # never scheduled before arrival
        assert len(o.outputs[0].token_ids) == r.output_tokens
        assert len(m.token_times) == r.output_tokens
    # The online loop gives the greedy tokens of an offline generate of the same prompts.
    offline = llm.generate(
        [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests],
        [
            SamplingParams(max_tokens=r.output_tokens, temperature=0, ignore_eos=True)
            for r in requests
        ],
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in offline]
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1  # varied, not one token
    llm.shutdown()


def test_bench_schedulers_side_by_side(llama_dir, tmp_path, capsys):
    workload = write_workload(tmp_path)
    out = tmp_path / "bench"
    argv = ["bench", *engine_args(llama_dir), "--chunk-size", "32", "--workload", str(workload),
            "--schedulers", "sarathi,vllm", "--run-dir", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "sarathi" in table and "vllm" in table and "tbt p99" in table
    assert "sarathi / vllm: throughput" in table

    comparison = json.loads((out / "comparison.json").read_text())
    assert [r["name"] for r in comparison["runs"]] == ["sarathi", "vllm"]
    assert comparison["workload"]["num_requests"] == 6
    expected = load_workload(workload)
    for run in comparison["runs"]:
        d = out / run["run_dir"]
        summary = json.loads((d / "summary.json").read_text())
        assert summary["scheduler"] == run["name"] == run["scheduler"]
        assert run["requests"] == summary["requests"]
        assert run["overall"]["bubble_fraction"] == summary["overall"]["bubble_fraction"]
        rows = load_requests(d / "requests.csv")
        lengths = sorted(r.output_tokens for r in expected.requests(256, MAX_LEN))
        assert sorted(r.num_output_tokens for r in rows) == lengths
        assert main(["report", str(d), "--no-plot"]) == 0  # each run dir is a report run dir
    ratio = comparison["ratios"][0]
    a, b = comparison["runs"]
    assert ratio["a"] == "sarathi" and ratio["b"] == "vllm"
    assert ratio["tbt_p99"] == pytest.approx(
        a["requests"]["tbt_s"]["p99"] / b["requests"]["tbt_s"]["p99"]
    )
    for png in ("tbt_cdf.png", "ttft_cdf.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_with_hf_peer(llama_dir, tmp_path, capsys):
    workload = write_workload(tmp_path, num_requests=4)
    out = tmp_path / "bench"
    argv = ["bench", *engine_args(llama_dir), "--workload", str(workload), "--peer", "hf",
            "--run-dir", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    comparison = json.loads((out / "comparison.json").read_text())
    ours, peer = comparison["runs"]
    assert (ours["kind"], peer["kind"]) == ("engine", "peer")
    assert peer["name"] == "peer-hf" and peer["overall"] is None
    assert peer["requests"]["num_generated_tokens"] == ours["requests"]["num_generated_tokens"]
    ratio = comparison["ratios"][0]
    assert (ratio["a"], ratio["b"]) == ("sarathi", "peer-hf")
    assert ratio["generated_tokens_per_s"] == pytest.approx(
        ours["requests"]["generated_tokens_per_s"] / peer["requests"]["generated_tokens_per_s"]
    )
    assert "sarathi / peer-hf" in capsys.readouterr().out


def test_bench_hf_peer_with_dtype_auto_sees_the_resolved_dtype(llama_dir, tmp_path):
    """``dtype: auto`` is resolved once (float32 on CPU): the run records and the peer get
    the resolved dtype, not ``auto`` (which the peer used to refuse after every run)."""
    workload = write_workload(tmp_path, num_requests=2)
    out = tmp_path / "bench"
    argv = ["bench", "--model", str(llama_dir), "--set", f"model.max_model_len={MAX_LEN}",
            "--set", "model.device=cpu", "--workload", str(workload), "--peer", "hf",
            "--run-dir", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    config = yaml.safe_load((out / "sarathi" / "config.yaml").read_text())
    assert config["model"]["dtype"] == "float32" and config["model"]["device"] == "cpu"
    peer = json.loads((out / "comparison.json").read_text())["runs"][1]
    assert peer["name"] == "peer-hf" and "float32" in peer["note"]
    assert peer["requests"]["num_requests"] == 2


def test_bench_capacity_search(llama_dir, tmp_path, capsys):
    workload = write_workload(tmp_path, num_requests=4, arrivals={"kind": "poisson", "rate": 4.0})
    out = tmp_path / "bench"
    argv = ["bench", *engine_args(llama_dir), "--workload", str(workload), "--capacity",
            "--slo-tbt-p99", "5", "--max-probes", "2", "--run-dir", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    cap = json.loads((out / "sarathi" / "capacity.json").read_text())
    assert [p["rate"] for p in cap["probes"]] == [4.0, 8.0]  # generous SLO: both meet
    assert cap["capacity_rps"] == 8.0 and cap["bound"] == "lower"
    for p in cap["probes"]:
        assert (out / "sarathi" / "probes" / f"rate-{p['rate']:.4g}" / "summary.json").is_file()
    assert "capacity (req/s)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--schedulers", "sarathi,fifo"], "unknown scheduler 'fifo'"),
        (["--capacity"], "needs an SLO"),
        (["--slo-tbt-p99", "0.5"], "add --capacity"),
        (["--capacity", "--slo-tbt-p99", "-1"], "tbt_p99_s must be a number > 0"),
        (["--rate", "0"], "rate"),
        (["--peer", "hf", "--capacity", "--slo-tbt-p99", "1"], "drop --peer"),
        (["--capacity", "--slo-tbt-p99", "1", "--max-probes", "0"], "--max-probes must be"),
        (["--capacity", "--slo-tbt-p99", "1", "--start-rate", "-2"], "--start-rate must be"),
        (["--num-requests", "0"], "num_requests"),
        (["--workload", "missing.yaml"], "missing.yaml"),
    ],
)
def test_bench_bad_input_is_a_usage_error(llama_dir, tmp_path, capsys, extra, message):
    workload = write_workload(tmp_path)
    argv = ["bench", *engine_args(llama_dir), "--workload", str(workload),
            "--run-dir", str(tmp_path / "b"), *extra]  # fmt: skip
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())


def test_bench_refuses_a_used_run_dir(llama_dir, tmp_path, capsys):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "old.txt").write_text("x")
    argv = ["bench", *engine_args(llama_dir), "--workload", str(write_workload(tmp_path)),
            "--run-dir", str(tmp_path / "b")]  # fmt: skip
    with pytest.raises(SystemExit):
        main(argv)
    assert "is not empty" in capsys.readouterr().err


def test_bench_names_a_prompt_too_long_for_the_model(llama_dir, tmp_path, capsys):
    workload = write_workload(tmp_path, prompt_tokens=300)
    argv = ["bench", *engine_args(llama_dir), "--workload", str(workload),
            "--run-dir", str(tmp_path / "b")]  # fmt: skip
    with pytest.raises(SystemExit):
        main(argv)
    assert "300" in capsys.readouterr().err


def test_engine_start_run_refuses_while_busy(llama_dir, tmp_path):
    engine = LLMEngine(make_config(model=str(llama_dir), dtype="float32", max_model_len=MAX_LEN))
    engine.add_request("a", None, SamplingParams(max_tokens=2), prompt_token_ids=[1, 2, 3])
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.start_run(tmp_path / "r")
    engine.shutdown()
