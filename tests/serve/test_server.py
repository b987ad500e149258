"""``sarathi-pp serve`` end to end: the app under uvicorn on 127.0.0.1 (a free port, a
background thread) over the tiny random Llama, driven by the official ``openai`` client and
``httpx``. The oracle is ``LLM.generate`` on the same prompt (greedy)."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from serving import running_server, with_chat_template  # noqa: E402

from sarathi_pp import LLM, SamplingParams  # noqa: E402

MODEL = "tiny"
API_KEY = "test-key"
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def chat_model_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a chat template (the byte tokenizer has none)."""
    return with_chat_template(llama_dir, tmp_path_factory.mktemp("chat") / "llama")


@pytest.fixture(scope="module")
def server(chat_model_dir: Path) -> Iterator:
    with running_server(chat_model_dir, api_key=API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> Any:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def reference(chat_model_dir: Path) -> Iterator[LLM]:
    llm = LLM(model=str(chat_model_dir))
    yield llm
    llm.shutdown()


def _reference_text(llm: LLM, prompt: Any, max_tokens: int) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


def _post(
    server, path: str, body: Any, key: str | None = API_KEY, timeout: float = 30
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.base_url + path, content=content, headers=headers, timeout=timeout)


# --- answers ---------------------------------------------------------------------------------
def test_completion_equals_llm_generate(client, reference) -> None:
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=12, **GREEDY)
    assert r.object == "text_completion"
    assert r.choices[0].text == _reference_text(reference, "Hello world", 12)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len(reference.get_tokenizer().encode("Hello world"))

    ids = [5, 70, 80, 90, 100]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, **GREEDY)
    assert r.choices[0].text == _reference_text(reference, {"prompt_token_ids": ids}, 6)
    assert r.usage.prompt_tokens == len(ids)


def test_a_list_of_prompts_is_one_choice_each(client, reference) -> None:
    prompts = ["Hello world", [5, 70, 80], "abc", "Hello world"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=7, **GREEDY)
    refs = [
        _reference_text(reference, x if isinstance(x, str) else {"prompt_token_ids": x}, 7)
        for x in prompts
    ]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == refs and len(set(refs)) > 1
    assert r.usage.completion_tokens == 4 * 7
    streamed = ["", "", "", ""]
    usage = None
    for chunk in client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=7, stream=True,
        stream_options={"include_usage": True}, **GREEDY,
    ):  # fmt: skip
        for c in chunk.choices:
            streamed[c.index] += c.text
        usage = chunk.usage or usage
    assert streamed == refs
    assert usage.completion_tokens == 28 and usage.prompt_tokens == r.usage.prompt_tokens


def test_streamed_completion_equals_the_whole(client) -> None:
    whole = client.completions.create(model=MODEL, prompt="Stream me", max_tokens=10, **GREEDY)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Stream me",
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_streamed_text_never_holds_part_of_a_stop_string(client) -> None:
    plain = client.completions.create(model=MODEL, prompt="abc", max_tokens=12, **GREEDY)
    text = plain.choices[0].text
    # Two ASCII characters: two tokens (byte tokenizer), so two steps of the stream.
    i = next(i for i in range(len(text) - 1) if text[i : i + 2].isascii())
    stop = text[i : i + 2]
    kwargs = {"model": MODEL, "prompt": "abc", "max_tokens": 12, "stop": [stop], **GREEDY}
    whole = client.completions.create(**kwargs)
    assert whole.choices[0].finish_reason == "stop" and stop not in whole.choices[0].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_equals_the_rendered_prompt(client, reference) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi there"},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=9, **GREEDY
    )
    rendered = reference.get_tokenizer().apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith("<|assistant|>")
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == _reference_text(reference, rendered, 9)

    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=9, stream=True, **GREEDY
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_logprobs_equal_llm_generate(client, reference) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
    (ref,) = reference.generate(["Hello world"], params, use_tqdm=False)
    ours = ref.outputs[0]
    r = client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=8, logprobs=2, **GREEDY
    )
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == [e[t].logprob for t, e in zip(ours.token_ids, ours.logprobs)]
    assert lp.tokens == [e[t].decoded_token for t, e in zip(ours.token_ids, ours.logprobs)]
    assert lp.top_logprobs == [
        {e.decoded_token: e.logprob for e in entry.values()} for entry in ours.logprobs
    ]
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # streamed: each chunk has its new tokens' entries, offsets running on
    tokens, offsets, values = [], [], []
    for chunk in client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=8, logprobs=2, stream=True, **GREEDY
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            offsets += chunk.choices[0].logprobs.text_offset
            values += chunk.choices[0].logprobs.token_logprobs
    assert (tokens, values) == (lp.tokens, lp.token_logprobs)
    assert offsets == lp.text_offset
    # not asked for: null, as OpenAI
    plain = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=2, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_echo_prepends_each_prompt(client, reference) -> None:
    prompts = ["Hello world", [72, 105, 33]]
    plain = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, **GREEDY)
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, echo=True, **GREEDY)
    texts = ["Hello world", reference.get_tokenizer().decode([72, 105, 33])]
    assert texts[1] == "Hi!"
    assert [c.text for c in r.choices] == [t + c.text for t, c in zip(texts, plain.choices)]
    assert r.usage == plain.usage
    streamed = ["", ""]
    for chunk in client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=5, echo=True, stream=True, **GREEDY
    ):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in r.choices]


def test_echo_with_logprobs_scores_the_prompt(client, reference) -> None:
    """lm-evaluation-harness's loglikelihood request: ``echo`` + ``logprobs`` +
    ``max_tokens=1`` gives the prompt's tokens their log-probabilities (the first null)
    before the generated token's, as ``LLM.generate`` computes them."""
    prompt = "Hello world"
    body = dict(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=1, **GREEDY)
    r = client.completions.create(**body)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=1, prompt_logprobs=1)
    (ref,) = reference.generate([prompt], params, use_tqdm=False)
    ids, plp, out = ref.prompt_token_ids, ref.prompt_logprobs, ref.outputs[0]
    lp = r.choices[0].logprobs
    assert r.choices[0].text == prompt + out.text
    assert len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == [e[t].logprob for t, e in zip(ids[1:], plp[1:])] + [
        out.logprobs[0][out.token_ids[0]].logprob
    ]
    assert lp.top_logprobs[1:-1] == [
        {e.decoded_token: e.logprob for e in entry.values()} for entry in plp[1:]
    ]
    tok = reference.get_tokenizer()
    assert lp.tokens[:-1] == [tok.decode([t]) for t in ids]
    assert len({v for v in lp.token_logprobs[1:]}) > 3  # they vary
    # offsets: the prompt's tokens from 0, the generated one where it starts in the text
    assert lp.text_offset[0] == 0 and lp.text_offset[-1] == len(prompt)
    streamed: dict[str, list] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(**body, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            for key, values in streamed.items():
                values += getattr(chunk.choices[0].logprobs, key)
    assert streamed == {k: getattr(lp, k) for k in streamed}
    # max_tokens 0 with echo (vLLM's): the prompt alone, scored; no completion tokens
    only = client.completions.create(**{**body, "max_tokens": 0})
    assert only.choices[0].text == prompt and only.usage.completion_tokens == 0
    assert only.usage.prompt_tokens == len(ids)
    olp = only.choices[0].logprobs
    assert (olp.tokens, olp.token_logprobs) == (lp.tokens[:-1], lp.token_logprobs[:-1])
    assert olp.text_offset == lp.text_offset[:-1]
    chunks = list(client.completions.create(**{**body, "max_tokens": 0}, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt
    assert [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ] == olp.tokens
    # vLLM's prompt_logprobs field: per prompt token, {token id: {logprob, rank, decoded_token}}
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, extra_body={"prompt_logprobs": 2}, **GREEDY
    )
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert r.choices[0].logprobs is None and got[0] is None and len(got) == len(ids)
    for t, entry, ours in zip(ids[1:], got[1:], plp[1:]):
        assert next(iter(entry)) == str(t) and entry[str(t)]["logprob"] == ours[t].logprob
        assert entry[str(t)]["decoded_token"] == tok.decode([t])
        others = sorted(v["rank"] for k, v in entry.items() if k != str(t))
        assert others == [r for r in (1, 2) if r != entry[str(t)]["rank"]]  # the top 2
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_body={"prompt_logprobs": 0}, **GREEDY,
    )  # fmt: skip
    plp_chat = chat.model_extra["prompt_logprobs"]
    assert plp_chat[0] is None and len(plp_chat) == chat.usage.prompt_tokens > 3
    assert all(len(entry) == 1 for entry in plp_chat[1:])


def test_logit_bias_through_the_client(client) -> None:
    r = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, logit_bias={"65": 100}, **GREEDY
    )
    assert r.choices[0].text == "AAAA"
    with pytest.raises(openai.BadRequestError, match="logit_bias has token ids outside"):
        client.completions.create(model=MODEL, prompt="Hello", logit_bias={"99999": 1})


def test_penalties_equal_llm_generate(client, reference) -> None:
    penalties = {"presence_penalty": 0.7, "frequency_penalty": 0.4, "repetition_penalty": 1.3}
    r = client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=10, extra_body=penalties, **GREEDY
    )
    params = SamplingParams(max_tokens=10, temperature=0.0, **penalties)
    (ref,) = reference.generate(["Hello world"], params, use_tqdm=False)
    plain = _reference_text(reference, "Hello world", 10)
    assert r.choices[0].text == ref.outputs[0].text != plain


def test_allowed_bad_words_and_truncation_equal_llm_generate(client, reference) -> None:
    """vLLM's extra parameters: ``allowed_token_ids``, ``bad_words`` (tokenized on the
    server as ``LLM.generate`` tokenizes them) and ``truncate_prompt_tokens`` (the usage
    counts the prompt's tokens kept)."""
    tok = reference.get_tokenizer()
    prompt = "Hello world, hello again"
    letters = tok.encode("abcdefgh", add_special_tokens=False)
    plain = reference.generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0.0, allowed_token_ids=letters),
        use_tqdm=False,
    )[0].outputs[0].text  # fmt: skip
    extra = {"allowed_token_ids": letters, "bad_words": [plain[1:3]], "truncate_prompt_tokens": 7}
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, extra_body=extra, **GREEDY
    )
    params = SamplingParams(max_tokens=8, temperature=0.0, **extra)
    (ref,) = reference.generate([prompt], params, use_tqdm=False)
    assert r.choices[0].text == ref.outputs[0].text != plain
    assert set(r.choices[0].text) <= set("abcdefgh") and plain[1:3] not in r.choices[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) == 7
    messages = [{"role": "user", "content": "a question of some length"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, extra_body={"truncate_prompt_tokens": 9},
        **GREEDY,
    )  # fmt: skip
    assert chat.usage.prompt_tokens == 9


def test_chat_logprobs_and_top_logprobs(client) -> None:
    messages = [{"role": "user", "content": "hi there"}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for item in content:
        assert item.bytes == list(item.token.encode())
        tops = [t.logprob for t in item.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert item.top_logprobs[0].token == item.token  # greedy: the most likely
        assert item.logprob == tops[0] <= 0
    only = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, logprobs=True, **GREEDY
    )
    assert [c.top_logprobs for c in only.choices[0].logprobs.content] == [[], [], []]
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=messages, top_logprobs=2)


def test_n_choices_per_prompt(client, reference) -> None:
    sampled = {"temperature": 1.0, "seed": 5, "max_tokens": 6}
    prompts = ["Hello world", "abc"]
    r = client.completions.create(model=MODEL, prompt=prompts, n=3, **sampled)
    refs = reference.generate(
        prompts, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6), use_tqdm=False
    )
    # choice i * n + j: prompt i's completion j
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [c.text for o in refs for c in o.outputs]
    assert len({c.text for c in r.choices[:3]}) > 1
    prompt_tokens = sum(len(o.prompt_token_ids) for o in refs)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, 6 * 6)
    streamed = [""] * 6
    for chunk in client.completions.create(
        model=MODEL, prompt=prompts, n=3, stream=True, **sampled
    ):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in r.choices]

    messages = [{"role": "user", "content": "hi there"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, n=2, **sampled)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content != chat.choices[1].message.content
    parts = ["", ""]
    roles = []
    for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, n=2, stream=True, **sampled
    ):
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
            roles += [c.index] if c.delta.role else []
    assert parts == [c.message.content for c in chat.choices] and sorted(roles) == [0, 1]


def test_concurrent_streams_all_finish(client) -> None:
    results: dict[int, tuple[str, str | None]] = {}

    def one(i: int) -> None:
        text, reason = "", None
        for c in client.completions.create(
            model=MODEL, prompt=f"prompt {i} " * (1 + i % 3), max_tokens=16, stream=True, seed=i
        ):
            text += c.choices[0].text
            reason = c.choices[0].finish_reason or reason
        results[i] = (text, reason)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == list(range(16))
    assert all(reason == "length" for _, reason in results.values())


def test_disconnect_mid_stream_frees_the_blocks(server) -> None:
    engine = server.engine_loop.engine
    blocks = engine.scheduler.block_manager
    body = {"model": MODEL, "prompt": "go on", "max_tokens": 400, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream(
        "POST",
        server.base_url + "/v1/completions",
        json={**body, "stream": True},
        headers=headers,
        timeout=30,
    ) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert blocks.num_free_blocks < blocks.num_blocks  # it runs
    deadline = time.monotonic() + 10
    while blocks.num_free_blocks < blocks.num_blocks or server.engine_loop.num_requests:
        assert time.monotonic() < deadline, "the request outlived its client"
        time.sleep(0.05)
    assert not engine.has_unfinished_requests()


def test_disconnect_while_waiting_for_a_whole_answer_aborts_it(server, monkeypatch) -> None:
    engine = server.engine_loop.engine
    blocks = engine.scheduler.block_manager
    registry = server.engine_loop.metrics.registry
    # Each step made >= 5 ms, so the 500 tokens take >= 2.5 s: the answer cannot finish
    # ("length") before the server's disconnect poll (``answer.DISCONNECT_POLL_S``) sees the
    # client gone. Unslowed, the test model's steps on a quiet machine raced that poll.
    submit = engine.executor.submit

    def slow_submit(microbatch):
        time.sleep(0.005)
        return submit(microbatch)

    monkeypatch.setattr(engine.executor, "submit", slow_submit)

    def num_aborted() -> float:
        labels = {"finish_reason": "abort"}
        return registry.get_sample_value("sarathi_pp_requests_total", labels) or 0.0

    before = num_aborted()
    body = {"model": MODEL, "prompt": "go", "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        _post(server, "/v1/completions", body, timeout=0.3)
    deadline = time.monotonic() + 10
    while num_aborted() == before or blocks.num_free_blocks < blocks.num_blocks:
        assert time.monotonic() < deadline, "the request outlived its client"
        time.sleep(0.05)


# --- refusals --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, word",
    [
        ({"prompt": 5}, "prompt"),
        ({"prompt": ""}, "empty"),
        ({"prompt": ["a", ""]}, "'prompt[1]' is empty"),
        ({"prompt": "x", "max_tokens": "7"}, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "n": 0}, "'n'"),
        ({"prompt": ["a", "b"], "n": 40}, "prompts x n"),
        ({"prompt": "x", "logprobs": 30}, "'logprobs'"),
        ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "x" * 600}, "max_model_len"),  # past max_position_embeddings
        (b"{not json", "JSON"),
    ],
)
def test_bad_request_is_a_400_naming_it(server, body, word: str) -> None:
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert word in error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "path, body, param, word",
    [
        ("/v1/completions", {"prompt": "x" * 500, "max_tokens": 100}, "max_tokens", "context length"),
        ("/v1/completions", {"prompt": ["a", "b" * 510], "max_tokens": 5}, "max_tokens", "in the 'prompt[1]', 5 in the completion"),
        ("/v1/completions", {"prompt": ["a", [10**9]]}, "prompt", "'prompt[1]' has token ids outside"),
        ("/v1/completions", {"prompt": "x" * 600}, "prompt", "more than max_model_len"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs",
         "not available with 'stream'"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6},
         "max_tokens", "context length"),
        ("/v1/completions", {"prompt": "x", "seed": 2**70}, "seed", "64-bit"),
        ("/v1/completions", {"prompt": "x", "allowed_token_ids": [1, 10**9]}, "allowed_token_ids",
         "allowed_token_ids has token ids outside"),
        ("/v1/completions", {"prompt": "x", "allowed_token_ids": "5"}, "allowed_token_ids",
         "list of integers"),
        ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
        ("/v1/completions", {"prompt": "x", "bad_words": "no"}, "bad_words", "list of strings"),
        ("/v1/completions", {"prompt": "x", "bad_words": [" "]}, "bad_words", "non-blank"),
        ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens",
         ">= 1"),
        ("/tokenize", {}, "prompt", "one of 'prompt' (text) or 'messages'"),
        ("/tokenize", {"prompt": "x", "messages": []}, "prompt", "one of"),
        ("/tokenize", {"prompt": 5}, "prompt", "must be a string"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens", "bool"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                       "continue_final_message": True},
         "continue_final_message", "add_generation_prompt"),
        ("/tokenize", {"messages": [{"content": "x"}]}, "messages", "'role'"),
        ("/detokenize", {"tokens": [1, "a"]}, "tokens", "token ids"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens", "token id 1000000000 is not below"),
        ("/detokenize", {}, "tokens", "token ids"),
    ],
)  # fmt: skip
def test_a_400_names_its_param(server, path: str, body: dict, param: str, word: str) -> None:
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and word in error["message"], error


def test_bad_requests_through_the_client(client) -> None:
    with pytest.raises(openai.BadRequestError, match="'n'"):
        client.completions.create(model=MODEL, prompt="x", n=0)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.NotFoundError, match="nope"):
        client.completions.create(model="nope", prompt="x")
    # ... and the server goes on serving
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text


def test_unknown_fields_are_ignored_with_a_warning_naming_them(server, caplog) -> None:
    body = {"prompt": "x", "max_tokens": 2, "max_token": 50, "metadata": {"a": "b"}, "user": "u"}
    with caplog.at_level(logging.WARNING, logger="sarathi_pp.serve.protocol"):
        r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2  # the misspelt field changed nothing
    warnings = [m for m in caplog.messages if "present in the request but ignored" in m]
    assert warnings == [
        "The following fields were present in the request but ignored: max_token, metadata"
    ]  # ``user`` is OpenAI's and known
    caplog.clear()
    many = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    many.update({f"f{i:02d}": i for i in range(20)})
    with caplog.at_level(logging.WARNING, logger="sarathi_pp.serve.protocol"):
        assert _post(server, "/v1/chat/completions", many).status_code == 200
    (message,) = [m for m in caplog.messages if "ignored" in m]
    assert message.endswith("f15 and 4 more") and "f16" not in message


def test_tokenize_and_detokenize(server, client, reference) -> None:
    """vLLM's /tokenize and /detokenize: the ids a completion or a chat runs on (its usage's
    prompt_tokens), and their text back."""
    tok = reference.get_tokenizer()
    r = _post(server, "/tokenize", {"model": MODEL, "prompt": "hi there"})
    assert r.status_code == 200, r.text
    ids = r.json()
    assert ids["tokens"] == reference.engine.tokenize("hi there") == tok.encode("hi there")
    assert ids["count"] == len(ids["tokens"]) and ids["token_strs"] is None
    assert ids["max_model_len"] == reference.engine.max_model_len
    run = client.completions.create(model=MODEL, prompt="hi there", max_tokens=1)
    assert run.usage.prompt_tokens == ids["count"]
    plain = _post(
        server,
        "/tokenize",
        {"prompt": "hi there", "add_special_tokens": False, "return_token_strs": True},
    ).json()
    assert plain["tokens"] == tok.encode("hi there", add_special_tokens=False) != ids["tokens"]
    assert plain["token_strs"] == tok.convert_ids_to_tokens(plain["tokens"])
    messages = [{"role": "user", "content": "hi"}]
    chat = _post(server, "/tokenize", {"messages": messages}).json()
    assert chat["tokens"] == reference.engine.inputs.render_chat(messages)[1]
    run = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert run.usage.prompt_tokens == chat["count"]
    text = _post(server, "/detokenize", {"model": MODEL, "tokens": ids["tokens"]}).json()
    assert text == {"prompt": tok.decode(ids["tokens"])}  # special tokens kept
    assert text["prompt"].endswith("hi there")
    assert _post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}
    assert _post(server, "/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404
    assert _post(server, "/tokenize", {"prompt": "x"}, key=None).status_code == 401


def test_api_key_is_required_on_v1_routes(server) -> None:
    bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert _post(server, "/v1/completions", {"prompt": "x"}, key=None).status_code == 401
    assert httpx.get(server.base_url + "/health").status_code == 200  # open
    r = httpx.get(server.base_url + "/v1/nowhere")
    assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found"


def test_models_and_metrics(client, server) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    client.completions.create(model=MODEL, prompt="count me", max_tokens=3)
    text = httpx.get(server.base_url + "/metrics").text
    assert 'sarathi_pp_requests_total{finish_reason="length"}' in text
    for name in (
        "sarathi_pp_time_to_first_token_seconds_count",
        "sarathi_pp_time_between_tokens_seconds_count",
        "sarathi_pp_e2e_request_latency_seconds_count",
        "sarathi_pp_num_requests_running",
        "sarathi_pp_num_requests_waiting",
        "sarathi_pp_kv_blocks_used",
        "sarathi_pp_preemptions_total",
        'sarathi_pp_stage_busy_seconds_total{stage="0"}',
        'sarathi_pp_stage_microbatches_total{stage="0"}',
    ):
        assert name in text
    import sarathi_pp

    assert httpx.get(server.base_url + "/version").json() == {"version": sarathi_pp.__version__}


# --- a second server: no chat template, one request waiting at most ------------------------
def test_full_queue_429_no_template_400_dead_engine_503(llama_dir: Path) -> None:
    overrides = {"scheduler.max_waiting": 1}
    with running_server(llama_dir, **overrides) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
        engine = server.engine_loop.engine
        with pytest.raises(openai.BadRequestError, match="chat template"):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])

        # The engine thread held between steps: both adds run in one batch, so the first
        # still waits (no step in between) when the second comes.
        held, release = threading.Event(), threading.Event()

        def hold(engine: object) -> None:
            held.set()
            release.wait(30)

        server.engine_loop.call(hold)
        assert held.wait(30)  # the thread is inside ``hold``: the queue counts only the adds
        answers: dict[str, int] = {}

        def post(prompt: str) -> None:
            r = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
            answers[prompt] = r.status_code
            if r.status_code == 429:
                assert "max_waiting" in r.json()["error"]["message"]

        first = threading.Thread(target=post, args=("first",))
        first.start()
        while server.engine_loop._commands.qsize() < 1:
            time.sleep(0.01)
        second = threading.Thread(target=post, args=("second",))
        second.start()
        while server.engine_loop._commands.qsize() < 2:
            time.sleep(0.01)
        release.set()
        first.join(30)
        second.join(30)
        assert answers == {"first": 200, "second": 429}

        assert httpx.get(server.base_url + "/health").status_code == 200
        engine.dead_reason = "a test killed it"
        r = httpx.get(server.base_url + "/health")
        assert r.status_code == 503 and "a test killed it" in r.json()["error"]["message"]
        assert _post(server, "/v1/completions", {"prompt": "x"}).status_code == 503
