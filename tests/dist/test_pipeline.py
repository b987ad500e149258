"""Pipeline parallelism on CPU (gloo): Ray stage actors and torchrun ranks give the greedy
tokens of Hugging Face and of one stage, for every scheduler, chunk sizes, PP = 2, 3, 4,
with preemption, with more micro-batches in flight than stages; a killed stage is a clear
error, not a hang.

Stage processes cost seconds each on 2 cores, so one PP=2 engine serves the whole policy
x chunk-size matrix (``set_scheduler`` keeps the stages), and PP=3 / PP=4 run a subset:
sarathi and vllm (the two ends of the design space) with one chunk size each.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import subprocess
import sys
import time

import pytest
from helpers import assert_greedy_match, hf_greedy, record_submits, torchrun_command

from sarathi_pp import LLM, SamplingParams
from sarathi_pp.executors import StageError

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SCHEDULERS = ("sarathi", "vllm", "orca", "simple_chunking")


def make_prompts(lens=(3, 17, 60, 150), seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lens]


def check_against_hf(model_dir, outs, prompts):
    for out, prompt in zip(outs, prompts):
        assert out.outputs[0].finish_reason == "length", out
        ref, margins = hf_greedy(model_dir, prompt, MAX_TOKENS)
        assert_greedy_match(out.outputs[0].token_ids, ref, margins)


@pytest.fixture(scope="module")
def pp2(ray_cluster, llama_dir):
    llm = LLM(str(llama_dir), pipeline_parallel_size=2, max_model_len=256)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("chunk_size, tile_align", [(7, False), (16, True), (1000, False)])
def test_pp2_matches_hf_and_pp1(pp2, llama_dir, scheduler, chunk_size, tile_align):
    pp2.engine.set_scheduler(
        policy=scheduler, chunk_size=chunk_size, tile_align=tile_align, tile_size=8
    )
    prompts = make_prompts()
    outs = pp2.generate(prompts, GREEDY, use_tqdm=False)
    check_against_hf(llama_dir, outs, prompts)
    # num_microbatches_in_flight: auto: the stages (and the one ahead where the placement
    # turns scheduling ahead on, which a 2-core machine's does not)
    assert pp2.engine.max_inflight == 2 + int(pp2.engine.schedule_ahead)


@pytest.mark.parametrize("pacing", [False, True])
def test_pp2_equals_pp1_exactly(pp2, llama_dir, pacing):
    """Splitting layers over processes changes no arithmetic: identical tokens, no tie rule;
    with the prefill paced into the micro-batches in flight too (``prefill_pacing``)."""
    pp2.engine.set_scheduler(
        policy="sarathi", chunk_size=32, tile_align=False, tile_size=8, prefill_pacing=pacing
    )
    prompts = make_prompts(seed=4)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in pp2.generate(prompts, sp, use_tqdm=False)]
    with LLM(str(llama_dir), max_model_len=256, chunk_size=32, tile_align=False) as pp1:
        ref = [o.outputs[0].token_ids for o in pp1.generate(prompts, sp, use_tqdm=False)]
    assert ours == ref


class RecordingHandle:
    """A stage's real actor handle that records what each ``run_packed`` call is given."""

    def __init__(self, actor, calls: list) -> None:
        self.actor, self.calls = actor, calls
        self.run_packed = self  # ``handle.run_packed.remote(packed)``

    def remote(self, packed):
        self.calls.append(packed)
        return self.actor.run_packed.remote(packed)


def test_pp2_pickles_each_micro_batch_once_for_every_stage(pp2):
    """Note [packed micro-batches]: every stage gets the very same bytes of a micro-batch
    (one serialization, not one per stage), in issue order, and the tokens are unchanged."""
    pp2.engine.set_scheduler(policy="sarathi", chunk_size=32, tile_align=False)
    prompts = make_prompts(seed=5)
    ref = [o.outputs[0].token_ids for o in pp2.generate(prompts, GREEDY, use_tqdm=False)]
    actors = pp2.engine.executor.actors
    real = list(actors)
    calls: list[list] = [[] for _ in actors]
    actors[:] = [RecordingHandle(a, c) for a, c in zip(real, calls)]
    try:
        outs = pp2.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        actors[:] = real
    assert [o.outputs[0].token_ids for o in outs] == ref
    first, *others = calls
    assert len(first) > len(prompts)  # chunks and decodes: many micro-batches
    assert all(type(p) is bytes for p in first)
    for other in others:
        assert len(other) == len(first) and all(a is b for a, b in zip(first, other))
    ids = [pickle.loads(p).microbatch_id for p in first]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)


def test_pp2_preemption(ray_cluster, llama_dir):
    prompts = make_prompts(lens=(40, 41, 42, 43), seed=3)
    with LLM(
        str(llama_dir), pipeline_parallel_size=2, max_model_len=176, block_size=4, num_kv_blocks=44
    ) as llm:
        for scheduler in SCHEDULERS:
            llm.engine.set_scheduler(policy=scheduler, chunk_size=24)
            outs = llm.generate(prompts, GREEDY, use_tqdm=False)
            assert llm.engine.scheduler.num_preemptions > 0, scheduler
            check_against_hf(llama_dir, outs, prompts)
            bm = llm.engine.scheduler.block_manager
            assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("variant, num_stages", [("llama3-rope", 3), ("qwen2-4layer", 4)])
def test_pp3_pp4(ray_cluster, tiny_model, variant, num_stages):
    model_dir = tiny_model(variant)
    prompts = make_prompts(seed=num_stages)
    with LLM(str(model_dir), pipeline_parallel_size=num_stages, max_model_len=256) as llm:
        for scheduler, chunk in (("sarathi", 16), ("vllm", 256)):
            llm.engine.set_scheduler(policy=scheduler, chunk_size=chunk, tile_align=False)
            check_against_hf(model_dir, llm.generate(prompts, GREEDY, use_tqdm=False), prompts)


@pytest.mark.parametrize("num_stages, in_flight", [(2, 3), (3, 4)])
def test_more_microbatches_than_stages_equals_one_stage_for_every_policy(
    ray_cluster, llama3_rope_dir, num_stages, in_flight
):
    """The default executor (a Ray task per stage per micro-batch) with one micro-batch more
    in flight than stages, and the decode limit at its default (one per stage): the tokens
    of one stage for every policy. The limits hold in the real engine: never more than the
    stages in flight once the last prompt chunk was issued (all requests arrive at once, so
    from there on only decodes run), all M while the policies that chunk prompts have
    chunks left."""
    prompts = make_prompts(lens=(3, 17, 60, 150, 41), seed=num_stages)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(str(llama3_rope_dir), max_model_len=256) as pp1:
        reference = {}
        for policy in SCHEDULERS:
            pp1.engine.set_scheduler(policy=policy, chunk_size=16, tile_align=False)
            reference[policy] = [
                o.outputs[0].token_ids for o in pp1.generate(prompts, params, use_tqdm=False)
            ]
    assert len({tuple(t) for t in reference["sarathi"]}) > 1  # varied: equality means something
    with LLM(
        str(llama3_rope_dir), max_model_len=256, pipeline_parallel_size=num_stages,
        num_microbatches_in_flight=in_flight,
    ) as llm:  # fmt: skip
        assert llm.engine.max_inflight == in_flight
        engine = llm.engine  # per micro-batch: how many in flight with it, its prompt tokens
        seen = record_submits(engine, lambda mb: (engine.num_inflight, mb.num_prefill_tokens))
        for policy in SCHEDULERS:
            llm.engine.set_scheduler(policy=policy, chunk_size=16, tile_align=False)
            start = len(seen)
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == reference[policy], policy
            run = seen[start:]
            last_prompt = max(i for i, (_, p) in enumerate(run) if p)
            tail = run[last_prompt + 1 :]
            if llm.engine.scheduler.chunks_prompts:  # whole prompts may fill fewer
                assert max(n for n, _ in run) == in_flight, policy
            assert len(tail) >= 11 and max(n for n, _ in tail) == num_stages, (policy, tail)


def test_more_stages_than_layers_is_refused_before_start(llama_dir):
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds the model's 2 layers"):
        LLM(str(llama_dir), pipeline_parallel_size=3)


def test_killed_stage_is_a_clear_error(ray_cluster, llama_dir):
    llm = LLM(str(llama_dir), pipeline_parallel_size=2, max_model_len=256, stage_timeout_s=30,
              max_stage_restarts=0)  # fmt: skip  # with a restart left it is replaced: test_faults
    ray_cluster.kill(llm.engine.executor.actors[1])
    start = time.monotonic()
    with pytest.raises(StageError, match="pipeline stage 1"):
        llm.generate(make_prompts(), GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 30
    assert llm.engine.executor.actors == []  # released


def _logprob_values(completion):
    return _values(completion.logprobs)


def _values(entries):
    return [[(t, e.logprob, e.rank) for t, e in entry.items()] for entry in entries]


# float32 log-probabilities of the same tokens computed by processes with other thread counts
# (torchrun's ranks run on one thread, the PP=1 reference on torch's default): the matmuls sum
# in another order, and the values drift by ~1e-5 (1.2e-5 seen on an Intel Xeon); a wrong or
# misaligned log-probability is off by far more. The tolerance of the checks against HF.
LOGPROB_TOL = 1e-4


def _assert_same_logprobs(ours, ref):
    """Per position the same tokens and ranks in the same order, the values within
    ``LOGPROB_TOL``."""
    assert [[(t, r) for t, _, r in pos] for pos in ours] == [
        [(t, r) for t, _, r in pos] for pos in ref
    ]
    flat = [v for pos in ours for _, v, _ in pos]
    assert flat == pytest.approx([v for pos in ref for _, v, _ in pos], abs=LOGPROB_TOL)


def test_pp2_logprobs_and_n_equal_pp1(pp2, llama_dir):
    """Log-probabilities (the sampled tokens' and the prompts', over several chunks) come
    back from the last stage over Ray as PP=1 computes them, and ``n`` completions per
    prompt run as seeded children on the pipeline too."""
    pp2.engine.set_scheduler(policy="sarathi", chunk_size=16, tile_align=False)
    prompts = make_prompts(seed=8, lens=(5, 40))
    sp = SamplingParams(
        max_tokens=6, temperature=0.9, seed=3, ignore_eos=True, n=2, logprobs=3, prompt_logprobs=2
    )
    ours = pp2.generate(prompts, sp, use_tqdm=False)
    with LLM(str(llama_dir), max_model_len=256, chunk_size=16, tile_align=False) as pp1:
        ref = pp1.generate(prompts, sp, use_tqdm=False)
    for a, b, prompt in zip(ours, ref, prompts):
        assert a.prompt_logprobs[0] is None and len(a.prompt_logprobs) == len(prompt)
        _assert_same_logprobs(_values(a.prompt_logprobs[1:]), _values(b.prompt_logprobs[1:]))
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for ca, cb in zip(a.outputs, b.outputs):
            _assert_same_logprobs(_logprob_values(ca), _logprob_values(cb))
    assert ours[0].outputs[0].token_ids != ours[0].outputs[1].token_ids


def test_torchrun_logprobs_n_and_penalties_equal_pp1(llama_dir, tmp_path):
    """The same over torchrun's control plane (the codec carries the log-probabilities, and
    the penalized sequences' history and releases)."""
    prompts = ["Hello", "The pipeline has two stages"]
    out = tmp_path / "out.jsonl"
    cmd = torchrun_command(
        llama_dir, "--pipeline-parallel-size", "2", "--max-tokens", "6", "--ignore-eos",
        "--output", str(out), "--temperature", "0.8", "--seed", "4", "--num-completions", "2",
        "--logprobs", "2", "--repetition-penalty", "1.4", "--frequency-penalty", "0.5",
        "--prompt-logprobs", "1", "--chunk-size", "4", "--set", "model.max_model_len=256",
        "--set", "parallel.stage_timeout_s=60", *(a for p in prompts for a in ("--prompt", p)),
    )  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    with LLM(str(llama_dir), max_model_len=256, seed=4) as pp1:
        ref = pp1.generate(
            prompts,
            SamplingParams(
                max_tokens=6,
                temperature=0.8,
                ignore_eos=True,
                n=2,
                logprobs=2,
                repetition_penalty=1.4,
                frequency_penalty=0.5,
                prompt_logprobs=1,
            ),  # fmt: skip
            use_tqdm=False,
        )
    for record, r in zip(records, ref, strict=True):
        plp = record["prompt_logprobs"]  # over chunks of 4 tokens
        assert plp[0] is None and len(plp) == len(r.prompt_token_ids) > 4
        values = [[(e["token_id"], e["logprob"], e["rank"]) for e in pos] for pos in plp[1:]]
        _assert_same_logprobs(values, _values(r.prompt_logprobs[1:]))
        got = record["completions"]
        assert [c["token_ids"] for c in got] == [c.token_ids for c in r.outputs]
        for c, cr in zip(got, r.outputs):
            values = [
                [(e["token_id"], e["logprob"], e["rank"]) for e in pos] for pos in c["logprobs"]
            ]
            _assert_same_logprobs(values, _logprob_values(cr))
            assert c["cumulative_logprob"] == pytest.approx(
                cr.cumulative_logprob, abs=LOGPROB_TOL * len(c["token_ids"])
            )
    assert records[0]["completions"][0]["token_ids"] != records[0]["completions"][1]["token_ids"]


@pytest.mark.parametrize(
    "scheduler, chunk_size, in_flight", [("sarathi", 256, None), ("sarathi", 8, 3), ("vllm", 8, 3)]
)
def test_torchrun_matches_pp1(llama_dir, tmp_path, scheduler, chunk_size, in_flight):
    """Rank 0 drives the ranks with the engine's own limits: the default (``auto``: one
    more micro-batch in flight than stages) and that set explicitly, with prompts in chunks
    (the decode limit taking over after the last chunk) or whole (vllm)."""
    prompts = ["Hello", "The pipeline has two stages", "x", "a longer prompt " * 4]
    out = tmp_path / "out.jsonl"
    cmd = torchrun_command(
        llama_dir, "--pipeline-parallel-size", "2", "--max-tokens", "8", "--ignore-eos",
        "--output", str(out), "--scheduler", scheduler, "--chunk-size", str(chunk_size),
        "--set", "scheduler.tile_align=false", "--set", "model.max_model_len=256",
        "--set", "parallel.stage_timeout_s=60",
    )  # fmt: skip
    if in_flight:
        cmd += ["--set", f"parallel.num_microbatches_in_flight={in_flight}"]
    run = tmp_path / "run"
    if not in_flight:  # each stage's attention report crosses the wire (comm/codec.py)
        cmd += ["--run-dir", str(run), "--set", "model.attention_backend=torch"]
    for p in prompts:
        cmd += ["--prompt", p]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    if not in_flight:
        summary = json.loads((run / "summary.json").read_text())
        assert summary["attention"] == [
            {"stage": s, "backend": "torch", "fallbacks": []} for s in (0, 1)
        ]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    with LLM(str(llama_dir), max_model_len=256, scheduler=scheduler, chunk_size=chunk_size,
             tile_align=False) as pp1:  # fmt: skip
        ref = pp1.generate(
            prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False
        )
    assert [r["prompt"] for r in records] == prompts
    assert [r["token_ids"] for r in records] == [o.outputs[0].token_ids for o in ref]
    assert len({tuple(r["token_ids"]) for r in records}) > 1


def test_torchrun_world_size_must_match(llama_dir):
    cmd = torchrun_command(llama_dir, "--prompt", "hi")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "torchrun started 2 processes but pipeline_parallel_size=1" in proc.stderr


def test_the_torchrun_launcher_without_torchrun_is_a_usage_error(llama_dir):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    cmd = [sys.executable, "-m", "sarathi_pp.launch.torchrun", "--model", str(llama_dir),
           "--prompt", "hi"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "not started by torchrun" in proc.stderr and "--nproc-per-node" in proc.stderr


def test_pp2_run_dir_records_every_microbatch_on_every_stage(ray_cluster, llama_dir, tmp_path):
    from sarathi_pp.records.events import read_events

    run = tmp_path / "run"
    prompts = make_prompts(lens=(30, 90, 60, 120, 10, 75), seed=6)
    with LLM(
        str(llama_dir),
        pipeline_parallel_size=2,
        max_model_len=256,
        chunk_size=32,
        tile_size=16,
        run_dir=str(run),
    ) as llm:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    for name in (
        "config.yaml",
        "events.jsonl",
        "requests.csv",
        "summary.json",
        "trace.json",
        "timeline.png",
    ):
        assert (run / name).is_file() and (run / name).stat().st_size > 0, name
    records = read_events(run / "events.jsonl")
    issued = sorted(r["mb"] for r in records if r["type"] == "issue")
    assert issued == list(range(len(issued))) and len(issued) > 10
    for stage in (0, 1):
        seen = sorted(r["mb"] for r in records if r["type"] == "stage" and r["stage"] == stage)
        assert seen == issued, stage  # every micro-batch once per stage
    trace = json.loads((run / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert spans and all({"name", "ts", "dur", "pid", "tid"} <= set(e) for e in spans)
    summary = json.loads((run / "summary.json").read_text())
    for s in summary["stages"]:
        window = s["busy_s"] + s["idle_s"]
        assert abs(sum(s["bubbles_s"].values()) - s["idle_s"]) < 1e-6
        assert 0 < s["busy_s"] < window
    assert summary["requests"]["num_requests"] == len(prompts)


LOCAL_RAY_SCRIPT = """
import json, os, sys
import ray
from sarathi_pp import LLM, SamplingParams
from sarathi_pp.executors.ray import LOCAL_RAY_ENV

llm = LLM(sys.argv[1], pipeline_parallel_size=2, max_model_len=64)
driver = {name: os.environ.get(name) for name in LOCAL_RAY_ENV}
out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
def env(self):
    return {name: os.environ.get(name) for name in LOCAL_RAY_ENV}
seen = ray.get([a.__ray_call__.remote(env) for a in llm.engine.executor.actors])
llm.shutdown()
print(json.dumps({"tokens": out[0].outputs[0].token_ids, "stages": seen, "driver": driver,
                  "initialized": ray.is_initialized()}))
"""


def test_a_ray_started_for_the_run_runs_the_stages_at_nice_0_without_rays_bookkeeping(
    llama_dir,
):
    # Note [a Ray of its own]: the engine's own Ray (no RAY_ADDRESS, none running) gives
    # its workers the settings where the environment does not; one given wins; the
    # driver's own environment is left as it was.
    from sarathi_pp.executors.ray import LOCAL_RAY_ENV

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_enable_timeline"] = "1"  # the user's own setting
    proc = subprocess.run(
        [sys.executable, "-c", LOCAL_RAY_SCRIPT, str(llama_dir)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["tokens"]) == 3
    expected = {**LOCAL_RAY_ENV, "RAY_enable_timeline": "1"}
    assert result["stages"] == [expected, expected]
    assert expected["RAY_task_events_report_interval_ms"] == "0"
    assert result["driver"] == {name: None for name in LOCAL_RAY_ENV} | {"RAY_enable_timeline": "1"}
    assert not result["initialized"]  # the engine stopped the Ray it started
