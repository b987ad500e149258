"""Every request field of ``/v1/completions`` and ``/v1/chat/completions``, each honoured or
refused: OpenAI's API (completions and chat completions, as the ``openai`` Python client
sends them) and vLLM's ``CompletionRequest`` / ``ChatCompletionRequest``
(``vllm/entrypoints/openai/protocol.py`` of vLLM v0.10.1, plus ``structured_outputs`` from
v0.11, which replaces the ``guided_*`` fields).

Why a list: a field a client sends is never silently dropped. ``protocol.py`` reads the
honoured ones; a refused one present with a value that asks for something is a 400 in
OpenAI's error shape naming it (``no_op``: its values that ask for nothing, accepted); a
field in neither list is logged and ignored, as vLLM does (a client's misspelling, or a
field newer than this list). ``tests/serve/test_vllm_habits.py`` sends every field of the
list to a live server and checks each is answered as listed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

COMPLETIONS = "completions"
CHAT = "chat"
BOTH = (COMPLETIONS, CHAT)
VLLM_VERSION = "v0.10.1"  # and structured_outputs from v0.11


@dataclass(frozen=True)
class RequestField:
    name: str
    endpoints: tuple[str, ...]
    source: str  # "openai" or "vllm"
    honoured: bool
    note: str
    # A request's fields that use it (the test sends them; the value asks for something)
    example: dict[str, Any]
    # Refused fields: the values that ask for nothing (accepted); None: no value is
    no_op: Callable[[Any], bool] | None = None


def _honoured(name: str, endpoints: tuple[str, ...], source: str, note: str, example: Any,
              **more: Any) -> RequestField:  # fmt: skip
    return RequestField(name, endpoints, source, True, note, {name: example, **more})


def _refused(name: str, endpoints: tuple[str, ...], source: str, note: str, example: Any,
             no_op: Callable[[Any], bool] | None = None) -> RequestField:  # fmt: skip
    return RequestField(name, endpoints, source, False, note, {name: example}, no_op)


_MSG = [{"role": "user", "content": "hi"}]

FIELDS: tuple[RequestField, ...] = (
    # --- OpenAI's, both endpoints ----------------------------------------------------------
    _honoured("model", BOTH, "openai", "any --served-model-name; another is a 404", "tiny"),
    _honoured("frequency_penalty", BOTH, "openai", "", 0.5),
    _honoured("presence_penalty", BOTH, "openai", "", 0.5),
    _honoured("logit_bias", BOTH, "openai", "token id -> bias in [-100, 100]", {"5": 1.0}),
    _honoured(
        "max_tokens",
        BOTH,
        "openai",
        "completions default 16, chat: the rest of the context (vLLM's defaults)",
        3,
    ),  # fmt: skip
    _honoured("n", BOTH, "openai", "", 2),
    _honoured("seed", BOTH, "openai", "", 1),
    _honoured("stop", BOTH, "openai", "", ["zz"]),
    _honoured("stream", BOTH, "openai", "server-sent events", True),
    _honoured(
        "stream_options", BOTH, "openai", "include_usage", {"include_usage": True}, stream=True
    ),  # fmt: skip
    _honoured("temperature", BOTH, "openai", "", 0.5),
    _honoured("top_p", BOTH, "openai", "", 0.9),
    _honoured(
        "user",
        BOTH,
        "openai",
        "an end-user id for the client's records: accepted, changes nothing (as vLLM)",
        "u1",
    ),  # fmt: skip
    # --- OpenAI's, completions -------------------------------------------------------------
    _honoured("prompt", (COMPLETIONS,), "openai", "text, token ids, or a list of either", "hi"),
    _honoured("logprobs", (COMPLETIONS,), "openai", "the k most likely tokens", 2),
    _honoured("echo", (COMPLETIONS,), "openai", "the prompt before the completion", True),
    _refused(
        "best_of",
        (COMPLETIONS,),
        "openai",
        "no best-of-n selection",
        2,
        lambda v: v == 1 and not isinstance(v, bool),
    ),  # fmt: skip
    _refused(
        "suffix",
        (COMPLETIONS,),
        "openai",
        "no insertion (fill-in-the-middle)",
        "end",
        lambda v: v == "",
    ),  # fmt: skip
    # --- OpenAI's, chat ----------------------------------------------------------------------
    _honoured(
        "messages",
        (CHAT,),
        "openai",
        "text content; tool_calls and tool_call_id "
        "history rendered through the chat template; images refused",
        _MSG,
    ),  # fmt: skip
    _honoured("logprobs", (CHAT,), "openai", "", True),
    _honoured("top_logprobs", (CHAT,), "openai", "", 2, logprobs=True),
    _honoured("max_completion_tokens", (CHAT,), "openai", "max_tokens' newer name", 3),
    _honoured(
        "response_format",
        BOTH,
        "openai",
        "text, json_object, json_schema (json_schema.schema): a token mask from the "
        "grammar engine (llguidance); a schema it cannot compile is a 400",
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
    ),  # fmt: skip
    _honoured(
        "tools",
        (CHAT,),
        "openai",
        "functions handed to the chat template; calls per tool_choice (serve/tools.py)",
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    ),  # fmt: skip
    _honoured(
        "tool_choice",
        (CHAT,),
        "openai",
        "none, auto (the hermes parser), required, a named function (both constrained)",
        "none",
    ),  # fmt: skip
    _honoured(
        "parallel_tool_calls",
        (CHAT,),
        "openai",
        "false: at most one call",
        False,
    ),  # fmt: skip
    _refused(
        "functions",
        (CHAT,),
        "openai",
        "the deprecated API: use tools",
        [{"name": "f"}],
        lambda v: v == [],
    ),  # fmt: skip
    _refused(
        "function_call",
        (CHAT,),
        "openai",
        "the deprecated API: use tool_choice",
        "auto",
        lambda v: v == "none",
    ),  # fmt: skip
    _refused("store", (CHAT,), "openai", "no stored completions", True, lambda v: v is False),
    _refused(
        "metadata", (CHAT,), "openai", "no stored completions to tag", {"k": "v"}, lambda v: v == {}
    ),  # fmt: skip
    _refused(
        "modalities",
        (CHAT,),
        "openai",
        "text output only",
        ["text", "audio"],
        lambda v: v == ["text"],
    ),  # fmt: skip
    _refused("audio", (CHAT,), "openai", "text output only", {"voice": "alloy"}),
    _refused(
        "prediction", (CHAT,), "openai", "no predicted outputs", {"type": "content", "content": "x"}
    ),  # fmt: skip
    _refused(
        "service_tier", (CHAT,), "openai", "one tier", "flex", lambda v: v in ("auto", "default")
    ),  # fmt: skip
    _refused("reasoning_effort", (CHAT,), "openai", "no reasoning models' controls", "low"),
    _refused("web_search_options", (CHAT,), "openai", "no web search", {}),
    # --- vLLM's, both endpoints --------------------------------------------------------------
    _honoured("top_k", BOTH, "vllm", "0 or -1: off", 5),
    _honoured("min_p", BOTH, "vllm", "", 0.1),
    _honoured("repetition_penalty", BOTH, "vllm", "", 1.2),
    _honoured("stop_token_ids", BOTH, "vllm", "", [5]),
    _honoured("include_stop_str_in_output", BOTH, "vllm", "", True, stop=["a"]),
    _honoured("ignore_eos", BOTH, "vllm", "", True),
    _honoured("min_tokens", BOTH, "vllm", "", 2),
    _honoured("skip_special_tokens", BOTH, "vllm", "", False),
    _honoured(
        "spaces_between_special_tokens",
        BOTH,
        "vllm",
        "as vLLM V1: a slow tokenizer's "
        "decode takes it; a fast tokenizer's decoder joins tokens as trained and it "
        "changes nothing (vLLM's fast detokenizer ignores it too)",
        False,
    ),  # fmt: skip
    _honoured("truncate_prompt_tokens", BOTH, "vllm", "the prompt's last k tokens", 2),
    _honoured("prompt_logprobs", BOTH, "vllm", "not with stream", 1),
    _honoured("allowed_token_ids", BOTH, "vllm", "", [5, 6, 7]),
    _honoured("bad_words", BOTH, "vllm", "", ["x"]),
    _honoured(
        "add_special_tokens",
        BOTH,
        "vllm",
        "the tokenizer's BOS (completions' default "
        "true; chat's false: the template writes its own)",
        False,
    ),  # fmt: skip
    _honoured("request_id", BOTH, "vllm", "the response id's suffix", "my-id"),
    _honoured(
        "cache_salt",
        BOTH,
        "vllm",
        "requests share prefix-cache blocks only with requests of the same salt",
        "salt",
    ),  # fmt: skip
    _refused("use_beam_search", BOTH, "vllm", "no beam search", True, lambda v: v is False),
    _refused("length_penalty", BOTH, "vllm", "beam search only", 0.5, lambda v: v == 1),
    _refused(
        "priority",
        BOTH,
        "vllm",
        "no scheduler policy orders requests by priority yet",
        1,
        lambda v: v == 0 and not isinstance(v, bool),
    ),  # fmt: skip
    _honoured(
        "guided_json", BOTH, "vllm", "structured_outputs.json's older name", {"type": "object"}
    ),
    _honoured("guided_regex", BOTH, "vllm", "structured_outputs.regex's older name", "[ab]+"),
    _honoured(
        "guided_choice", BOTH, "vllm", "structured_outputs.choice's older name", ["a", "b"]
    ),  # fmt: skip
    _honoured(
        "guided_grammar",
        BOTH,
        "vllm",
        "structured_outputs.grammar's older name (Lark or GBNF)",
        'root ::= "a" | "b"',
    ),  # fmt: skip
    _refused(
        "guided_decoding_backend",
        BOTH,
        "vllm",
        "one grammar engine, llguidance ('auto', 'guidance', 'llguidance' accepted)",
        "xgrammar",
        lambda v: v in ("auto", "guidance", "llguidance"),
    ),  # fmt: skip
    _refused("guided_whitespace_pattern", BOTH, "vllm", "the schema's own whitespace", " *"),
    _refused("structural_tag", BOTH, "vllm", "no structural tags", "{}"),
    _honoured(
        "structured_outputs",
        BOTH,
        "vllm",
        "json, regex, choice, grammar, json_object; at most one structured output field",
        {"regex": "[ab]+"},
    ),  # fmt: skip
    _refused("logits_processors", BOTH, "vllm", "no request-defined logits processors", ["p"]),
    _refused(
        "return_tokens_as_token_ids", BOTH, "vllm", "token text only", True, lambda v: v is False
    ),  # fmt: skip
    _refused("kv_transfer_params", BOTH, "vllm", "no disaggregated prefill", {"a": 1}),
    _refused("vllm_xargs", BOTH, "vllm", "no custom extensions", {"a": 1}),
    # --- vLLM's, completions -----------------------------------------------------------------
    _refused("prompt_embeds", (COMPLETIONS,), "vllm", "token ids or text only", "AAAA"),
    # --- vLLM's, chat -------------------------------------------------------------------------
    _honoured("add_generation_prompt", (CHAT,), "vllm", "default true", False),
    _honoured(
        "continue_final_message",
        (CHAT,),
        "vllm",
        "the last (assistant) message continued; needs add_generation_prompt false",
        True,
        add_generation_prompt=False,
        messages=[*_MSG, {"role": "assistant", "content": "he"}],
    ),  # fmt: skip
    _honoured(
        "chat_template",
        (CHAT,),
        "vllm",
        "this request's template (Jinja)",
        "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    ),  # fmt: skip
    _honoured(
        "chat_template_kwargs",
        (CHAT,),
        "vllm",
        "extra template variables",
        {"enable_thinking": False},
    ),  # fmt: skip
    _refused("echo", (CHAT,), "vllm", "completions' parameter", True, lambda v: v is False),
    _refused(
        "documents",
        (CHAT,),
        "vllm",
        "no retrieval documents in the template",
        [{"title": "t", "text": "x"}],
    ),  # fmt: skip
    _refused(
        "mm_processor_kwargs", (CHAT,), "vllm", "text models only", {"a": 1}, lambda v: v == {}
    ),  # fmt: skip
)


def fields_of(endpoint: str) -> dict[str, RequestField]:
    """``endpoint``'s fields by name."""
    return {f.name: f for f in FIELDS if endpoint in f.endpoints}


def refused_fields(endpoint: str) -> dict[str, RequestField]:
    return {n: f for n, f in fields_of(endpoint).items() if not f.honoured}
