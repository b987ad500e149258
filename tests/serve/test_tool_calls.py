"""Tool calls through a live ``sarathi-pp serve`` with the official ``openai`` client (the
tiny random Llama): a named function's arguments are constrained to its schema and
validate, ``required`` returns calls of the given functions, ``auto`` parses the Hermes
format from the reply (the random model made to write one by a regex), ``none`` is plain
text; the tools reach the chat template; streamed calls equal the whole answer's; bad
tool fields are a 400 naming them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from serving import running_server, with_chat_template  # noqa: E402

from sarathi_pp.serve.tools import tool_parser  # noqa: E402

MODEL = "tiny"
_MSG = [{"role": "user", "content": "What is the weather?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
HERMES = (
    r'I will check\.<tool_call>\{"name": "get_weather", "arguments": '
    r'\{"city": "(Paris|Rome)", "days": [1-7]\}\}</tool_call>'
)


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    model_dir = with_chat_template(llama_dir, tmp_path_factory.mktemp("tools") / "llama")
    with running_server(model_dir, max_model_len=384) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> Any:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def _chat(client, **kw) -> Any:
    kw = {"model": MODEL, "messages": _MSG, "tools": TOOLS, "temperature": 1.0, **kw}
    return client.chat.completions.create(**kw)


def _valid(call) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_a_named_function_gets_arguments_valid_for_its_schema(client) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = _chat(client, tool_choice=named, n=6, seed=1, max_tokens=80)
    for c in r.choices:
        assert c.finish_reason == "stop" and c.message.content is None
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        _valid(call)
    assert len({c.message.tool_calls[0].function.arguments for c in r.choices}) > 1


def test_required_returns_calls_of_the_given_functions(client) -> None:
    # one call (parallel_tool_calls false): a random model closes it within max_tokens
    r = _chat(
        client, tool_choice="required", n=6, seed=2, max_tokens=120, parallel_tool_calls=False
    )
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        _valid(call)
    # parallel: a list of at least one; those the random model closed are all valid calls
    many = _chat(client, tool_choice="required", n=6, seed=2, max_tokens=300)
    done = [c for c in many.choices if c.finish_reason == "tool_calls"]
    assert done
    for c in done:
        for call in c.message.tool_calls:
            _valid(call)


def test_auto_parses_a_hermes_reply(client) -> None:
    r = _chat(
        client, tool_choice="auto", seed=3, max_tokens=120, extra_body={"guided_regex": HERMES}
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "I will check."
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and _valid(call)["city"] in ("Paris", "Rome")
    plain = _chat(
        client, tool_choice="none", seed=3, max_tokens=120, extra_body={"guided_regex": HERMES}
    )
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content.startswith("I will check.<tool_call>")


def test_the_hermes_parser_on_fixtures() -> None:
    parse = tool_parser("hermes")
    text = (
        'Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    )
    content, calls = parse(text)
    assert content == "Sure." and [c["function"]["name"] for c in calls] == ["a", "b"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    assert parse("no calls") == ("no calls", [])
    assert parse("<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])
    with pytest.raises(ValueError, match="unknown tool-call parser 'x'; valid: hermes"):
        tool_parser("x")


def test_streamed_calls_equal_the_whole_answer(client) -> None:
    """A named call's arguments stream piece by piece (its first delta names it); the
    calls of ``required`` come whole at the end; joined, each equals the unstreamed reply."""
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        kw = dict(tool_choice=choice, seed=4, max_tokens=200)
        whole = _chat(client, **kw).choices[0]
        chunks = [c for c in _chat(client, **kw, stream=True) if c.choices]
        deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
        calls: dict[int, list[str]] = {}
        for d in deltas:
            if d.id is not None:  # a call's first delta: its id, type and name
                assert d.type == "function" and d.index not in calls
                calls[d.index] = [d.function.name, ""]
            calls[d.index][1] += d.function.arguments or ""
        assert [tuple(calls[i]) for i in sorted(calls)] == [
            (t.function.name, t.function.arguments) for t in whole.message.tool_calls
        ]
        assert chunks[-1].choices[0].finish_reason == whole.finish_reason
        if isinstance(choice, dict):
            assert len(deltas) > 3  # streamed as it came, not whole at the end


def test_the_tools_reach_the_template(client) -> None:
    template = (
        "{% if tools %}TOOLS:{{ tools | tojson }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    kw = dict(max_tokens=1, extra_body={"chat_template": template})
    tools = [{"type": "function", "function": {"name": "f"}}]
    with_tools = _chat(client, tools=tools, tool_choice="none", **kw).usage.prompt_tokens
    without = client.chat.completions.create(model=MODEL, messages=_MSG, **kw).usage.prompt_tokens
    assert with_tools - without == len(("TOOLS:" + json.dumps(tools)).encode())  # byte tokens


@pytest.mark.parametrize(
    ("kw", "param", "says"),
    [
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "must name one of the tools: get_weather, get_time",
        ),
        ({"tool_choice": "sometimes"}, "tool_choice", "must be 'none', 'auto', 'required'"),
        ({"tools": [{"type": "function"}]}, "tools", "tools[0] must be"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "not with another structured output field",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
                ],
                "tool_choice": "required",  # compiled where the output is constrained
            },
            "tools",
            "cannot be compiled",
        ),
    ],
)
def test_bad_tool_fields_are_a_400_naming_them(client, kw, param, says) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, max_tokens=2, **kw)
    error = e.value.body
    assert error["param"] == param and says in error["message"], error
