"""Data-parallel replicas on Ray (``parallel.data_parallel_size``, ``engine/replicas.py``):
outputs equal one replica's (greedy, and sampled with seeds given or derived from
``model.seed``); both replicas take requests; records per replica and in total, read back
by ``sarathi-pp report``; the router's prefix affinity end to end; a replica lost beyond its
restarts is taken out and its requests finish on the other, nothing lost."""

from __future__ import annotations

import csv
import json
import random

import pytest

from sarathi_pp import LLM, SamplingParams

BASE = dict(max_model_len=256, chunk_size=32, dtype="float32", seed=7)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts(seed: int = 0, lens=(3, 17, 60, 150, 33, 9, 41, 80)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lens]


def mixed_params(n: int) -> list[SamplingParams]:
    """Greedy, sampled with a seed of its own, sampled with one from ``model.seed``."""
    kinds = [
        GREEDY,
        SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, ignore_eos=True),
    ]
    return [kinds[i % 3] for i in range(n)]


@pytest.fixture(scope="module")
def reference(llama_dir):
    with LLM(str(llama_dir), **BASE) as one:
        outs = one.generate(prompts() * 2, mixed_params(16), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def request_ids(run_dir) -> list[str]:
    with open(run_dir / "requests.csv") as f:
        return [row["request_id"] for row in csv.DictReader(f)]


def test_two_replicas_equal_one_and_record_each_and_the_total(
    ray_cluster, llama_dir, reference, tmp_path, capsys
):
    run = tmp_path / "run"
    with LLM(str(llama_dir), data_parallel_size=2, run_dir=str(run), **BASE) as llm:
        assert llm.engine.num_replicas == 2
        outs = llm.generate(prompts() * 2, mixed_params(16), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
        actors = [e.executor.actors[0] for e in llm.engine.engines]
        assert actors[0] != actors[1]
    # Each replica served some of the requests; the total has them all, once.
    ids = [request_ids(run / f"replica-{i}") for i in range(2)]
    assert ids[0] and ids[1] and not set(ids[0]) & set(ids[1])
    assert sorted(request_ids(run), key=int) == [str(i) for i in range(16)]
    total = json.loads((run / "summary.json").read_text())
    assert total["replicas"] == 2 and total["replicas_lost"] == []
    assert total["requests"]["num_requests"] == 16
    assert [s["replica"] for s in total["stages"]] == [0, 1]
    each = [json.loads((run / f"replica-{i}" / "summary.json").read_text()) for i in range(2)]
    assert total["overall"]["num_microbatches"] == sum(
        s["overall"]["num_microbatches"] for s in each
    )
    from sarathi_pp.cli import main

    assert main(["report", str(run / "replica-1"), "--no-plot", "--no-write"]) == 0
    # The run's own dir stands for its replicas, compared side by side.
    capsys.readouterr()
    assert main(["report", str(run), "--no-plot", "--no-write"]) == 0
    printed = capsys.readouterr().out
    assert "replica-0" in printed and "replica-1" in printed


def test_prefix_affinity_sends_a_shared_prefix_where_it_went(ray_cluster, llama_dir, tmp_path):
    run = tmp_path / "run"
    a, b = prompts(1, (100, 100))
    with LLM(str(llama_dir), data_parallel_size=2, run_dir=str(run), **BASE) as llm:
        block = llm.engine.engines[0].block_size
        llm.generate([a, b], GREEDY, use_tqdm=False)  # a: replica 0, b: replica 1 (load)
        # Idle replicas: least loaded alone would pick replica 0; b's prefix is on 1.
        llm.generate([b[: 4 * block] + [5, 6, 7]], GREEDY, use_tqdm=False)
        assert llm.engine.router.cached_tokens(b)[1] >= 4 * block
    assert request_ids(run / "replica-0") == ["0"]
    assert request_ids(run / "replica-1") == ["1", "2"]
    with LLM(str(llama_dir), data_parallel_size=2, enable_prefix_caching=False, **BASE) as llm:
        assert not llm.engine.router.affinity


def test_a_replica_lost_for_good_hands_its_requests_to_the_other(
    ray_cluster, llama_dir, reference, tmp_path
):
    run = tmp_path / "run"
    with LLM(
        str(llama_dir), data_parallel_size=2, max_stage_restarts=0, run_dir=str(run), **BASE
    ) as llm:
        victim = llm.engine.engines[1].executor.actors[0]
        killed: list[int] = []

        def kill_once(index, output):  # mid-run, whatever the machine's speed: no timer
            if not killed:
                killed.append(index)
                ray_cluster.kill(victim)

        outs = llm.generate(prompts() * 2, mixed_params(16), use_tqdm=False, on_finished=kill_once)
        assert killed and llm.engine.replicas_lost == [1] and llm.engine.num_live == 1
        assert llm.engine.num_requests_moved > 0  # it had unfinished requests when it died
        assert [o.outputs[0].token_ids for o in outs] == reference
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        # The live replica goes on serving.
        again = llm.generate(prompts()[:1] * 2, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == reference[:1] * 2
    total = json.loads((run / "summary.json").read_text())
    assert total["replicas_lost"] == [1] and total["requests"]["num_requests"] == 18


def test_two_replicas_on_the_compiled_graph_executor(ray_cluster, llama_dir, reference):
    with LLM(str(llama_dir), data_parallel_size=2, executor="ray_compiled", **BASE) as llm:
        outs = llm.generate(prompts() * 2, mixed_params(16), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
