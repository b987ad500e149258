"""The engine end to end on a tiny random Llama: sampling, stopping, text, metrics, the
run dir, and failure isolation."""

from __future__ import annotations

import csv
import json
import logging
import random
import shutil

import pytest
import yaml
from helpers import hf_greedy, record_submits

from sarathi_pp import LLM, LLMEngine, SamplingParams, load_config


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), max_model_len=128, chunk_size=32, tile_size=16)


def prompts(n=3, length=20, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(length + i)] for i in range(n)]


def ids(out):
    return out.outputs[0].token_ids


def test_accepts_every_prompt_form_and_keeps_order(llm, llama_dir):
    p = prompts(1)[0]
    outs = llm.generate(
        ["Hello there", {"prompt_token_ids": p}, p],
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    assert outs[0].prompt == "Hello there"
    assert outs[0].prompt_token_ids == llm.get_tokenizer().encode("Hello there")
    assert ids(outs[1]) == ids(outs[2]) == hf_greedy(llama_dir, p, 6)[0]
    # text holds the generated text only, decoded by the model folder's tokenizer
    tok = llm.get_tokenizer()
    assert outs[0].outputs[0].text == tok.decode(ids(outs[0]), skip_special_tokens=True)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    p = prompts(3)
    sp = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate([p[0]], sp, use_tqdm=False)
    batched = llm.generate(p, sp, use_tqdm=False)
    assert ids(alone[0]) == ids(batched[0])
    other_seed = llm.generate(
        [p[0]],
        SamplingParams(max_tokens=10, temperature=1.0, seed=99, ignore_eos=True),
        use_tqdm=False,
    )
    greedy = llm.generate(
        [p[0]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False
    )
    assert ids(other_seed[0]) != ids(alone[0]) or ids(alone[0]) != ids(greedy[0])


def test_top_k_one_is_greedy(llm):
    p = prompts(2)
    greedy = llm.generate(
        p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False
    )
    top1 = llm.generate(
        p, SamplingParams(max_tokens=8, temperature=0.8, top_k=1, ignore_eos=True), use_tqdm=False
    )
    assert [ids(o) for o in greedy] == [ids(o) for o in top1]
    tiny_p = llm.generate(
        p,
        SamplingParams(max_tokens=8, temperature=0.8, top_p=1e-6, ignore_eos=True),
        use_tqdm=False,
    )
    assert [ids(o) for o in greedy] == [ids(o) for o in tiny_p]


def test_stop_token_ids_and_max_tokens(llm):
    p = prompts(1)[0]
    full = ids(
        llm.generate(
            [p], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False
        )[0]
    )
    stop_at = full[4]
    first = full.index(stop_at)
    out = llm.generate(
        [p], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at]), use_tqdm=False
    )[0]
    assert ids(out) == full[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at
    out = llm.generate(
        [p], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False
    )[0]
    assert ids(out) == full[:3] and out.outputs[0].finish_reason == "length"


def test_stop_string_is_cut_from_the_text(llm):
    p = prompts(1, seed=5)[0]
    full = llm.generate(
        [p], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False
    )[0]
    text = full.outputs[0].text
    assert len(text) >= 4, text
    stop = text[2:4]
    out = llm.generate(
        [p],
        SamplingParams(max_tokens=12, temperature=0, stop=[stop], ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.outputs[0].text == text[: text.index(stop)]


def test_include_stop_str_in_output_keeps_it(llm):
    p = prompts(1, seed=5)[0]
    base = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    text = llm.generate([p], base, use_tqdm=False)[0].outputs[0].text
    stop = text[2:4]
    kept = SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
    )
    out = llm.generate([p], kept, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop) + len(stop)] and out.text.endswith(stop)


def test_skip_special_tokens_false_keeps_their_text(llm):
    """Special tokens' text is left out unless ``skip_special_tokens=False`` (as vLLM), in
    the streamed text and the final one alike."""
    from sarathi_pp.engine.output_processor import OutputProcessor
    from sarathi_pp.sequence import Sequence

    tokenizer = llm.get_tokenizer()
    special = tokenizer.all_special_ids[0]
    outputs = OutputProcessor(tokenizer, eos_token_ids=set(), max_model_len=128)
    texts = {}
    for skip in (True, False):
        params = SamplingParams(max_tokens=3, skip_special_tokens=skip)
        seq = Sequence(int(skip), "r", [72, 105], params, 0.0)
        outputs.add(seq)
        streamed = []
        for token in (72, special, 105):
            seq.append_token(token, 0.0)
            outputs.check_stop(seq)
            streamed.append(outputs.output(seq).outputs[0].text)
        texts[skip] = streamed
    special_text = tokenizer.decode([special])
    assert special_text and texts[True][-1] == "Hi"
    assert texts[False][-1] == "H" + special_text + "i"


def _eos_at_the_fourth_token(llama_dir, tmp_path):
    """A prompt, its 10 greedy tokens, the fourth of them, and a copy of the model whose
    config names that token its EOS."""
    p = prompts(1, seed=7)[0]
    full, _ = hf_greedy(llama_dir, p, 10)
    eos = full[3]
    model = tmp_path / "m"
    shutil.copytree(llama_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (model / "config.json").write_text(json.dumps(cfg))
    return p, full, eos, model


def test_eos_from_the_checkpoint_stops_unless_ignored(llama_dir, tmp_path):
    p, full, eos, model = _eos_at_the_fourth_token(llama_dir, tmp_path)
    llm = LLM(str(model), max_model_len=128)
    out = llm.generate([p], SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)[0]
    assert ids(out) == full[: full.index(eos) + 1] and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason is None  # as vLLM: EOS is no stop token of the request
    as_stop_token = SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[eos])
    out = llm.generate([p], as_stop_token, use_tqdm=False)[0]
    assert out.outputs[0].stop_reason == eos
    out = llm.generate(
        [p], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False
    )[0]
    assert ids(out) == full


def test_min_tokens_rules_out_eos_until_reached(llama_dir, tmp_path):
    p, full, eos, model = _eos_at_the_fourth_token(llama_dir, tmp_path)
    with LLM(str(model), max_model_len=128) as llm:
        out = llm.generate(
            [p], SamplingParams(max_tokens=10, temperature=0, min_tokens=6), use_tqdm=False
        )[0]
        # as a stop token too
        stop = llm.generate(
            [p], SamplingParams(max_tokens=10, temperature=0, min_tokens=6, stop_token_ids=[full[0]]),
            use_tqdm=False,
        )[0]  # fmt: skip
    tokens = ids(out)
    assert tokens[:3] == full[:3] and tokens[3] != eos  # EOS ruled out at output 4
    assert len(tokens) >= 6 and eos not in tokens[:6]
    assert full[0] not in ids(stop)[:6] and eos not in ids(stop)[:6]


def test_logit_bias(llm, llama_dir):
    p = prompts(1, seed=8)[0]
    forced = llm.generate(
        [p], SamplingParams(max_tokens=5, temperature=0, logit_bias={65: 100.0}), use_tqdm=False
    )[0]
    assert ids(forced) == [65] * 5
    plain, _ = hf_greedy(llama_dir, p, 5)
    banned = llm.generate(
        [p], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logit_bias={plain[0]: -100}),
        use_tqdm=False,
    )[0]  # fmt: skip
    assert ids(banned)[0] != plain[0]
    with pytest.raises(ValueError, match=r"logit_bias has token ids outside \[0, 259\): \[999\]"):
        llm.generate([p], SamplingParams(logit_bias={999: 1.0}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_max_model_len_ends_with_length(llm):
    p = prompts(1, length=120)[0]
    out = llm.generate(
        [p], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(p) + len(ids(out)) == 128
    assert out.outputs[0].finish_reason == "length"


def test_per_token_metrics(llm):
    outs = llm.generate(
        prompts(3), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False
    )
    for o in outs:
        m = o.metrics
        assert len(m.token_times) == 5
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time == m.token_times[0]
        assert m.token_times == sorted(m.token_times) and m.finished_time >= m.token_times[-1]
        assert m.ttft > 0 and len(m.tbt) == 4


@pytest.mark.parametrize(
    "bad, match",
    [
        ([[5, 6], []], "prompt 1 is empty"),
        ([[5, 6], [7] * 200], "prompt 1 has 200 tokens, more than max_model_len=128"),
        ([[5, 999]], r"prompt 0 has token ids outside \[0, 259\)"),
        ([""], "prompt 0 is empty"),
    ],
)
def test_bad_prompts_fail_before_any_work(llm, bad, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(bad, SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n must be"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def _edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_bad_model_folders(llama_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        LLM(str(tmp_path / "nope"))
    d = _edit_config(llama_dir, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(d)
    rope = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0}
    d = _edit_config(llama_dir, tmp_path / "yarn", rope_parameters=rope)
    with pytest.raises(ValueError, match="'yarn'"):
        LLM(d)
    d = _edit_config(
        llama_dir, tmp_path / "sw", architectures=["MistralForCausalLM"], sliding_window=64
    )
    with pytest.raises(ValueError, match="sliding-window.*64"):
        LLM(d)
    LLM(d, max_model_len=64)  # a window no shorter than the model length is fine


def test_missing_layer_weights_are_named(llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "m"
    shutil.copytree(llama_dir, d)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj.weight"):
        LLM(str(d))
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no safetensors"):
        LLM(str(d))


def test_bad_configs(llama_dir):
    with pytest.raises(ValueError, match="unknown scheduler 'fifo'.*sarathi"):
        LLM(str(llama_dir), scheduler="fifo")
    with pytest.raises(ValueError, match="chunk_size must be an integer >= 1 or 'auto', got 0"):
        LLM(str(llama_dir), chunk_size=0)
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len=512"):
        LLM(str(llama_dir), num_kv_blocks=4)
    with pytest.raises(ValueError, match="unknown keyword 'chunksize'"):
        LLM(str(llama_dir), chunksize=3)


def test_a_failing_request_fails_alone(llm, llama_dir, monkeypatch):
    """A request whose step raises finishes with an error; the others complete exactly."""
    poison = 11
    good = prompts(2, seed=9)
    model = llm.engine.executor.runner.model
    real_forward = model.forward

    def forward(inputs, meta, kv):
        if inputs.dim() == 1 and (inputs == poison).any():
            raise RuntimeError("poisoned token")
        return real_forward(inputs, meta, kv)

    monkeypatch.setattr(model, "forward", forward)
    good = [[t for t in g if t != poison] for g in good]
    outs = llm.generate(
        [good[0], [poison, 12, 13], good[1]],
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    assert outs[1].outputs[0].finish_reason == "error" and "poisoned token" in outs[1].error
    for o, p in ((outs[0], good[0]), (outs[2], good[1])):
        assert o.outputs[0].finish_reason == "length" and o.error is None
        assert ids(o) == hf_greedy(llama_dir, p, 6)[0]
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_run_dir(llama_dir, tmp_path):
    run = tmp_path / "run"
    llm = LLM(str(llama_dir), max_model_len=128, run_dir=str(run))
    llm.generate(
        prompts(2), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False
    )
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["model"]["max_model_len"] == 128 and cfg["cache"]["block_size"] == 16
    assert load_config(run / "config.yaml").scheduler.policy == "sarathi"  # loadable as is
    with open(run / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and all(int(r["num_output_tokens"]) == 4 for r in rows)
    assert all(float(r["ttft_s"]) > 0 for r in rows)
    with pytest.raises(ValueError, match="not empty"):
        LLM(str(llama_dir), run_dir=str(run))
    LLM(str(llama_dir), max_model_len=128, run_dir=str(run), overwrite=True)


def test_online_engine_abort_frees_blocks(llama_dir):
    engine = LLMEngine(load_config(None, model=str(llama_dir), max_model_len=128))
    sp = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts(3)):
        engine.add_request(str(i), None, sp, prompt_token_ids=p)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("0", None, sp, prompt_token_ids=[1, 2])
    for _ in range(5):
        engine.step()
    engine.abort("1")
    engine.abort("1")  # twice: still one final output
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.finished or out.request_id != "1"
            if out.finished:
                assert out.request_id not in finished
                finished[out.request_id] = out
    assert set(finished) == {"0", "1", "2"}  # the abort's final output came with a step
    assert finished["1"].outputs[0].finish_reason == "abort"
    assert 0 < len(finished["1"].outputs[0].token_ids) < 50
    assert engine.step() == []  # nothing more for it
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_shutdown_releases_the_weights_and_the_kv_cache(llama_dir):
    """A shut-down in-process pipeline holds no tensors: on CUDA its memory goes back to the
    device, for the next pipeline in the process or another process's stage
    (``ModelRunner.release``); using it afterwards is a clear error."""
    import weakref

    llm = LLM(str(llama_dir), max_model_len=128)
    worker = llm.engine.executor.runner
    kv = weakref.ref(worker.kv.k[0])  # one layer's K blocks
    [out] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(ids(out)) == 2
    llm.shutdown()
    assert worker.model is None and worker.kv is None
    assert kv() is None  # nothing else kept it
    from sarathi_pp.engine import EngineDeadError

    with pytest.raises(EngineDeadError, match="engine is dead: it was shut down"):
        llm.generate([[5, 6, 7]], use_tqdm=False)
    llm.shutdown()  # twice: nothing more


@pytest.mark.parametrize("in_flight", [1, 3])
def test_in_flight_above_one_on_the_single_process_executor_is_warned(llama_dir, caplog, in_flight):
    """One stage computes each micro-batch as it is submitted: more than one in flight only
    holds each sequence's next decode for that many micro-batches while prompts remain (the
    warning says so, and the hybrid micro-batches show it); one in flight, no warning."""
    with caplog.at_level(logging.WARNING, logger="sarathi_pp.executors.uniproc"):
        llm = LLM(str(llama_dir), max_model_len=128, chunk_size=16,
                  num_microbatches_in_flight=in_flight)  # fmt: skip
    warned = f"num_microbatches_in_flight={in_flight} on the single-process executor"
    assert (warned in caplog.text) == (in_flight > 1)
    seen = record_submits(llm.engine, lambda mb: (
        mb.microbatch_id, mb.kind == "hybrid", {c.seq_id for c in mb.chunks if not c.is_prefill},
    ))  # fmt: skip
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm.generate(prompts(n=4, length=60), params, use_tqdm=False)
    hybrids = [(i, decoding) for i, hybrid, decoding in seen if hybrid]
    assert len(hybrids) >= 4
    nearest = min(
        j - i for n, (i, a) in enumerate(hybrids) for j, b in hybrids[n + 1 :] if a & b
    )  # the fewest micro-batches between two decodes of one sequence beside a prompt's chunk
    assert nearest == in_flight
    llm.shutdown()
