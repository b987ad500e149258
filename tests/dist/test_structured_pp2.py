"""Structured output at PP=2 over Ray: the sampled JSON of the last stage's grammar masks
equals the one-stage run's token for token (seeded sampling), with and without scheduling
ahead over the token ring; a stage killed mid-run is replaced, and the sequences it held
are recomputed with their matchers rebuilt from their tokens: the outputs still equal the
undisturbed run's and validate."""

from __future__ import annotations

import json

import jsonschema
import pytest

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


@pytest.mark.parametrize("ahead", [False, True], ids=["ray", "ray+ahead"])
def test_pp2_equals_pp1(ray_cluster, llama_dir, reference, ahead):
    with LLM(str(llama_dir), pipeline_parallel_size=2, schedule_ahead=ahead, **BASE) as llm:
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
