"""``sarathi-pp bench --peer vllm`` end to end on the tiny random Llama with a fake vLLM peer
(``tests/stubs/fake_vllm_python``): the run dir's records, token agreement, the table, a
peer that dies (records kept, exit 1) and an absent peer venv (exit 2 before any load)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sarathi_pp.bench import peer_vllm
from sarathi_pp.cli import main
from sarathi_pp.records.run_dir import BenchDir
from sarathi_pp.report.request_metrics import load_requests

STUB = Path(__file__).parents[1] / "stubs" / "fake_vllm_python"


@pytest.fixture
def stub(monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(peer_vllm.PYTHON_ENV, str(STUB))
    return STUB


def bench(llama_dir: Path, tmp_path: Path, *extra: str) -> tuple[int, Path]:
    workload = tmp_path / "tiny.yaml"
    workload.write_text(yaml.safe_dump({
        "name": "tiny", "num_requests": 3, "seed": 3, "prompt_tokens": {"choice": [12, 40]},
        "output_tokens": 5, "arrivals": {"kind": "all_at_once"},
    }))  # fmt: skip
    out = tmp_path / "bench"
    engine = ["--model", str(llama_dir), "--set", "model.max_model_len=160", "--dtype", "float32"]
    argv = ["bench", *engine, "--workload", str(workload), "--peer", "vllm",
            "--run-dir", str(out), "--no-progress", *extra]  # fmt: skip
    return main(argv), out


def test_bench_with_vllm_peer_writes_the_peer_records(llama_dir, tmp_path, stub, capsys):
    rc, out = bench(llama_dir, tmp_path)
    assert rc == 0
    comparison = json.loads((out / "comparison.json").read_text())
    ours, peer = comparison["runs"]
    assert peer["name"] == "peer-vllm" and peer["kind"] == "peer"
    assert peer["requests"]["num_generated_tokens"] == ours["requests"]["num_generated_tokens"]
    assert peer["token_agreement"]["num_compared"] == 3
    assert (comparison["ratios"][0]["a"], comparison["ratios"][0]["b"]) == ("sarathi", "peer-vllm")
    rows = load_requests(out / "peer-vllm" / "requests.csv")
    assert len(rows) == 3 and all(r.num_output_tokens == 5 for r in rows)
    summary = json.loads((out / "peer-vllm" / "summary.json").read_text())
    assert summary["peer"] == "vllm" and summary["error"] is None
    assert (out / "peer-vllm" / "peer.log").is_file()
    text = capsys.readouterr().out
    assert "sarathi / peer-vllm" in text and "tokens identical to sarathi's for" in text
    BenchDir(out).clear()  # --overwrite's clearing takes the peer's own files too
    assert not (out / "peer-vllm").exists()


def test_a_vllm_peer_that_dies_keeps_the_records(llama_dir, tmp_path, stub, monkeypatch, capsys):
    monkeypatch.setenv("STUB_VLLM_MODE", "die")
    rc, out = bench(llama_dir, tmp_path)
    assert rc == 1
    err = capsys.readouterr().err
    assert "peer-vllm: the vLLM peer died (exit status 1) after 1/3 requests" in err
    assert "Traceback" not in err
    assert (out / "sarathi" / "summary.json").is_file()
    comparison = json.loads((out / "comparison.json").read_text())
    assert comparison["runs"][1]["latency_comparable"] is False
    rows = load_requests(out / "peer-vllm" / "requests.csv")
    assert [r.num_output_tokens for r in rows] == [5, 0, 0]


def test_an_absent_vllm_venv_is_a_usage_error(llama_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(peer_vllm.PYTHON_ENV, str(tmp_path / "no-venv" / "python"))
    with pytest.raises(SystemExit) as e:
        bench(llama_dir, tmp_path)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "SARATHI_PP_VLLM_PYTHON" in err and "Traceback" not in err
    assert not (tmp_path / "bench" / "sarathi").exists()


def test_bench_with_two_peers_side_by_side(llama_dir, tmp_path, stub):
    rc, out = bench(llama_dir, tmp_path, "--peer", "hf,vllm")
    assert rc == 0
    comparison = json.loads((out / "comparison.json").read_text())
    assert [r["name"] for r in comparison["runs"]] == ["sarathi", "peer-hf", "peer-vllm"]
    assert [(r["a"], r["b"]) for r in comparison["ratios"]] == [
        ("sarathi", "peer-hf"), ("sarathi", "peer-vllm"),
    ]  # fmt: skip
    # transformers runs the same weights greedy: every request agrees
    assert comparison["runs"][1]["token_agreement"]["num_identical"] == 3
