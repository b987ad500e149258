"""The grammar a request's structured output compiles to, through llguidance
(``SamplingParams.structured_outputs``): its text, and the check the engine runs when it
takes the request, so a schema, regex or grammar the engine cannot compile is refused
naming it before any work. The last stage runs the grammar
(``stages/worker/structured.py``); this module imports neither torch nor a tokenizer.

Note [grammar engine]: llguidance rather than xgrammar. Both compute a mask in
microseconds on the CPU (xgrammar's was faster, about 2x, in a measurement with SmolLM2's
tokenizer), far below a step; llguidance is a 3 MB wheel with no dependencies (xgrammar
needs torch, triton and tvm-ffi, and imports torch), so the front door can check a grammar
without torch or a tokenizer. vLLM runs either.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import TYPE_CHECKING

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from sarathi_pp.sampling_params import SamplingParamsError, StructuredOutputsParams

# OpenAI's ``response_format: {"type": "json_object"}``: any JSON object.
ANY_JSON_OBJECT = '{"type":"object"}'


@lru_cache(maxsize=256)
def grammar_text(so: StructuredOutputsParams) -> str:
    """``so`` as an llguidance grammar (its JSON text, tokenizer-independent);
    ``ValueError`` for text llguidance cannot read at all (GBNF it cannot convert)."""
    kind = so.kind
    if kind in ("json", "json_object"):
        schema = so.json if kind == "json" else ANY_JSON_OBJECT
        assert isinstance(schema, str)  # normalised by StructuredOutputsParams
        # the schema's own "x-guidance" options win over these defaults (llguidance's order)
        defaults: JsonCompileOptions = {"whitespace_flexible": not so.disable_any_whitespace}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
    if kind == "regex":
        assert so.regex is not None
        return llguidance.grammar_from("regex", so.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(list(so.choice or ())))
    assert so.grammar is not None
    return llguidance.grammar_from("grammar", so.grammar)


@lru_cache(maxsize=256)
def check(so: StructuredOutputsParams) -> None:
    """``SamplingParamsError`` (``param`` ``structured_outputs``) naming the constraint and
    llguidance's reason when it cannot compile ``so``."""
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar_text(so))
    except ValueError as e:
        error = str(e)
    if error:
        raise SamplingParamsError(
            "structured_outputs",
            f"structured_outputs.{so.kind} {_shown(so)} cannot be compiled: {error.strip()}",
        )


def _shown(so: StructuredOutputsParams) -> str:
    text = str(getattr(so, so.kind))
    return repr(text if len(text) <= 200 else text[:200] + "...")
