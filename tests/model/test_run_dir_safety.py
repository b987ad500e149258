"""Run dirs and records: nothing is written before the inputs are checked, ``--overwrite``
removes exactly what the project wrote, records stream while the run goes, and records
that cannot be written never cost the outputs."""

from __future__ import annotations

import csv
import json

import pytest

from sarathi_pp import LLM, LLMEngine, SamplingParams, load_config
from sarathi_pp.cli import main
from sarathi_pp.records.events import EventLog, read_events
from sarathi_pp.records.run_dir import RunDir

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def generate_argv(model_dir, run_dir, *extra: str) -> list[str]:
    return ["generate", "--model", str(model_dir), "--set", "model.max_model_len=128",
            "--dtype", "float32", "--run-dir", str(run_dir), "--max-tokens", "3", *extra]  # fmt: skip


def used_run_dir(tmp_path):
    """A run dir an earlier run (and its user) left: project files, stale ones, user files."""
    d = tmp_path / "run"
    (d / "probes" / "rate-1").mkdir(parents=True)
    (d / "probes" / "rate-1" / "summary.json").write_text("{}")
    for name in ("config.yaml", "summary.json", "capacity.json", "profile.csv"):
        (d / name).write_text("old")
    (d / "notes.txt").write_text("mine")
    (d / "mydata").mkdir()
    (d / "mydata" / "x.csv").write_text("mine too")
    return d


def snapshot(d):
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_a_refused_prompt_leaves_the_run_dir_as_it_was(llama_dir, tmp_path, capsys):
    d = used_run_dir(tmp_path)
    before = snapshot(d)
    argv = generate_argv(llama_dir, d, "--overwrite", "--prompt", "ok", "--prompt", "x" * 300)
    with pytest.raises(SystemExit) as e:
        main(argv)  # prompt 1: 301 tokens (BOS + 300), more than max_model_len=128
    assert e.value.code == 2 and "prompt 1 has 301 tokens" in capsys.readouterr().err
    assert snapshot(d) == before
    fresh = tmp_path / "fresh"
    with pytest.raises(SystemExit):
        main(generate_argv(llama_dir, fresh, "--prompt", "x" * 300))
    assert not fresh.exists()  # not even created


def test_overwrite_removes_exactly_what_the_project_wrote(llama_dir, tmp_path):
    d = used_run_dir(tmp_path)
    assert main(generate_argv(llama_dir, d, "--overwrite", "--prompt", "hi")) == 0
    names = set(snapshot(d))
    assert {"notes.txt", "mydata/x.csv"} <= names  # the user's files stay
    assert "capacity.json" not in names and "profile.csv" not in names
    assert not (d / "probes").exists()
    assert (d / "config.yaml").read_text() != "old"
    assert json.loads((d / "summary.json").read_text())["requests"]["num_requests"] == 1
    assert (d / "notes.txt").read_text() == "mine"


def test_bench_overwrite_clears_stale_runs_and_keeps_the_rest(tmp_path):
    from sarathi_pp.records.run_dir import BenchDir

    d = tmp_path / "bench"
    for sub in ("peer-hf", "vllm/probes/rate-2", "sarathi"):
        (d / sub).mkdir(parents=True)
    (d / "peer-hf" / "requests.csv").write_text("old")
    (d / "vllm" / "probes" / "rate-2" / "events.jsonl").write_text("old")
    (d / "vllm" / "capacity.json").write_text("old")
    (d / "sarathi" / "mine.txt").write_text("mine")
    (d / "comparison.json").write_text("old")
    (d / "README").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        BenchDir.check(d)
    BenchDir.prepare(d, overwrite=True)
    assert snapshot(d) == {"README": b"mine", "sarathi/mine.txt": b"mine"}


def test_records_stream_while_the_run_goes(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(EventLog, "FLUSH_EVERY_S", 0.0)  # every record reaches the file
    run = tmp_path / "run"
    engine = LLMEngine(load_config(None, model=str(llama_dir), max_model_len=128, run_dir=str(run)))
    try:
        assert not run.exists()  # nothing before the first request
        engine.add_request("short", None, GREEDY, prompt_token_ids=[5, 6, 7])
        long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        engine.add_request("long", None, long, prompt_token_ids=[8, 9, 10])
        assert (run / "config.yaml").is_file()
        finished = []
        while not finished:
            finished = [o.request_id for o in engine.step() if o.finished]
        assert finished == ["short"]
        with open(run / "requests.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        assert [r["request_id"] for r in rows] == ["short"]  # before write_run_records
        records = read_events(run / "events.jsonl")
        assert records[0]["type"] == "header"
        assert sum(r["type"] == "done" for r in records) >= 4  # the short one's 4 tokens
    finally:
        engine.shutdown()


def test_records_that_cannot_be_written_never_cost_the_outputs(llama_dir, tmp_path, monkeypatch):
    def disk_full(self, config):
        raise OSError(28, "No space left on device")

    prompts = [[5, 6, 7], [40, 41, 42, 43]]
    with LLM(str(llama_dir), max_model_len=128) as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    monkeypatch.setattr(RunDir, "write_config", disk_full)
    with LLM(str(llama_dir), max_model_len=128, run_dir=str(tmp_path / "run")) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.engine.write_run_records() is None  # recording stopped, said so in the log
    assert [o.outputs[0].token_ids for o in outs] == ref
