"""A vLLM user's habits against a live ``sarathi-pp serve`` (the tiny random Llama, the
official ``openai`` client): the per-endpoint ``max_tokens`` defaults, the model folder's
``generation_config.json`` (its sampling defaults and extra EOS ids), every request field of
``sarathi_pp/serve/request_fields.py`` honoured or refused as listed, and vLLM's metric
names."""

from __future__ import annotations

import inspect
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from serving import running_server, with_chat_template  # noqa: E402

from sarathi_pp import LLM, SamplingParams  # noqa: E402
from sarathi_pp.serve.request_fields import FIELDS  # noqa: E402

MODEL = "tiny"
MAX_MODEL_LEN = 96
PROMPT = "The pipeline"
_MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def chat_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a chat template."""
    return with_chat_template(llama_dir, tmp_path_factory.mktemp("habits") / "llama")


@pytest.fixture(scope="module")
def server(chat_dir: Path) -> Iterator:
    with running_server(chat_dir, max_model_len=MAX_MODEL_LEN) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> Any:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


# --- honest defaults -----------------------------------------------------------------------
def test_chat_without_max_tokens_runs_to_the_end_of_the_context(client) -> None:
    # vLLM's chat default: the rest of the context (the random model never says EOS here)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    use = r.usage
    assert r.choices[0].finish_reason == "length"
    assert use.prompt_tokens + use.completion_tokens == MAX_MODEL_LEN > 16 + use.prompt_tokens


def test_completion_default_is_vllms_16(client) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0.0)
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
    # an explicit null: the rest of the context, as vLLM
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": None, "ignore_eos": True}
    use = httpx.post(str(client.base_url) + "completions", json=body).json()["usage"]
    assert use["prompt_tokens"] + use["completion_tokens"] == MAX_MODEL_LEN


def test_max_tokens_none_offline_runs_to_the_end_of_the_context(chat_dir: Path) -> None:
    with LLM(model=str(chat_dir), max_model_len=40) as llm:
        params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
        out = llm.generate([PROMPT], params, use_tqdm=False)[0]
        assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 40
        assert out.outputs[0].finish_reason == "length"


def test_generation_config_defaults_and_extra_eos(chat_dir: Path, tmp_path: Path) -> None:
    """The folder's temperature (0: greedy) is the default a request overrides; its extra
    EOS ids stop every request: a chat without max_tokens stops there, past 16 tokens.
    (And the server's ``--chat-template``, several served names.)"""
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"  # --chat-template
    with LLM(model=str(chat_dir)) as llm:
        greedy = SamplingParams(max_tokens=8, temperature=0.0)
        tokens = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids
        longer = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
        chat = llm.chat(_MSG, longer, use_tqdm=False, chat_template=template)[0]
    chat_tokens = chat.outputs[0].token_ids
    eos = tokens[3]
    first = tokens.index(eos)  # the first time it comes
    # a chat EOS first sampled past the 16th token, never in the completion's 8
    chat_end = next(
        i for i in range(17, 60)
        if chat_tokens[i] not in (*chat_tokens[:i], *tokens, eos, 2)
    )  # fmt: skip
    folder = tmp_path / "genconf"
    shutil.copytree(chat_dir, folder)
    config = {"eos_token_id": [2, eos, chat_tokens[chat_end]], "temperature": 0.0, "top_k": 5}
    (folder / "generation_config.json").write_text(json.dumps(config))
    with running_server(folder, names=[MODEL, "alias"], chat_template=template) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
        cards = client.models.list().data  # several --served-model-name, each a card
        max_len = server.engine_loop.engine.max_model_len
        assert [(c.id, c.max_model_len) for c in cards] == [(MODEL, max_len), ("alias", max_len)]
        r = client.completions.create(model="alias", prompt=PROMPT, max_tokens=1)
        assert r.model == MODEL  # responses carry the first name, as vLLM
        body = {"messages": [{"role": "user", "content": "abc"}]}
        tokens = httpx.post(server.base_url + "/tokenize", json=body).json()["tokens"]
        rendered = httpx.post(server.base_url + "/detokenize", json={"tokens": tokens}).json()
        assert rendered["prompt"] == "<s>[abc]"  # the server's template, not the tokenizer's
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8)
        assert r.choices[0].finish_reason == "stop"  # at the extra EOS
        assert r.usage.completion_tokens == first + 1
        again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8)
        assert again.choices[0].text == r.choices[0].text  # greedy by default
        sampled = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.5, seed=1,
            extra_body={"ignore_eos": True, "top_k": 0},
        )  # fmt: skip
        assert sampled.usage.completion_tokens == 8  # the request's values win
        assert eos not in chat_tokens[:chat_end]  # (the tiny model's greedy chat has none)
        reply = client.chat.completions.create(model=MODEL, messages=_MSG)  # no max_tokens
        assert reply.choices[0].finish_reason == "stop"
        assert reply.usage.completion_tokens == chat_end + 1 > 16


# --- every request field honoured or refused as listed ---------------------------------------
def _create(client: Any, endpoint: str, body: dict[str, Any]) -> Any:
    """``body`` through the official client: the fields its ``create`` takes as keywords,
    the rest (vLLM's) in ``extra_body``; a stream read to its end."""
    create = client.completions.create if endpoint == "completions" else (
        client.chat.completions.create
    )  # fmt: skip
    known = set(inspect.signature(create).parameters)
    kwargs = {k: v for k, v in body.items() if k in known}
    extra = {k: v for k, v in body.items() if k not in known}
    out = create(**kwargs, extra_body=extra or None)
    return list(out) if body.get("stream") else out


CASES = [(f, e) for f in FIELDS for e in f.endpoints]


@pytest.mark.parametrize("field, endpoint", CASES, ids=[f"{e}-{f.name}" for f, e in CASES])
def test_every_listed_field_is_honoured_or_refused(client, field, endpoint: str) -> None:
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 2}
    base.update({"prompt": "hi"} if endpoint == "completions" else {"messages": _MSG})
    body = {**base, **field.example}
    if field.honoured:
        _create(client, endpoint, body)  # no error
    else:
        with pytest.raises(openai.BadRequestError) as e:
            _create(client, endpoint, body)
        error = e.value.body
        assert error["param"] == field.name and field.name in error["message"], error


def test_request_id_names_the_response(client) -> None:
    r = _create(client, "completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1,
                                        "request_id": "abc"})  # fmt: skip
    assert r.id == "cmpl-abc"


def test_stop_token_ids_stop_the_stream_at_that_token(client, reference) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = reference.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    stop = tokens[4]
    first = tokens.index(stop)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"stop_token_ids": [stop], "ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "stop"
    assert chunks[-1].usage.completion_tokens == first + 1


def test_tool_call_history_and_template_fields_reach_the_template(server, client) -> None:
    """An assistant's ``tool_calls`` (arguments as a JSON string, handed to the template as
    an object, as vLLM) and a tool's ``tool_call_id`` rendered by a request's
    ``chat_template`` with its ``chat_template_kwargs``."""
    template = (
        "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
        "{% for c in m.get('tool_calls', []) %}[{{ c['function']['name'] }}"
        "({{ c['function']['arguments']['city'] }})]{% endfor %}"
        "{% if m.get('tool_call_id') %}#{{ m['tool_call_id'] }}{% endif %}\n{% endfor %}"
        "{% if flavour %}<{{ flavour }}>{% endif %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ]  # fmt: skip
    body = {"messages": messages, "chat_template": template,
            "chat_template_kwargs": {"flavour": "dry"}, "return_token_strs": False}  # fmt: skip
    tokens = httpx.post(server.base_url + "/tokenize", json=body).json()["tokens"]
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": tokens}).json()["prompt"]
    # (the template's block ends eat their newline; the tokenizer's BOS first: the
    # template writes none)
    assert text == "<s>user:weather?assistant:[get_weather(Oslo)]tool:rain#c1<dry>assistant:"
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2,
        extra_body={"chat_template": template, "add_generation_prompt": False},
    )  # fmt: skip
    assert r.usage.prompt_tokens == len(tokens) - len("<dry>assistant:")  # bytes: 1 token each


@pytest.fixture(scope="module")
def reference(chat_dir: Path) -> Iterator[LLM]:
    llm = LLM(model=str(chat_dir))
    yield llm
    llm.shutdown()


# --- vLLM's metric names ----------------------------------------------------------------------
VLLM_METRICS = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc", "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count",
    "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
    "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
    "vllm:request_inference_time_seconds_count", "vllm:request_prompt_tokens_count",
    "vllm:request_generation_tokens_count", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
)  # fmt: skip


def _samples(server) -> dict[str, float]:
    """``/metrics``' samples labelled ``model_name="tiny"``: ``name`` (labels dropped but
    ``finished_reason``) -> value."""
    out = {}
    for line in httpx.get(server.base_url + "/metrics").text.splitlines():
        if line.startswith("vllm:") and f'model_name="{MODEL}"' in line:
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0]
            if "finished_reason" in name:
                key += "{" + name.split("finished_reason=")[1].split(",")[0].rstrip("}") + "}"
            out[key] = out.get(key, 0.0) + float(value) if "_bucket" not in key else 0.0
    return out


def test_vllm_metric_names_are_there_and_move_with_traffic(client, server) -> None:
    before = _samples(server)
    assert set(VLLM_METRICS) <= set(before), set(VLLM_METRICS) - set(before)
    client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, extra_body={"ignore_eos": True}
    )
    after = _samples(server)
    grew = {
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count", "vllm:request_generation_tokens_count",
        'vllm:request_success_total{"length"}',
    }  # fmt: skip
    assert all(after[k] > before.get(k, 0.0) for k in grew), {k: after.get(k) for k in grew}
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 5
    assert (
        after["vllm:inter_token_latency_seconds_count"]
        - before["vllm:inter_token_latency_seconds_count"]
        == 4
    )


def test_prefix_cache_hits_in_usage_and_metrics(client, server) -> None:
    """The same 40-token prompt twice: the second reads its first 32 tokens (two blocks of
    16) from the prefix cache, in its usage (OpenAI's ``cached_tokens``) and in vLLM's
    counters; another ``cache_salt`` shares nothing."""
    prompt = [(7 * i) % 200 + 3 for i in range(40)]
    before = _samples(server)
    cached = []
    for salt in (None, None, "tenant-b"):
        extra = {"ignore_eos": True} | ({"cache_salt": salt} if salt else {})
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body=extra)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    after = _samples(server)
    assert cached == [0, 32, 0]
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] == 32
    grew = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    assert grew == 3 * 40


def test_offline_chat_takes_vllms_rendering_options(reference) -> None:
    """``LLM.chat``'s ``chat_template``, ``continue_final_message`` and
    ``chat_template_kwargs``, as vLLM's; both generation prompt and continuation refused."""
    template = (
        "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}"
        "{% if x %}[{{ x }}]{% endif %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    chat = [*_MSG, {"role": "assistant", "content": "hel"}]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    out = reference.chat(
        chat, params, use_tqdm=False, chat_template=template, add_generation_prompt=False,
        continue_final_message=True, chat_template_kwargs={"x": "y"},
    )[0]  # fmt: skip
    assert out.prompt == "user:hi;assistant:hel"  # continued: no end of turn, no generation prompt
    with pytest.raises(ValueError, match="continue_final_message=True needs"):
        reference.chat(chat, params, continue_final_message=True)
