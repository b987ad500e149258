"""The request checks and the stream's stop-string hold-back, without a model."""

from __future__ import annotations

import contextlib

import pytest

pytest.importorskip("fastapi")

from sarathi_pp.serve.answer import safe_end  # noqa: E402
from sarathi_pp.serve.protocol import (  # noqa: E402
    ApiError,
    Prompt,
    chat_request,
    completion_request,
)


def test_prompt_forms() -> None:
    assert completion_request({"prompt": "hi"}).prompts == (Prompt(text="hi"),)
    assert completion_request({"prompt": ["hi"]}).prompts == (Prompt(text="hi"),)
    assert completion_request({"prompt": [1, 2]}).prompts == (Prompt(token_ids=[1, 2]),)
    assert completion_request({"prompt": [[1, 2]]}).prompts == (Prompt(token_ids=[1, 2]),)
    batch = completion_request({"prompt": ["a", [3], "b"]}).prompts  # one choice each
    assert batch == (Prompt(text="a"), Prompt(token_ids=[3]), Prompt(text="b"))
    for bad in (None, "", [], [True, 2], [1.5], {"a": 1}, ["a", ""], [[1], []], ["x"] * 65):
        with pytest.raises(ApiError) as e:
            completion_request({"prompt": bad})
        assert e.value.status == 400 and e.value.param == "prompt"


def test_sampling_fields_and_defaults() -> None:
    r = completion_request({"prompt": "x"})
    assert (r.params.max_tokens, r.params.temperature, r.stream, r.include_usage) == (
        16,
        1.0,
        False,
        False,
    )
    r = completion_request(
        {
            "prompt": "x",
            "max_tokens": 3,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": -1,
            "seed": 7,
            "stop": "\n",
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "n": 1,
            "presence_penalty": 0,
            "logprobs": None,
            "user": "anyone",  # unknown fields are ignored
        }
    )
    p = r.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (3, 0.0, 0.5, 0, 7)
    assert (p.stop, p.ignore_eos, r.stream, r.include_usage) == (("\n",), True, True, True)
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert (
        chat_request({**chat, "max_completion_tokens": 4, "max_tokens": 9}).params.max_tokens == 4
    )
    assert chat_request({**chat, "response_format": {"type": "text"}}).messages == [
        {"role": "user", "content": "x"}
    ]


@pytest.mark.parametrize(
    "field",
    [
        {"max_tokens": 0},
        {"max_tokens": 2.5},
        {"temperature": "hot"},
        {"top_p": 0},
        {"seed": True},
        {"stop": [""]},
        {"stream": 1},
        {"n": 0},
        {"n": 65},
        {"n": True},
        {"best_of": 2},
        {"frequency_penalty": 2.5},
        {"repetition_penalty": 0},
        {"logprobs": 21},
        {"logprobs": True},
        {"logprobs": -1},
        {"top_logprobs": 2},
        {"echo": "yes"},
        {"prompt_logprobs": 21},
        {"prompt_logprobs": 1.0},
        {"prompt_logprobs": 1, "stream": True},
        {"logit_bias": {"x": 5}},
        {"logit_bias": {"1": 500}},
        {"logit_bias": {"1": "5"}},
        {"min_tokens": 20},
        {"guided_json": {"type": "nope"}},  # llguidance cannot compile it
        {"response_format": {"type": "json"}},
        {"guided_decoding_backend": "xgrammar"},
        {"stop_token_ids": [-1]},
        {"stop_token_ids": "5"},
    ],
)
def test_a_bad_or_unsupported_field_is_a_400(field: dict) -> None:
    with pytest.raises(ApiError) as e:
        completion_request({"prompt": "x", **field})
    assert e.value.status == 400


@pytest.mark.parametrize(
    "field, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_k": -3}, "top_k"),
        ({"n": 0}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_p": 2}, "min_p"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ],
)
def test_a_400_names_its_field_in_param(field: dict, param: str) -> None:
    with pytest.raises(ApiError) as e:
        completion_request({"prompt": "x", **field})
    assert e.value.param == param


def test_logit_bias_and_min_tokens_fields() -> None:
    p = completion_request(
        {"prompt": "x", "logit_bias": {"7": 3, "2": -1.5}, "min_tokens": 4}
    ).params
    assert p.logit_bias == {2: -1.5, 7: 3.0} and p.min_tokens == 4


def test_vllm_extra_sampling_fields() -> None:
    body = {"prompt": "x", "min_p": 0.1, "include_stop_str_in_output": True}
    p = completion_request({**body, "skip_special_tokens": False}).params
    assert (p.min_p, p.include_stop_str_in_output, p.skip_special_tokens) == (0.1, True, False)
    p = completion_request({"prompt": "x"}).params
    assert (p.min_p, p.include_stop_str_in_output, p.skip_special_tokens) == (0.0, False, True)


def test_echo_is_a_completions_field() -> None:
    assert completion_request({"prompt": "x", "echo": True}).echo
    assert not completion_request({"prompt": "x"}).echo
    with pytest.raises(ApiError) as e:
        chat_request({"messages": [{"role": "user", "content": "x"}], "echo": True})
    assert e.value.param == "echo"


def test_prompt_logprobs_fields() -> None:
    """vLLM's ``prompt_logprobs``; ``echo`` with ``logprobs`` asks for them too (the echoed
    prompt is scored: lm-evaluation-harness's loglikelihood requests)."""
    assert completion_request({"prompt": "x"}).params.prompt_logprobs is None
    assert completion_request({"prompt": "x", "prompt_logprobs": 0}).params.prompt_logprobs == 0
    echoed = completion_request({"prompt": "x", "echo": True, "logprobs": 3}).params
    assert (echoed.logprobs, echoed.prompt_logprobs) == (3, 3)
    assert completion_request({"prompt": "x", "echo": True}).params.prompt_logprobs is None
    assert completion_request({"prompt": "x", "logprobs": 3}).params.prompt_logprobs is None
    both = {"prompt": "x", "echo": True, "logprobs": 3, "prompt_logprobs": 1}
    assert completion_request(both).params.prompt_logprobs == 1  # as given
    chat = {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 5}
    assert chat_request(chat).params.prompt_logprobs == 5


def test_max_tokens_zero_needs_echo() -> None:
    r = completion_request({"prompt": "x", "echo": True, "max_tokens": 0})
    assert r.echo_only and r.params.max_tokens == 1  # one token generated and dropped
    assert not completion_request({"prompt": "x", "echo": True, "max_tokens": 2}).echo_only
    with pytest.raises(ApiError, match="'max_tokens' must be >= 0 with 'echo', else 1") as e:
        completion_request({"prompt": "x", "max_tokens": 0})
    assert e.value.param == "max_tokens"
    with pytest.raises(ApiError, match="must be >= 0 with 'echo'"):
        completion_request({"prompt": "x", "echo": True, "max_tokens": -1})
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}
    with pytest.raises(ApiError, match="'max_tokens' must be >= 1, got 0"):
        chat_request(chat)


def test_chat_logprobs_fields() -> None:
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert chat_request(chat).params.logprobs is None
    assert chat_request({**chat, "logprobs": True}).params.logprobs == 0
    assert chat_request({**chat, "logprobs": True, "top_logprobs": 4}).params.logprobs == 4
    assert chat_request({**chat, "logprobs": False, "top_logprobs": 0}).params.logprobs is None
    for bad, param in (({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": 1}, "logprobs")):
        with pytest.raises(ApiError) as e:
            chat_request({**chat, **bad})
        assert e.value.param == param


def test_chat_messages() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    r = chat_request({"messages": [{"role": "user", "content": parts}]})
    assert r.messages == [{"role": "user", "content": "ab"}]
    for bad in ([], [{"content": "x"}], [{"role": "user", "content": 5}], "hi"):
        with pytest.raises(ApiError):
            chat_request({"messages": bad})
    with pytest.raises(ApiError, match="text content"):
        chat_request({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})


def test_stream_holds_back_a_possible_stop_string_start() -> None:
    assert safe_end("hello", ()) == 5
    assert safe_end("hello wo", ("world",)) == 6  # "wo" may start "world"
    assert safe_end("hello w", ("xyz",)) == 7
    assert safe_end("ab", ("abc", "b!")) == 0  # "ab" may start "abc"


class _Reads(dict):
    """A request body that records every field the server looks at."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        self.read.add(key)
        return super().__contains__(key)


def test_every_field_the_server_reads_is_known() -> None:
    """The fields named in the "present in the request but ignored" warning are those outside
    ``_KNOWN_FIELDS`` (a hand list): every field the request parsing reads must be in it, or
    a field the server uses would be reported as ignored."""
    from sarathi_pp.serve.protocol import _KNOWN_FIELDS

    bodies = [
        (completion_request, {"prompt": "hi"}),
        (completion_request, {"prompt": "hi", "echo": True, "logprobs": 2, "max_tokens": 0}),
        (completion_request, {"prompt": "hi", "prompt_logprobs": 1, "stream": True}),
        (chat_request, {"messages": [{"role": "user", "content": "hi"}]}),
        (chat_request, {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}),
    ]
    read: set[str] = set()
    for parse, fields in bodies:
        body = _Reads(fields)
        with contextlib.suppress(ApiError):  # refused combinations are read all the same
            parse(body)
        read |= body.read
    assert {"prompt", "messages", "max_tokens", "temperature", "top_logprobs"} <= read
    assert read - (_KNOWN_FIELDS["completions"] | _KNOWN_FIELDS["chat"]) == set()
    # /tokenize and /detokenize have their own lists
    from sarathi_pp.serve.protocol import (
        _DETOKENIZE_FIELDS,
        _TOKENIZE_FIELDS,
        detokenize_request,
        tokenize_request,
    )

    for parse, fields, known in [
        (tokenize_request, {"prompt": "hi"}, _TOKENIZE_FIELDS),
        (tokenize_request, {"messages": [{"role": "user", "content": "x"}]}, _TOKENIZE_FIELDS),
        (detokenize_request, {"tokens": [1]}, _DETOKENIZE_FIELDS),
    ]:
        body = _Reads(fields)
        parse(body)
        assert body.read and body.read - known == set(), parse
