"""Structured output at PP=2 over Ray (a task per stage, and the compiled graph): the
sampled JSON of the last stage's grammar masks
equals the one-stage run's token for token (seeded sampling), with and without scheduling
ahead over the token ring; a stage killed mid-run is replaced, and the sequences it held
are recomputed with their matchers rebuilt from their tokens: the outputs still equal the
undisturbed run's and validate; over torchrun (``generate --structured-outputs``) the same
tokens as one stage."""

from __future__ import annotations

import json
import os
import subprocess

import jsonschema
import pytest
from helpers import torchrun_command

from sarathi_pp import LLM, SamplingParams
from sarathi_pp.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PARAMS = [
    SamplingParams(
        temperature=1.0, max_tokens=120, seed=i, top_p=0.95, repetition_penalty=1.1,
        structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    )
    for i in range(20)
]  # fmt: skip
PROMPTS = [[7 + i, 40, 3 * i + 1, 99, 5] * (1 + i % 4) for i in range(20)]
BASE = dict(max_model_len=256, chunk_size=32, dtype="float32")


@pytest.fixture(scope="module")
def reference(llama_dir):
    with LLM(str(llama_dir), **BASE) as pp1:
        outs = pp1.generate(PROMPTS, PARAMS, use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    tokens = [o.outputs[0].token_ids for o in outs]
    assert len({tuple(t) for t in tokens}) > 10
    return tokens


@pytest.mark.parametrize(
    ("executor", "ahead"),
    [("ray", False), ("ray", True), ("ray_compiled", False)],
    ids=["ray", "ray+ahead", "ray_compiled"],
)
def test_pp2_equals_pp1(ray_cluster, llama_dir, reference, executor, ahead):
    with LLM(
        str(llama_dir), pipeline_parallel_size=2, executor=executor, schedule_ahead=ahead, **BASE
    ) as llm:
        assert llm.engine.schedule_ahead == ahead
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_a_killed_stage_is_replaced_and_the_matchers_rebuilt(ray_cluster, llama_dir, reference):
    with LLM(str(llama_dir), pipeline_parallel_size=2, **BASE) as llm:
        old = list(llm.engine.executor.actors)
        killed: list[int] = []

        def kill_once(index, output):  # mid-run, whatever the machine's speed: no timer
            if not killed:
                killed.append(index)
                ray_cluster.kill(old[1])  # the last stage: its matchers go with it

        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False, on_finished=kill_once)
        assert killed and llm.engine.executor.actors[1] is not old[1]
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_torchrun_carries_the_constraint_and_equals_pp1(llama_dir, tmp_path):
    """Over torchrun's control plane (the codec carries ``StructuredOutputsParams``), through
    ``sarathi-pp generate --structured-outputs``: the same tokens as PP=1, valid JSON."""
    prompts = ["Hello", "The pipeline has two stages"]
    so = {"json": SCHEMA, "disable_any_whitespace": True}
    out = tmp_path / "out.jsonl"
    cmd = torchrun_command(
        llama_dir, "--pipeline-parallel-size", "2", "--max-tokens", "120", "--output", str(out),
        "--temperature", "1.0", "--seed", "4", "--num-completions", "2", "--chunk-size", "4",
        "--structured-outputs", json.dumps(so), "--set", "model.max_model_len=256",
        "--set", "parallel.stage_timeout_s=60", *(a for p in prompts for a in ("--prompt", p)),
    )  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    params = SamplingParams(temperature=1.0, max_tokens=120, n=2, structured_outputs=so)
    with LLM(str(llama_dir), max_model_len=256, seed=4) as pp1:
        ref = pp1.generate(prompts, params, use_tqdm=False)
    for record, r in zip(records, ref, strict=True):
        assert [c["token_ids"] for c in record["completions"]] == [c.token_ids for c in r.outputs]
        for c in record["completions"]:
            jsonschema.validate(json.loads(c["text"]), SCHEMA)
