"""A request's structured output, from whichever field asks for it: OpenAI's
``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs``
(``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) or its older ``guided_json``
/ ``guided_regex`` / ``guided_choice`` / ``guided_grammar``. At most one of them; the
constraint is compiled here (``sarathi_pp/grammar.py``), so one the grammar engine cannot
compile is a 400 naming the field before the engine sees the request.

Errors are ``SamplingParamsError`` whose ``param`` is the request's field.
"""

from __future__ import annotations

from typing import Any

from sarathi_pp import grammar
from sarathi_pp.sampling_params import SamplingParamsError, StructuredOutputsParams

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_OPTIONS = ("disable_any_whitespace",)
# vLLM's ``StructuredOutputsParams`` options, accepted at the values that change nothing
_NO_OP_OPTIONS = {
    "disable_fallback": (False, True),  # one engine: there is nothing to fall back to
    "disable_additional_properties": (False,),
    "whitespace_pattern": (None,),
    "structural_tag": (None,),
}


def structured_outputs(body: dict[str, Any]) -> StructuredOutputsParams | None:
    """The request's constraint (``None``: free text), checked and compiled."""
    asked = [
        (name, body[name])
        for name in ("response_format", "structured_outputs", *_GUIDED)
        if body.get(name) is not None
        and not (name == "response_format" and body[name] == {"type": "text"})
    ]
    if len(asked) > 1:
        names = ", ".join(n for n, _ in asked)
        raise SamplingParamsError(
            asked[1][0], f"at most one structured output field per request, got {names}"
        )
    if not asked:
        return None
    name, value = asked[0]
    try:
        if name == "response_format":
            so = _response_format(value)
        elif name == "structured_outputs":
            so = _structured(value)
        else:
            so = StructuredOutputsParams(**{_GUIDED[name]: value})
        if so is not None:
            grammar.check(so)
    except SamplingParamsError as e:
        message = str(e) if name == "structured_outputs" else f"{name}: {e}"
        raise SamplingParamsError(name, message) from None
    return so


def _response_format(value: Any) -> StructuredOutputsParams | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise SamplingParamsError(
                "response_format",
                "response_format of type 'json_schema' needs json_schema.schema (a JSON "
                f"schema object), got {spec!r}",
            )
        return StructuredOutputsParams(json=schema)
    raise SamplingParamsError(
        "response_format",
        "response_format must be {'type': 'text'}, {'type': 'json_object'} or "
        f"{{'type': 'json_schema', 'json_schema': {{'schema': ...}}}}, got {value!r}",
    )


def _structured(value: Any) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise SamplingParamsError(
            "structured_outputs", f"structured_outputs must be an object, got {value!r}"
        )
    for key, v in value.items():
        if key in _STRUCTURED_KEYS or key in _OPTIONS:
            continue
        if key in _NO_OP_OPTIONS and any(v is ok or v == ok for ok in _NO_OP_OPTIONS[key]):
            continue
        what = "is not supported at this value" if key in _NO_OP_OPTIONS else "is not a field"
        raise SamplingParamsError(
            "structured_outputs", f"structured_outputs.{key}={v!r} {what} (fields: "
            f"{', '.join(_STRUCTURED_KEYS)})",
        )  # fmt: skip
    given = {k: value[k] for k in _STRUCTURED_KEYS if value.get(k) not in (None, False)}
    given.update({k: value[k] for k in _OPTIONS if k in value})
    return StructuredOutputsParams(**given)
