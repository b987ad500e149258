"""The engine records what the runtime classes are cut by (events.jsonl schema 2:
``issue.submit``, ``done.wait``, ``done.full``), so a new run has no unsplit ``dependency``."""

from __future__ import annotations

import json
import random

import pytest

from sarathi_pp import LLM, SamplingParams
from sarathi_pp.records.events import SCHEMA_VERSION, read_events


@pytest.mark.parametrize("in_flight", [1, 2])
def test_engine_records_the_driver_times(llama_dir, tmp_path, in_flight):
    run = tmp_path / "run"
    llm = LLM(
        str(llama_dir), max_model_len=128, run_dir=str(run), chunk_size=16,
        num_microbatches_in_flight=in_flight,
    )  # fmt: skip
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 200) for _ in range(n)] for n in (40, 9, 25)]
    llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    llm.engine.write_run_records()
    records = read_events(run / "events.jsonl")
    assert records[0]["schema_version"] == SCHEMA_VERSION
    issues = [r for r in records if r["type"] == "issue"]
    dones = [r for r in records if r["type"] == "done"]
    assert issues and all(r["t"] <= r["submit"] for r in issues)
    assert len(dones) == len(issues) and all(r["wait"] <= r["t"] for r in dones)
    assert all(isinstance(r["full"], bool) for r in dones)
    assert any(r["full"] for r in dones)  # the in-flight limit held the next one back
    if in_flight == 2:  # a lone decode, or the last prompt's chunks, cannot fill two
        assert not all(r["full"] for r in dones)
    waits = sorted((r["wait"], r["t"]) for r in dones)
    assert all(a[1] <= b[0] for a, b in zip(waits, waits[1:]))  # one wait at a time
    summary = json.loads((run / "summary.json").read_text())
    o = summary["overall"]
    assert o["bubbles_s"]["dependency"] == 0  # every part measured
    assert sum(o["families_s"].values()) == pytest.approx(o["idle_s"], abs=1e-9)


def test_a_wait_with_every_sequence_in_flight_is_the_loads_own(llama_dir, tmp_path):
    """Two requests, two micro-batches in flight: after the prompts each decode rides in its
    own micro-batch (two decode micro-batches in flight too: the default would be one per
    stage), so the in-flight limit is reached with nothing else to issue. Those waits are
    not ``full`` (more micro-batches in flight would not fill them): the report counts them
    as ``load``, not ``in_flight`` (tests/unit/test_runtime_split.py)."""
    run = tmp_path / "run"
    llm = LLM(
        str(llama_dir), max_model_len=64, run_dir=str(run), chunk_size=32,
        num_microbatches_in_flight=2, num_decode_microbatches_in_flight=2,
    )  # fmt: skip
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm.generate([[5, 9, 14, 3, 7, 21], [8, 2, 30, 11]], params, use_tqdm=False)
    llm.engine.write_run_records()
    records = read_events(run / "events.jsonl")
    issues = {r["mb"]: r for r in records if r["type"] == "issue"}
    dones = [r for r in records if r["type"] == "done"]
    decode_only = [r for r in dones if issues[r["mb"]]["kind"] == "decode"]
    assert len(decode_only) >= 8  # two per step: the limit was reached at each of them
    assert not any(r["full"] for r in dones)
