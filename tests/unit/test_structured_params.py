"""Structured output's request values: ``StructuredOutputsParams`` (exactly one
constraint, checked for shape), the grammar engine's check at the front door
(``sarathi_pp/grammar.py``: what llguidance cannot compile is refused naming it), and the
server's fields that ask for it (``serve/structured_fields.py``)."""

from __future__ import annotations

import json

import pytest

from sarathi_pp import grammar
from sarathi_pp.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from sarathi_pp.serve.structured_fields import structured_outputs

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


def test_a_schema_is_kept_as_text_in_its_key_order_and_hashes():
    from_dict = StructuredOutputsParams(json=SCHEMA)
    from_text = StructuredOutputsParams(json=json.dumps(SCHEMA, indent=2))
    assert from_dict == from_text and hash(from_dict) == hash(from_text)
    assert list(json.loads(from_dict.json)["properties"]) == ["b", "a"]  # not sorted
    assert from_dict.kind == "json" and "json=" in repr(from_dict)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({}, "exactly one of json, regex, choice, grammar, json_object; got none"),
        ({"regex": "a", "choice": ["a"]}, "got ['regex', 'choice']"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"json": [1, 2]}, "must be a JSON schema (an object), got [1, 2]"),
        ({"choice": "ab"}, "choice must be non-empty strings, got 'ab'"),
        ({"choice": ["a", ""]}, "choice must be non-empty strings"),
        ({"regex": ""}, "regex must be a non-empty string, got ''"),
        ({"json_object": 1}, "json_object must be True or False, got 1"),
    ],
)
def test_bad_shapes_are_refused_naming_the_field(kwargs, says):
    with pytest.raises(SamplingParamsError) as e:
        StructuredOutputsParams(**kwargs)
    assert e.value.param == "structured_outputs" and says in str(e.value)


def test_sampling_params_take_a_dict_and_keep_the_tokens_on_the_last_stage():
    p = SamplingParams(structured_outputs={"regex": "[ab]+"})
    assert p.structured_outputs == StructuredOutputsParams(regex="[ab]+")
    assert p.keeps_tokens and not SamplingParams().keeps_tokens  # stages/worker/structured.py
    assert p.clone().structured_outputs == p.structured_outputs
    with pytest.raises(SamplingParamsError, match="unexpected keyword argument 'jsn'"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(SamplingParamsError, match="must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="[ab]+")


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        (
            {"json": {"type": "foo"}},
            'structured_outputs.json \'{"type":"foo"}\' cannot be compiled',
        ),
        ({"regex": "(ab"}, "structured_outputs.regex '(ab' cannot be compiled"),
        ({"grammar": "start: foo"}, "unknown name"),
    ],
)
def test_what_the_engine_cannot_compile_is_refused_naming_it(kwargs, says):
    with pytest.raises(SamplingParamsError) as e:
        grammar.check(StructuredOutputsParams(**kwargs))
    assert e.value.param == "structured_outputs" and says in str(e.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"json": SCHEMA},
        {"json_object": True},
        {"regex": "[0-9]{3}"},
        {"choice": ["yes", "no"]},
        {"grammar": 'root ::= "a" | "b"'},  # GBNF
        {"grammar": 'start: "a" | "b"'},  # Lark
    ],
)
def test_every_kind_compiles(kwargs):
    grammar.check(StructuredOutputsParams(**kwargs))


# --- the server's fields -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "want"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA},
                }
            },
            StructuredOutputsParams(json=SCHEMA),
        ),
        (
            {"structured_outputs": {"choice": ["a", "b"]}},
            StructuredOutputsParams(choice=("a", "b")),
        ),
        (
            {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
            StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        ),
        ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
        ({"guided_regex": "[ab]+"}, StructuredOutputsParams(regex="[ab]+")),
        ({"guided_choice": ["a"]}, StructuredOutputsParams(choice=("a",))),
        ({"guided_grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
    ],
)
def test_each_field_asks_for_its_constraint(body, want):
    assert structured_outputs(body) == want


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        (
            {"guided_json": SCHEMA, "guided_regex": "a"},
            "guided_regex",
            "at most one structured output field per request, got guided_json, guided_regex",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format", "response_format must be"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "needs json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "foo"}},
                }
            },
            "response_format",
            "Invalid type: foo",
        ),
        ({"guided_regex": "(ab"}, "guided_regex", "guided_regex: structured_outputs.regex '(ab'"),
        (
            {"structured_outputs": {"regexp": "a"}},
            "structured_outputs",
            "regexp='a' is not a field",
        ),
        (
            {"structured_outputs": {"regex": "a", "whitespace_pattern": " +"}},
            "structured_outputs",
            "whitespace_pattern=' +' is not supported at this value",
        ),
    ],
)
def test_bad_fields_are_refused_naming_the_field(body, param, says):
    with pytest.raises(SamplingParamsError) as e:
        structured_outputs(body)
    assert e.value.param == param and says in str(e.value), str(e.value)
