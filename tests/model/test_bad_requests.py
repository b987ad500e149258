"""Bad requests are refused before any work, naming the value: ``True`` as a token id,
an ``arrival_time`` not on the engine's clock, sampling parameters of the wrong type; numpy
integers are taken as plain ints."""

from __future__ import annotations

import math
import shutil
import time

import numpy as np
import pytest

from sarathi_pp import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir):
    with LLM(str(llama_dir), max_model_len=128, chunk_size=32) as llm:
        yield llm


@pytest.mark.parametrize(
    "bad, match",
    [
        ([[5, True, 7]], r"prompt 0: token id at position 1 is True \(bool\), not an integer"),
        ([[5, 6], {"prompt_token_ids": [False]}], r"prompt 1: token id at position 0 is False"),
        ([5, 6, True], r"prompt 0: token id at position 2 is True"),
        ([[5, 6.0]], r"prompt 0: token id at position 1 is 6.0 \(float\)"),
    ],
)
def test_generate_refuses_bool_token_ids(llm, bad, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(bad, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"max_tokens": 2}, r"sampling_params must be a SamplingParams or a list .* got dict"),
        ("greedy", r"sampling_params must be a SamplingParams or a list .* got str"),
        ([GREEDY, {"max_tokens": 2}], r"sampling_params\[1\] must be SamplingParams, got dict"),
    ],
)
def test_generate_refuses_sampling_params_of_the_wrong_type(llm, bad, match):
    with pytest.raises(TypeError, match=match):
        llm.generate([[5, 6], [7, 8]], bad, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_add_request_refuses_bool_token_ids(llm):
    with pytest.raises(ValueError, match=r"request 'b': token id at position 0 is True"):
        llm.engine.add_request("b", None, GREEDY, prompt_token_ids=[True, 5])
    assert not llm.engine.has_unfinished_requests()


def test_numpy_token_ids_reach_the_scheduler_as_int(llm):
    p = [5, 17, 42, 99]
    want = llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    arr = np.array(p, dtype=np.int64)
    outs = llm.generate(
        [list(arr), {"prompt_token_ids": arr}, tuple(arr.astype(np.int32))], GREEDY,
        use_tqdm=False,
    )  # fmt: skip
    outs.append(llm.generate(arr, GREEDY, use_tqdm=False)[0])  # one prompt as an array
    for out in outs:
        assert out.prompt_token_ids == p and out.outputs[0].token_ids == want
        assert all(type(t) is int for t in out.prompt_token_ids)
    engine = llm.engine
    engine.add_request("np", None, GREEDY, prompt_token_ids=arr)
    seq = engine._requests["np"]
    assert all(type(t) is int for t in seq.prompt_token_ids)
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("offset_s", [None, 0.0, -30.0, 0.5])
def test_arrival_time_on_the_engine_clock_is_accepted(llm, offset_s):
    engine = llm.engine
    rid = f"ok{offset_s}"
    arrival = None if offset_s is None else engine.now() + offset_s
    engine.add_request(rid, None, GREEDY, prompt_token_ids=[5, 6], arrival_time=arrival)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == [rid]
    if arrival is not None:
        assert outs[0].metrics.arrival_time == arrival


@pytest.mark.parametrize(
    "arrival, match",
    [
        (time.time(), r"arrival_time=\d+\.\d+ is \d+\.\d+ s later than the engine's clock now"),
        (math.nan, "arrival_time must be finite, got nan"),
        (math.inf, "arrival_time must be finite, got inf"),
        ("0", "arrival_time must be a number or None, got '0'"),
        (True, "arrival_time must be a number or None, got True"),
    ],
)
def test_arrival_time_off_the_engine_clock_is_refused(llm, arrival, match):
    engine = llm.engine
    with pytest.raises(ValueError, match=match) as e:
        engine.add_request("late", None, GREEDY, prompt_token_ids=[5, 6], arrival_time=arrival)
    assert "time.monotonic()" in str(e.value)
    assert not engine.has_unfinished_requests()
    # Nothing was queued: the id is free for a good request.
    engine.add_request("late", None, GREEDY, prompt_token_ids=[5, 6])
    while engine.has_unfinished_requests():
        engine.step()


def test_arrival_time_names_both_clocks(llm):
    now = llm.engine.now()
    with pytest.raises(ValueError) as e:
        llm.engine.add_request("f", None, GREEDY, prompt_token_ids=[5], arrival_time=now + 60)
    msg = str(e.value)
    assert f"arrival_time={now + 60!r}" in msg and "s later than the engine's clock now (" in msg


def test_a_budget_past_this_machine_is_refused_at_start(llama_dir):
    from sarathi_pp.config import GiB
    from sarathi_pp.stages.worker.device import machine_memory_bytes

    memory = machine_memory_bytes()
    if memory is None:
        pytest.skip("this machine's memory cannot be read")
    budget = memory // GiB * GiB + GiB  # one stage is already more than the machine
    with pytest.raises(ValueError, match=rf"cache.cpu_memory_budget={budget} bytes .* x 1 stage"):
        LLM(str(llama_dir), max_model_len=64, cpu_memory_budget=budget, device="cpu")


def test_a_folder_without_a_tokenizer_says_how_to_name_one(llama_dir, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in [llama_dir / "config.json", *llama_dir.glob("*.safetensors")]:
        shutil.copy(f, bare)
    with LLM(str(bare), max_model_len=64) as llm:
        with pytest.raises(ValueError, match=r"has no tokenizer: .*--set model.tokenizer=DIR"):
            llm.generate(["hi"], GREEDY, use_tqdm=False)
        (out,) = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)  # token ids still work
        assert len(out.outputs[0].token_ids) == 3
    with LLM(str(bare), max_model_len=64, tokenizer=str(llama_dir)) as llm:  # as it says
        (out,) = llm.generate(["hi"], GREEDY, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 3
