"""Structured output on one stage (``stages/worker/structured.py``): sampled completions
at temperature 1 (with top-k, top-p, min-p and penalties) parse and validate against
their JSON schema for every scheduler, through preemption, with scheduling ahead, with
``n > 1`` and beside a request that fails alone; choices and regexes match; greedy under a
grammar equals Hugging Face's greedy with the same grammar's mask applied step by step;
a schema the engine cannot compile is refused before any work."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch
from helpers import assert_greedy_match, hf_processed_greedy
from test_vs_hf import PREEMPTING, make_prompts
from transformers import AutoTokenizer

from sarathi_pp import LLM, SamplingParams
from sarathi_pp.grammar import grammar_text
from sarathi_pp.sampling_params import StructuredOutputsParams
from sarathi_pp.stages.loader.builtin import EOS_TOKEN_ID

KW = dict(max_model_len=256, dtype="float32")
# Bounded, so a random model's sampled JSON closes well within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
JSON = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
REGEX = r"[a-c]{2,4}-[0-9]{3}"
CHOICES = ("yes", "no", "maybe so")


def sampled(n_requests: int = 20, **more) -> list[SamplingParams]:
    """Temperature 1, seeded per request (so runs compare token for token)."""
    more.setdefault("structured_outputs", JSON)
    return [
        SamplingParams(temperature=1.0, max_tokens=150, seed=i, **more) for i in range(n_requests)
    ]


def assert_valid(outs, schema=SCHEMA) -> None:
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop", (c.finish_reason, c.text)
            jsonschema.validate(json.loads(c.text), schema)


def prompts(k: int = 20) -> list[list[int]]:
    return make_prompts(seed=5, lens=[3 + i % 7 for i in range(k)])


@pytest.mark.parametrize(
    ("scheduler", "chunk_size"), [("sarathi", 7), ("sarathi", 1000), ("vllm", 64), ("orca", 16)]
)
def test_sampled_json_validates_for_every_scheduler(llama_dir, scheduler, chunk_size):
    with LLM(
        str(llama_dir), scheduler=scheduler, chunk_size=chunk_size, tile_align=False, **KW
    ) as llm:
        outs = llm.generate(prompts(), sampled(), use_tqdm=False)
        # the last to finish is released with the next micro-batch (MicroBatch.released)
        llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert llm.engine.executor.runner.grammar._follow == {}  # every matcher released
    assert_valid(outs)
    assert len({o.outputs[0].text for o in outs}) > 10  # sampled, not one answer


def test_sampling_rules_and_penalties_stay_within_the_grammar(llama_dir):
    params = sampled(
        top_k=20, top_p=0.9, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.5,
        repetition_penalty=1.2, logit_bias={ord("x"): 5.0},
    )  # fmt: skip
    greedy = [SamplingParams(temperature=0.0, max_tokens=150, structured_outputs=JSON)]
    with LLM(str(llama_dir), **KW) as llm:
        outs = llm.generate(prompts(21), params + greedy, use_tqdm=False)
    assert_valid(outs)


def test_choice_and_regex_match(llama_dir):
    choice = sampled(structured_outputs={"choice": CHOICES})
    regex = sampled(structured_outputs={"regex": REGEX})
    with LLM(str(llama_dir), **KW) as llm:
        chosen = llm.generate(prompts(), choice, use_tqdm=False)
        matched = llm.generate(prompts(), regex, use_tqdm=False)
        json_object = llm.generate(
            prompts(4), sampled(4, structured_outputs={"json_object": True, "disable_any_whitespace": True}),
            use_tqdm=False,
        )  # fmt: skip
    assert {o.outputs[0].text for o in chosen} <= set(CHOICES)
    assert len({o.outputs[0].text for o in chosen}) > 1
    for o in matched:
        assert re.fullmatch(REGEX, o.outputs[0].text), o.outputs[0].text
    for o in json_object:
        if o.outputs[0].finish_reason == "stop":  # any object: it may run long
            assert isinstance(json.loads(o.outputs[0].text), dict)


def test_greedy_under_a_grammar_equals_hf_with_the_same_mask(llama_dir):
    """The reference: Hugging Face's logits, each step masked by an llguidance matcher fed
    the output so far (the engine's token ids must equal it)."""
    tokenizer = llguidance.hf.from_tokenizer(
        AutoTokenizer.from_pretrained(str(llama_dir)), n_vocab=259, eos_token=EOS_TOKEN_ID
    )
    text = grammar_text(JSON)

    def masked(logits, tokens, out):
        if EOS_TOKEN_ID in out:  # the grammar ended: the rest is cut off below
            return logits
        m = llguidance.LLMatcher(tokenizer, text)
        assert m.consume_tokens(out) if out else True
        bits = torch.tensor(list(m.compute_bitmask()), dtype=torch.uint8)
        allowed = ((bits.unsqueeze(-1) >> torch.arange(8)) & 1).bool().flatten()[: len(logits)]
        return logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)

    ps = prompts(3)
    with LLM(str(llama_dir), **KW) as llm:
        outs = llm.generate(
            ps, SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=JSON), use_tqdm=False
        )  # fmt: skip
    assert_valid(outs)
    for prompt, out in zip(ps, outs):
        ref, margins = hf_processed_greedy(llama_dir, prompt, 100, masked)
        ref = ref[: ref.index(EOS_TOKEN_ID) + 1]  # the output ends with EOS, as the grammar
        assert_greedy_match(out.outputs[0].token_ids, ref, margins[: len(ref)])


def test_preemption_rebuilds_the_matcher_from_the_tokens(llama_dir):
    ps = make_prompts(seed=3, lens=(40, 41, 42, 43))
    params = sampled(4)
    with LLM(str(llama_dir), dtype="float32", **PREEMPTING) as llm:
        preempted = llm.generate(ps, params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
    with LLM(str(llama_dir), **KW) as llm:
        plain = llm.generate(ps, params, use_tqdm=False)
    assert_valid(preempted)
    assert [o.outputs[0].token_ids for o in preempted] == [o.outputs[0].token_ids for o in plain]


def test_scheduling_ahead_equals_not_ahead(llama_dir):
    runs = []
    for ahead in (False, True):
        with LLM(
            str(llama_dir), chunk_size=16, tile_align=False, schedule_ahead=ahead, **KW
        ) as llm:
            assert llm.engine.schedule_ahead == ahead
            runs.append(llm.generate(prompts(), sampled(), use_tqdm=False))
    assert_valid(runs[1])
    assert [o.outputs[0].token_ids for o in runs[1]] == [o.outputs[0].token_ids for o in runs[0]]


def test_n_completions_each_follow_the_grammar(llama_dir):
    with LLM(str(llama_dir), **KW) as llm:
        outs = llm.generate(prompts(3), sampled(3, n=4), use_tqdm=False)
    assert_valid(outs)
    assert all(len(o.outputs) == 4 for o in outs)


def test_a_request_that_fails_alone_leaves_the_others_valid(llama_dir):
    """Sequence 2 makes the stage raise: its micro-batches run again one sequence at a
    time, and the others' matchers follow their outputs through the reruns."""
    with LLM(str(llama_dir), **KW, **{"parallel.inject_fault": "raise@stage=0,seq=2"}) as llm:
        outs = llm.generate(prompts(6), sampled(6), use_tqdm=False)
    assert outs[2].outputs[0].finish_reason == "error"
    assert_valid(outs[:2] + outs[3:])


def test_a_schema_the_engine_cannot_compile_is_refused_before_any_work(llama_dir):
    bad = SamplingParams(
        structured_outputs={"json": {"type": "object", "properties": {"a": {"type": "nope"}}}}
    )
    with LLM(str(llama_dir), **KW) as llm:
        with pytest.raises(
            ValueError, match=r"structured_outputs.json .*cannot be compiled: .*nope"
        ):
            llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(), bad], use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
