"""The vLLM peer's protocol and runner against a fake peer (``tests/stubs/fake_vllm_python``):
records, token agreement, version mismatch both ways, a refused setting, a peer that dies.
The real vLLM run is a benchmark (``benchmarks/vs_vllm.py``)."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

from sarathi_pp.bench import peer_vllm, vllm_peer_main
from sarathi_pp.bench.compare import format_table, token_agreement
from sarathi_pp.bench.peers import check_peer, parse_peers
from sarathi_pp.bench.workload import BenchRequest

STUB = Path(__file__).parents[1] / "stubs" / "fake_vllm_python"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"")
    return d


@pytest.fixture
def stub(monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(peer_vllm.PYTHON_ENV, str(STUB))
    return STUB


def requests(n: int = 3) -> list[BenchRequest]:
    return [BenchRequest(str(i), 0.0, tuple(range(1, 5 + i)), 4) for i in range(n)]


def test_the_two_sides_speak_one_protocol_version():
    assert vllm_peer_main.PROTOCOL_VERSION == peer_vllm.PROTOCOL_VERSION


def test_the_peer_script_imports_only_the_standard_library_and_vllm():
    tree = ast.parse(peer_vllm.PEER_SCRIPT.read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
             for a in n.names}  # fmt: skip
    names |= {n.module.split(".")[0] for n in ast.walk(tree)
              if isinstance(n, ast.ImportFrom) and n.module}  # fmt: skip
    assert names - {"vllm", "__future__"} <= set(sys.stdlib_module_names)


def test_the_peer_script_refuses_another_protocol_version(tmp_path):
    in_path, out_path = tmp_path / "in.json", tmp_path / "out.jsonl"
    in_path.write_text(json.dumps({"version": 99, "settings": {}, "requests": []}))
    assert vllm_peer_main.main(["x", str(in_path), str(out_path)]) == 3
    (record,) = peer_vllm.read_records(out_path)
    assert record["kind"] == "version" and "99" in record["message"]


def test_workload_message_carries_requests_and_settings(model_dir):
    m = peer_vllm.workload_message(model_dir, requests(2), num_stages=2, dtype="float32",
                                   block_size=16)  # fmt: skip
    assert m["version"] == peer_vllm.PROTOCOL_VERSION
    assert m["settings"]["pipeline_parallel_size"] == 2 and m["settings"]["block_size"] == 16
    assert m["requests"][1] == {"request_id": "1", "arrival_s": 0.0,
                                "prompt_token_ids": [1, 2, 3, 4, 5], "max_tokens": 4}  # fmt: skip


def test_stub_run_gives_records_with_times_and_tokens(model_dir, stub, tmp_path):
    seen: list[int] = []
    result = peer_vllm.run_vllm_peer(model_dir, requests(), progress=seen.append,
                                     log_dir=tmp_path)  # fmt: skip
    assert result.error is None and result.latency_comparable
    assert [o.request_id for o in result.outputs] == ["0", "1", "2"]
    out = result.outputs[1]
    assert out.outputs[0].token_ids == [(15 + i) % 50 for i in range(4)]
    m = out.metrics
    assert m.ttft == pytest.approx(0.01) and len(m.token_times) == 4
    assert "vLLM 0.0.stub" in result.note and "PP=1" in result.note
    assert (tmp_path / "peer.jsonl").is_file() and (tmp_path / "peer.log").is_file()


def test_a_peer_that_dies_keeps_the_finished_requests(model_dir, stub, monkeypatch):
    monkeypatch.setenv("STUB_VLLM_MODE", "die")
    result = peer_vllm.run_vllm_peer(model_dir, requests())
    assert "died (exit status 1) after 1/3 requests" in result.error
    assert "stub: killed mid-run" in result.error
    assert result.outputs[0].error is None and result.outputs[1].error is not None
    assert not result.latency_comparable


def test_a_peer_answering_another_version_is_an_error(model_dir, stub, monkeypatch):
    monkeypatch.setenv("STUB_VLLM_MODE", "version")
    result = peer_vllm.run_vllm_peer(model_dir, requests())
    assert "protocol version 99, expected 1" in result.error


def test_a_refused_setting_is_named(model_dir, stub, monkeypatch):
    monkeypatch.setenv("STUB_VLLM_MODE", "refuse")
    result = peer_vllm.run_vllm_peer(model_dir, requests(), block_size=48)
    assert result.error.startswith("vLLM refused the settings (block_size=48)")
    assert all(o.error is not None for o in result.outputs)


def test_a_refusal_in_vllms_worker_quotes_the_root_cause(model_dir, stub, monkeypatch):
    monkeypatch.setenv("STUB_VLLM_MODE", "refuse-in-worker")
    result = peer_vllm.run_vllm_peer(model_dir, requests())
    assert result.error.startswith("vLLM refused the settings (pipeline_parallel_size=1")
    assert result.error.endswith("ValueError: Available memory is less than desired CPU memory "
                                 "utilization")  # fmt: skip


def test_an_absent_venv_names_make_peer_vllm(monkeypatch, tmp_path):
    monkeypatch.delenv(peer_vllm.PYTHON_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(peer_vllm, "__file__", str(tmp_path / "a" / "b" / "peer_vllm.py"))
    with pytest.raises(FileNotFoundError, match="make peer-vllm.*looked for .*.venv-vllm"):
        check_peer("vllm")
    monkeypatch.setenv(peer_vllm.PYTHON_ENV, str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="SARATHI_PP_VLLM_PYTHON"):
        check_peer("vllm")


def test_preloads_and_thread_binding(tmp_path, monkeypatch):
    python = tmp_path / "venv" / "bin" / "python"
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    (tmp_path / "venv" / "lib" / "libiomp5.so").write_bytes(b"")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/x.so")
    env = peer_vllm.peer_env(python, num_stages=2, num_threads=2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert env["LD_PRELOAD"].split(":")[-2:] == [str(tmp_path / "venv/lib/libiomp5.so"), "/x.so"]
    assert peer_vllm.threads_bind(2, 8, list(range(8))) == "0,1,2,3|4,5,6,7"
    assert peer_vllm.threads_bind(1, None, [0, 1]) == "0,1"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert peer_vllm.peer_env(python, 2, 2)["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_token_agreement_counts_identical_requests():
    ours = {"0": [1, 2, 3], "1": [4, 5, 6], "2": [7, 8]}
    a = token_agreement(ours, {"0": [1, 2, 3], "1": [4, 9, 6], "2": []})
    assert a == {"num_identical": 1, "num_compared": 2,
                 "first_mismatch": {"request_id": "1", "index": 1}}  # fmt: skip


def test_parse_peers():
    assert parse_peers("hf, vllm") == ("hf", "vllm")
    with pytest.raises(ValueError, match="unknown peer 'sglang'; valid: hf, vllm"):
        parse_peers("sglang")
    with pytest.raises(ValueError, match="twice"):
        parse_peers("vllm,vllm")


def test_the_table_shows_the_agreement():
    dist = {"p50": 0.1, "p90": 0.1, "p99": 0.1}
    reqs = {"generated_tokens_per_s": 1.0, "requests_per_s": 1.0, "ttft_s": dist}
    run = {"name": "sarathi", "requests": reqs, "latency_comparable": True, "note": "",
           "overall": None, "stages": None, "capacity": None}  # fmt: skip
    peer = {
        **run,
        "name": "peer-vllm",
        "token_agreement": {"num_identical": 3, "num_compared": 4, "first_mismatch": None},
    }
    table = format_table({"runs": [run, peer], "ratios": []})
    assert "peer-vllm: tokens identical to sarathi's for 3/4 requests" in table
