"""Tool calls in chat completions (OpenAI's ``tools`` and ``tool_choice``): the request's
functions are handed to the chat template; ``tool_choice`` picks how the reply becomes
calls:
- ``none``: plain text;
- a named function (``{"type": "function", "function": {"name": ...}}``): the output is
  constrained to that function's ``parameters`` schema and is the call's ``arguments``
  (works with any model);
- ``required``: the output is constrained to a JSON list of ``{"name", "parameters"}`` of
  the given functions (vLLM's shape), at least one call;
- ``auto`` (the default with tools): the model writes freely; a tool-call parser
  (``TOOL_PARSERS``, default ``hermes``) finds the calls in its text.
The constrained forms are JSON with ``json.dumps``' separators and no other whitespace
(the arguments are sent as JSON text anyway).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sarathi_pp import grammar
from sarathi_pp.sampling_params import SamplingParamsError, StructuredOutputsParams

# llguidance's JSON options, in the schema itself: json.dumps' separators, no free whitespace
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ToolError(ValueError):
    """A bad ``tools`` / ``tool_choice`` (``param``: the field)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes' format (Qwen2.5, Hermes 2/3): ``<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>`` blocks; the text before the first is the content. A block that is not
    such JSON leaves the whole text as content (no calls)."""
    blocks = re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", text, flags=re.DOTALL)
    calls = []
    for block in blocks:
        try:
            call = json.loads(block)
        except ValueError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        calls.append((call["name"], call.get("arguments", {})))
    if not calls:
        return text, []
    content = text[: text.index("<tool_call>")].strip()
    return content or None, [_call(name, args) for name, args in calls]


# name -> a parser: the model's text -> (content, tool calls)
TOOL_PARSERS: dict[str, Callable[[str], tuple[str | None, list[dict[str, Any]]]]] = {
    "hermes": _hermes,
}


def tool_parser(name: str) -> Callable[[str], tuple[str | None, list[dict[str, Any]]]]:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; valid: {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: Any) -> dict[str, Any]:
    """One call in OpenAI's shape (``arguments`` as JSON text)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools (OpenAI's ``[{"type": "function", "function": {...}}]``, as
    the template takes them), its ``choice`` (``none``, ``auto``, ``required`` or
    ``named``, then ``name``) and whether several calls may come (``parallel``)."""

    tools: tuple[dict[str, Any], ...]
    choice: str
    name: str | None = None
    parallel: bool = True
    parser: str = "hermes"

    def _parameters(self, name: str) -> dict[str, Any]:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or {"type": "object"}
        raise AssertionError(name)

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The constraint ``named`` and ``required`` put on the output (``None``: free)."""
        if self.choice == "named":
            assert self.name is not None
            return StructuredOutputsParams(
                json={**self._parameters(self.name), "x-guidance": _COMPACT}
            )
        if self.choice != "required":
            return None
        calls = {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "enum": [t["function"]["name"]]},
                            "parameters": self._parameters(t["function"]["name"]),
                        },
                        "required": ["name", "parameters"],
                        "additionalProperties": False,
                    }
                    for t in self.tools
                ]
            },
            "x-guidance": _COMPACT,
        }
        if not self.parallel:
            calls["maxItems"] = 1
        return StructuredOutputsParams(json=calls)

    @property
    def makes_calls(self) -> bool:
        return self.choice != "none"

    def answer(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A finished reply's ``content`` and ``tool_calls`` (none: the text is the
        content, e.g. a constrained reply that ``max_tokens`` cut short)."""
        if self.choice == "named":  # always the call (its arguments cut short by a length stop)
            assert self.name is not None
            return None, [_call(self.name, text)]
        if self.choice == "required":
            try:
                calls = json.loads(text)
            except ValueError:
                return text, []
            return None, [_call(c["name"], c["parameters"]) for c in calls]
        if self.choice == "auto":
            content, calls = tool_parser(self.parser)(text)
            return content, calls if self.parallel else calls[:1]
        return text, []


def tool_plan(body: dict[str, Any], parser: str = "hermes") -> ToolPlan | None:
    """The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked
    (``ToolError`` naming the field); ``None`` without tools."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError(
            "parallel_tool_calls", f"'parallel_tool_calls' must be a bool, got {parallel!r}"
        )
    if not tools:
        if choice not in (None, "none"):
            raise ToolError("tool_choice", f"'tool_choice'={choice!r} needs 'tools'")
        return None
    if not isinstance(tools, list):
        raise ToolError("tools", f"'tools' must be a list, got {tools!r}")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolError(
                "tools", f"tools[{i}] must be {{'type': 'function', 'function': {{'name', ...}}}}"
            )
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ToolError("tools", f"tools[{i}].function.parameters must be a JSON schema")
        names.append(fn["name"])
    name = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise ToolError(
                "tool_choice",
                f"'tool_choice'={choice!r} must name one of the tools: {', '.join(names)}",
            )
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise ToolError(
            "tool_choice",
            f"'tool_choice' must be 'none', 'auto', 'required' or a named function, got {choice!r}",
        )
    plan = ToolPlan(tuple(tools), choice, name, parallel is not False, parser)
    so = plan.structured_outputs()
    if so is not None:
        try:
            grammar.check(so)
        except SamplingParamsError as e:
            raise ToolError(
                "tools", f"tools: a function's parameters cannot be compiled: {e}"
            ) from None
    return plan
