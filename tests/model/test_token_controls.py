"""vLLM's ``allowed_token_ids``, ``bad_words`` and ``truncate_prompt_tokens``.

Greedy tokens with the first two equal a reference that applies vLLM's rules to Hugging
Face's logits step by step (checked against HF's own ``bad_words_ids`` for one-token
words), for every scheduler and chunk size and through preemption (a bad word of several
tokens needs the output so far on the last stage: the recompute brings it again);
``truncate_prompt_tokens`` equals running the prompt's last tokens.
"""

from __future__ import annotations

import pytest
import torch
from helpers import _hf_model, assert_greedy_match, hf_processed_greedy
from test_vs_hf import make_prompts, preempting_run

from sarathi_pp import LLM, SamplingParams
from sarathi_pp.stages.worker.sampler import processed_logits

KW = dict(max_model_len=256, dtype="float32")
MAX_TOKENS = 12
GREEDY = dict(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def hf_ruled_greedy(model_dir, prompt, max_new_tokens, allowed=None, bad=()):
    """Greedy decoding over HF's logits with vLLM's rules: only ``allowed`` ids, and a bad
    word's last token out where the output so far ends with the rest of it; the tokens and
    each step's top-2 margin (over the tokens left)."""

    def rule(logits, tokens, out):
        if allowed is not None:
            keep = torch.zeros_like(logits, dtype=torch.bool)
            keep[list(allowed)] = True
            logits[~keep] = float("-inf")
        for word in bad:
            prefix = list(word[:-1])
            if len(prefix) <= len(out) and (not prefix or out[-len(prefix) :] == prefix):
                logits[word[-1]] = float("-inf")
        return logits

    return hf_processed_greedy(model_dir, prompt, max_new_tokens, rule)


def test_the_reference_agrees_with_hf_bad_words_ids(llama_dir):
    prompt = make_prompts(seed=12)[1]
    model = _hf_model(str(llama_dir))
    ids = torch.tensor([prompt])
    plain, _ = hf_ruled_greedy(llama_dir, prompt, MAX_TOKENS)
    bad = [[plain[0]], [plain[3]]]  # one-token words: banned everywhere, as vLLM's
    with torch.no_grad():
        hf = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
            bad_words_ids=bad, eos_token_id=None, pad_token_id=model.config.pad_token_id,
        )[0, len(prompt):].tolist()  # fmt: skip
    ours, _ = hf_ruled_greedy(llama_dir, prompt, MAX_TOKENS, bad=bad)
    assert ours == hf != plain


def _two_token_words(outputs) -> list[tuple[int, int]]:
    """A two-token word from each output, not at its start (so the rule needs the output's
    tokens before it)."""
    return [tuple(o.outputs[0].token_ids[2:4]) for o in outputs]


@pytest.mark.parametrize(
    ("scheduler", "chunk_size"), [("sarathi", 7), ("sarathi", 1000), ("vllm", 64), ("orca", 16)]
)
def test_allowed_and_bad_words_match_the_reference(llama_dir, scheduler, chunk_size):
    prompts = make_prompts(seed=13)
    with LLM(
        str(llama_dir), scheduler=scheduler, chunk_size=chunk_size, tile_align=False, **KW
    ) as llm:
        plain = llm.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
        words = _two_token_words(plain)
        allowed = sorted({t for o in plain for t in o.outputs[0].token_ids[::2]})
        ruled = [
            SamplingParams(allowed_token_ids=allowed, **GREEDY),
            SamplingParams(bad_words_token_ids=words, **GREEDY),
            SamplingParams(allowed_token_ids=allowed, bad_words_token_ids=words, **GREEDY),
        ]
        runs = [llm.generate(prompts, params, use_tqdm=False) for params in ruled]
        llm.generate(prompts[:1], SamplingParams(**GREEDY), use_tqdm=False)  # carries the last
        assert llm.engine.executor.runner.penalties.tokens == {}  # every history released
    for params, outs in zip(ruled, runs):
        assert [o.outputs[0].token_ids for o in outs] != [o.outputs[0].token_ids for o in plain]
        for prompt, out in zip(prompts, outs):
            got = out.outputs[0].token_ids
            ref, margins = hf_ruled_greedy(
                llama_dir, prompt, MAX_TOKENS, params.allowed_token_ids, words
                if params.bad_words_token_ids else (),
            )  # fmt: skip
            assert_greedy_match(got, ref, margins)
            if params.allowed_token_ids is not None:
                assert set(got) <= set(allowed)
            if params.bad_words_token_ids:
                pairs = set(zip(got, got[1:]))
                assert not pairs & set(words)


def test_bad_words_survive_preemption(llama_dir):
    prompts, plain = preempting_run(llama_dir, SamplingParams(**GREEDY))
    words = _two_token_words(plain)
    _, outs = preempting_run(llama_dir, SamplingParams(bad_words_token_ids=words, **GREEDY))
    for prompt, out in zip(prompts, outs):
        ref, margins = hf_ruled_greedy(llama_dir, prompt, MAX_TOKENS, bad=words)
        assert_greedy_match(out.outputs[0].token_ids, ref, margins)
    assert [o.outputs[0].token_ids for o in outs] != [o.outputs[0].token_ids for o in plain]


def test_bad_words_as_text_are_tokenized_as_vllm_does(llama_dir):
    """The byte tokenizer: a word is its bytes' tokens; with a space before it is one token
    longer, so only the word as it is gets ruled out (vLLM keeps the spaced form only when
    it has as many tokens)."""
    with LLM(str(llama_dir), chunk_size=16, tile_align=False, **KW) as llm:
        tok = llm.get_tokenizer()
        letters = tok.encode("abcdefgh", add_special_tokens=False)  # readable text out
        common = dict(allowed_token_ids=letters, **GREEDY)
        plain = llm.generate(["The cat sat"], SamplingParams(**common), use_tqdm=False)[0]
        text = plain.outputs[0].text
        word = text[2:4]
        ids = tuple(tok.encode(word, add_special_tokens=False))
        assert len(ids) == 2 and len(tok.encode(" " + word, add_special_tokens=False)) == 3
        params = SamplingParams(bad_words=[word, " " + word], **common)
        assert llm.engine.inputs.with_bad_words(params, "test").bad_words_token_ids == (ids,)
        out = llm.generate(["The cat sat"], params, use_tqdm=False)[0]
    assert word not in out.outputs[0].text
    assert out.outputs[0].text != text and len(out.outputs[0].text) == MAX_TOKENS


def test_truncate_prompt_tokens_runs_the_prompts_tail(llama_dir):
    prompts = make_prompts(seed=14, lens=(30, 9, 50))
    with LLM(str(llama_dir), chunk_size=16, tile_align=False, **KW) as llm:
        cut = llm.generate(
            prompts, SamplingParams(truncate_prompt_tokens=10, **GREEDY), use_tqdm=False
        )
        tails = llm.generate([p[-10:] for p in prompts], SamplingParams(**GREEDY), use_tqdm=False)
        for c, t, prompt in zip(cut, tails, prompts):
            assert c.prompt_token_ids == prompt[-10:]
            assert c.outputs[0].token_ids == t.outputs[0].token_ids
        # -1: the last max_model_len tokens; a prompt that long is refused without it
        long = make_prompts(seed=15, lens=(300,))
        with pytest.raises(ValueError, match="more than max_model_len=256"):
            llm.generate(long, SamplingParams(**GREEDY), use_tqdm=False)
        params = SamplingParams(truncate_prompt_tokens=-1, max_tokens=1, ignore_eos=True)
        out = llm.generate(long, params, use_tqdm=False)[0]
        assert out.prompt_token_ids == long[0][-256:]
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        (dict(allowed_token_ids=[3, 259]), r"allowed_token_ids has token ids outside \[0, 259\)"),
        (dict(bad_words_token_ids=[[3, 300]]), r"bad_words has token ids outside \[0, 259\)"),
        (
            dict(allowed_token_ids=[3, 4], bad_words_token_ids=[[3], [4]]),
            "allowed_token_ids leaves no token to sample: each is a bad word$",
        ),
        (
            dict(
                allowed_token_ids=[3, 4],
                bad_words_token_ids=[[3]],
                stop_token_ids=[4],
                min_tokens=1,
            ),
            "allowed_token_ids leaves no token to sample: each is a bad word or an EOS or stop",
        ),
    ],
)
def test_ids_past_the_vocabulary_or_nothing_left_are_refused_before_any_work(
    llama_dir, kwargs, says
):
    with LLM(str(llama_dir), **KW) as llm:
        with pytest.raises(ValueError, match=f"prompt 1: {says}") as e:
            llm.generate([[5, 6], [7, 8]], [SamplingParams(), SamplingParams(**kwargs)])
        assert e.value.param in kwargs or e.value.param == "bad_words"
        assert not llm.engine.has_unfinished_requests()
        # a two-token bad word rules its last token out only after its first: not refused
        # up front, but once nothing is left the request fails alone, saying so
        late = SamplingParams(allowed_token_ids=[3], bad_words_token_ids=[[3, 3]], max_tokens=4)
        out, other = llm.generate(
            [[5, 6], [7, 8]], [late, SamplingParams(max_tokens=4, ignore_eos=True)]
        )
        assert out.outputs[0].token_ids == [3] and out.outputs[0].finish_reason == "error"
        assert "every token was ruled out" in out.outputs[0].error
        assert other.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
        (dict(allowed_token_ids=[1.0]), "allowed_token_ids"),
        (dict(bad_words=[" "]), "bad_words"),
        (dict(bad_words=[3]), "bad_words"),
        (dict(bad_words_token_ids=[[]]), "bad_words"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    ],
)
def test_bad_values_name_their_field(kwargs, param):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_rules_on_hand_made_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]] * 3)
    params = [
        SamplingParams(allowed_token_ids=[1, 2]),
        SamplingParams(bad_words_token_ids=[[3], [4, 2], [1, 0]]),
        SamplingParams(bad_words_token_ids=[[4, 2]], logit_bias={2: 1.0}),
    ]
    # row 1's output so far ends with 4: [4, 2] rules out 2; [1, 0] does not apply
    out = processed_logits(logits, params, [0, 2, 0], (), outputs={1: [1, 4], 2: []})
    low = torch.finfo(torch.float32).min
    assert out[0].tolist() == [low, -1.0, 0.5, low, low]
    assert out[1].tolist() == [2.0, -1.0, low, low, 0.0]
    assert out[2].tolist() == [2.0, -1.0, 1.5, 3.0, 0.0]  # no output yet: [4, 2] cannot end
    assert logits[0].tolist() == [2.0, -1.0, 0.5, 3.0, 0.0]  # the raw logits stay
    assert SamplingParams(bad_words_token_ids=[[4, 2]]).keeps_tokens
    assert not SamplingParams(bad_words_token_ids=[[4]]).keeps_tokens
