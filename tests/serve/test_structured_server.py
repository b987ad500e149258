"""Structured output through a live ``sarathi-pp serve`` with the official ``openai``
client (the tiny random Llama with a chat template): ``response_format`` ``json_schema``
and ``json_object``, vLLM's ``structured_outputs`` and ``guided_*``; sampled completions
at temperature 1 parse and validate, a choice and a regex match, a schema the grammar
engine cannot compile is a 400 naming the field, and a stream equals the same request
answered whole."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from serving import running_server, with_chat_template  # noqa: E402

MODEL = "tiny"
_MSG = [{"role": "user", "content": "Who are you?"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
    # llguidance's option, in the schema itself: no free whitespace (a random model would
    # fill its tokens with it)
    "x-guidance": {"whitespace_flexible": False},
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    model_dir = with_chat_template(llama_dir, tmp_path_factory.mktemp("structured") / "llama")
    with running_server(model_dir, max_model_len=256) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> Any:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def test_json_schema_completions_validate(client) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=_MSG, temperature=1.0, n=20, seed=3, max_tokens=120,
        response_format=RESPONSE_FORMAT,
    )  # fmt: skip
    texts = [c.message.content for c in r.choices]
    for choice, text in zip(r.choices, texts):
        assert choice.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 10


def test_json_object_and_vllms_fields(client) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=_MSG, temperature=1.0, n=4, seed=1, max_tokens=200,
        response_format={"type": "json_object"},
        extra_body={},
    )  # fmt: skip
    for c in r.choices:  # any object: it may run long; one that ends parses
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
        assert c.message.content.startswith("{")
    choices = ["red", "green", "blue sky"]
    r = client.completions.create(
        model=MODEL, prompt="Pick one:", temperature=1.0, n=10, seed=2, max_tokens=10,
        extra_body={"structured_outputs": {"choice": choices}},
    )  # fmt: skip
    assert {c.text for c in r.choices} <= set(choices) and len({c.text for c in r.choices}) > 1
    r = client.completions.create(
        model=MODEL, prompt="A code:", temperature=1.0, n=10, seed=2, max_tokens=20,
        extra_body={"guided_regex": r"[A-F]{2}-[0-9]{2,3}"},
    )  # fmt: skip
    for c in r.choices:
        assert re.fullmatch(r"[A-F]{2}-[0-9]{2,3}", c.text), c.text
    r = client.completions.create(
        model=MODEL, prompt="JSON:", temperature=1.0, n=5, seed=2, max_tokens=120,
        extra_body={"guided_json": SCHEMA},
    )  # fmt: skip
    for c in r.choices:
        jsonschema.validate(json.loads(c.text), SCHEMA)


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format",
            "Invalid type: nope",
        ),
        ({"guided_regex": "(ab"}, "guided_regex", "guided_regex: structured_outputs.regex '(ab'"),
        (
            {"structured_outputs": {"grammar": "start: undefined_rule"}},
            "structured_outputs",
            "cannot be compiled",
        ),
    ],
)
def test_what_the_engine_cannot_compile_is_a_400_naming_the_field(client, extra, param, says):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=_MSG, max_tokens=5, extra_body=extra)
    error = e.value.body
    assert error["param"] == param and says in error["message"], error


def test_stream_equals_the_whole_answer(client) -> None:
    kw = dict(
        model=MODEL, messages=_MSG, temperature=1.0, seed=7, max_tokens=120,
        response_format=RESPONSE_FORMAT,
    )  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.message.content
    jsonschema.validate(json.loads(streamed), SCHEMA)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_mask_time_is_in_metrics(server, client) -> None:
    import httpx

    def scrape() -> dict[str, float]:
        text = httpx.get(server.base_url + "/metrics").text
        return {
            name: float(line.split()[-1])
            for line in text.splitlines()
            for name in ("sarathi_pp_grammar_masks_total", "sarathi_pp_grammar_mask_seconds_total")
            if line.startswith(name + " ")
        }

    before = scrape()
    r = client.completions.create(
        model=MODEL, prompt="x", max_tokens=8, extra_body={"guided_regex": "[a-z]{8}"}
    )
    after = scrape()
    assert r.usage.completion_tokens == 8
    # one mask per sampled token (the EOS after the 8th is never sampled: max_tokens)
    assert after["sarathi_pp_grammar_masks_total"] - before["sarathi_pp_grammar_masks_total"] == 8
    assert (
        after["sarathi_pp_grammar_mask_seconds_total"]
        > before["sarathi_pp_grammar_mask_seconds_total"]
    )
