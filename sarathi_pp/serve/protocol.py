"""OpenAI's request shapes: a request body (parsed JSON) checked into a ``GenerateRequest``
(or a tokenizer request), and the error objects; the response bodies are ``responses.py``'s.

Why hand-written checks instead of pydantic models: every mistake must be a 400 in
OpenAI's error shape naming the field (FastAPI's own validation answers 422 in another
shape), and the values themselves are checked once, by ``SamplingParams``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any

from sarathi_pp.engine.input_processor import ChatOptions
from sarathi_pp.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError
from sarathi_pp.serve.request_fields import CHAT, COMPLETIONS, fields_of, refused_fields
from sarathi_pp.serve.structured_fields import structured_outputs
from sarathi_pp.serve.tools import ToolError, ToolPlan, tool_plan

# ``max_tokens`` when a request leaves it out, per endpoint, as vLLM's (v0.10.1
# ``CompletionRequest.max_tokens = 16``; ``ChatCompletionRequest.max_tokens = None``, which
# vLLM turns into the rest of the context): ``None`` runs to ``max_model_len``.
DEFAULT_MAX_TOKENS: dict[str, int | None] = {COMPLETIONS: 16, CHAT: None}

# The request fields, each honoured or refused: ``request_fields.py`` (a field outside it is
# ignored with a warning naming it, as vLLM's server does: a client's misspelling, e.g.
# ``max_token``, or a field newer than the list).
_KNOWN_FIELDS = {endpoint: frozenset(fields_of(endpoint)) for endpoint in (COMPLETIONS, CHAT)}
_MAX_NAMED = 16  # ignored fields named in one warning (a body is the client's to make)

logger = logging.getLogger(__name__)


# The fields of ``POST /tokenize`` and ``POST /detokenize`` (vLLM's).
_TOKENIZE_FIELDS = frozenset(
    {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
     "continue_final_message", "chat_template", "chat_template_kwargs", "return_token_strs"}
)  # fmt: skip
_DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def warn_ignored_fields(body: dict[str, Any], known: frozenset[str]) -> None:
    """Log the fields of ``body`` this server does not read (vLLM's warning)."""
    ignored = sorted(str(k)[:64] for k in body if k not in known)
    if ignored:
        more = f" and {len(ignored) - _MAX_NAMED} more" if len(ignored) > _MAX_NAMED else ""
        logger.warning(
            "The following fields were present in the request but ignored: %s%s",
            ", ".join(ignored[:_MAX_NAMED]), more,
        )  # fmt: skip


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(
    message: str, type: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


class ParamError(ValueError):
    """A request's value the engine thread refuses (a 400 naming ``param``): raised where
    the prompt's tokens are known."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_room(
    num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, where: str = "prompt"
) -> None:
    """OpenAI's and vLLM's answer to a ``max_tokens`` the context cannot hold: a 400, not a
    request that runs to ``max_model_len``. ``max_tokens=None``: not given (the default
    stops at ``max_model_len`` like any request)."""
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise ParamError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"{where}, {max_tokens} in the completion): reduce max_tokens",
            "max_tokens",
        )


@dataclass(frozen=True)
class Prompt:
    """One prompt of a completion request: text, or token ids."""

    text: str | None = None
    token_ids: list[int] | None = None


@dataclass(frozen=True)
class GenerateRequest:
    """One checked request: ``prompts`` (a completion: one or more, each its own choice), or
    for chat ``messages`` (rendered by the engine thread, which owns the tokenizer)."""

    model: str | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    prompts: tuple[Prompt, ...] = ()
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = None  # as given (None: the endpoint's default)
    request_id: str | None = None  # vLLM's: the response id's suffix (None: a random one)
    # vLLM's: the tokenizer's special tokens (BOS) added to the prompt (None: the default:
    # a completion's yes, a chat's only where its template writes none)
    add_special_tokens: bool | None = None
    chat: ChatOptions | None = None  # a chat's rendering options
    cache_salt: str | None = None  # vLLM's: shares the prefix cache only with the same salt
    echo: bool = False  # completions: each choice's text starts with its prompt
    echo_only: bool = False  # and ``max_tokens: 0``: it is only its prompt (vLLM's)
    tools: ToolPlan | None = None  # a chat's tools and how its reply becomes calls


# Prompts in one completion request at most, and choices (prompts x ``n``: each its own
# engine request) in one request.
MAX_PROMPTS = 64
MAX_CHOICES = 64


# --- checks --------------------------------------------------------------------------------
def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _get(body: dict[str, Any], key: str, kind: str, default: Any = None) -> Any:
    """``body[key]`` (``default`` when missing or null) checked to be of ``kind``."""
    value = body.get(key)
    if value is None:
        return default
    ok = {
        "int": _is_int,
        "number": _is_number,
        "bool": lambda x: isinstance(x, bool),
        "str": lambda x: isinstance(x, str),
        "dict": lambda x: isinstance(x, dict),
    }[kind](value)
    if not ok:
        article = "an" if kind == "int" else "a"
        raise bad_request(f"'{key}' must be {article} {kind}, got {value!r}", key)
    return value


def check_unsupported(body: dict[str, Any], endpoint: str) -> None:
    """A 400 naming the first refused field (``request_fields.py``) the request asks
    something of: present, not null, and not one of its values that ask for nothing."""
    for name, field in refused_fields(endpoint).items():
        value = body.get(name)
        if value is not None and not (field.no_op is not None and field.no_op(value)):
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            raise bad_request(
                f"'{name}'={shown} is not supported by this server: {field.note}", name
            )


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request(f"'stop' must be a string or a list of non-empty strings: {stop!r}")
    return tuple(stop)


def sampling_params(
    body: dict[str, Any],
    max_tokens_keys: tuple[str, ...],
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    echo: bool | None = None,
    defaults: dict[str, Any] | None = None,
    default_max_tokens: int | None = None,
) -> SamplingParams:
    """``echo``: completions' ``echo`` (``None``: the endpoint has none), with which
    ``max_tokens`` may be 0 (the prompt alone comes back, as vLLM: one token is generated
    and dropped). ``defaults``: the model folder's sampling defaults
    (``LLMEngine.default_sampling``), for the fields the request leaves out;
    ``default_max_tokens``: the endpoint's (``DEFAULT_MAX_TOKENS``)."""
    d = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
    d.update(defaults or {})
    # An explicit null is the rest of the context, as vLLM (whose completions default, 16,
    # applies only to a request without the field).
    max_tokens = None if any(k in body for k in max_tokens_keys) else default_max_tokens
    for key in max_tokens_keys:  # the first one given wins
        if body.get(key) is not None:
            max_tokens = _get(body, key, "int")
            if max_tokens == 0 and echo:
                max_tokens = 1
            elif max_tokens < 1:
                least = "1" if echo is None else "0 with 'echo', else 1"
                raise bad_request(f"'{key}' must be >= {least}, got {max_tokens}", key)
            break
    top_k = _get(body, "top_k", "int", d["top_k"])
    n = _get(body, "n", "int", 1)
    try:
        structured = structured_outputs(body)
    except SamplingParamsError as e:
        raise bad_request(str(e), e.param) from None
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"'n' must be in [1, {MAX_CHOICES}], got {n}", "n")
    try:
        return SamplingParams(
            n=n,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            max_tokens=max_tokens,
            temperature=float(_get(body, "temperature", "number", d["temperature"])),
            top_p=float(_get(body, "top_p", "number", d["top_p"])),
            top_k=0 if top_k == -1 else top_k,  # vLLM spells "off" -1
            # vLLM's extra parameters
            presence_penalty=float(_get(body, "presence_penalty", "number", 0.0)),
            frequency_penalty=float(_get(body, "frequency_penalty", "number", 0.0)),
            repetition_penalty=float(
                _get(body, "repetition_penalty", "number", d["repetition_penalty"])
            ),
            min_p=float(_get(body, "min_p", "number", d["min_p"])),
            min_tokens=_get(body, "min_tokens", "int", 0),
            logit_bias=_logit_bias(body),
            include_stop_str_in_output=_get(body, "include_stop_str_in_output", "bool", False),
            skip_special_tokens=_get(body, "skip_special_tokens", "bool", True),
            spaces_between_special_tokens=_get(body, "spaces_between_special_tokens", "bool", True),
            seed=_get(body, "seed", "int"),
            stop=_stop(body),
            ignore_eos=_get(body, "ignore_eos", "bool", False),
            allowed_token_ids=_optional_tuple(_int_list(body, "allowed_token_ids")),
            stop_token_ids=tuple(_int_list(body, "stop_token_ids") or ()),
            bad_words=_bad_words(body),
            truncate_prompt_tokens=_get(body, "truncate_prompt_tokens", "int"),
            structured_outputs=structured,
        )
    except (ValueError, TypeError) as e:  # SamplingParamsError names its field
        name = getattr(e, "param", None)
        raise bad_request(str(e), name if name in body else None) from None


def _int_list(body: dict[str, Any], key: str) -> list[int] | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(_is_int(x) for x in value):
        raise bad_request(f"'{key}' must be a list of integers, got {value!r}", key)
    return value


def _bad_words(body: dict[str, Any]) -> tuple[str, ...]:
    words = body.get("bad_words")
    if words is None:
        return ()
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise bad_request(f"'bad_words' must be a list of strings, got {words!r}", "bad_words")
    return tuple(words)


def _optional_tuple(values: list[int] | None) -> tuple[int, ...] | None:
    return None if values is None else tuple(values)


def _logit_bias(body: dict[str, Any]) -> dict[int, float]:
    """OpenAI's ``logit_bias``: token ids (as JSON object keys: strings) -> numbers."""
    bias = _get(body, "logit_bias", "dict", {})
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(
                f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias"
            ) from None
        if not _is_number(value):
            raise bad_request(f"'logit_bias' values must be numbers, got {value!r}", "logit_bias")
        out[token] = float(value)
    return out


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """``SamplingParams.logprobs`` from the request: completions' ``logprobs`` (how many
    most likely tokens per position), chat's ``logprobs`` (bool) and ``top_logprobs``."""
    if not chat:
        if body.get("top_logprobs") is not None:
            raise bad_request(
                "'top_logprobs' is a chat parameter: completions take 'logprobs': k",
                "top_logprobs",
            )
        num = _get(body, "logprobs", "int")
        if num is not None and not 0 <= num <= MAX_LOGPROBS:
            raise bad_request(f"'logprobs' must be in [0, {MAX_LOGPROBS}], got {num}", "logprobs")
        return num
    wanted = _get(body, "logprobs", "bool", False)
    top = _get(body, "top_logprobs", "int")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad_request(
            f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs"
        )
    if top and not wanted:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None


def _prompt_logprobs(body: dict[str, Any], stream: bool, logprobs: int | None) -> int | None:
    """``SamplingParams.prompt_logprobs`` (vLLM's extra parameter): ``prompt_logprobs`` as
    given, else completions' ``logprobs`` when ``echo`` is set (the echoed prompt's tokens
    get their log-probabilities too, as vLLM and OpenAI's legacy API)."""
    num = _get(body, "prompt_logprobs", "int")
    if num is not None:
        if not 0 <= num <= MAX_LOGPROBS:
            raise bad_request(
                f"'prompt_logprobs' must be in [0, {MAX_LOGPROBS}], got {num}", "prompt_logprobs"
            )
        if stream:  # vLLM's rule: they come with the final output only
            raise bad_request(
                "'prompt_logprobs' is not available with 'stream': true", "prompt_logprobs"
            )
        return num
    if body.get("echo") is True and logprobs is not None:
        return logprobs
    return None


def _check_object(body: Any) -> None:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")


def _messages(messages: Any) -> list[dict[str, Any]]:
    """A chat's ``messages``, each checked (``_message``)."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    return [_message(i, m) for i, m in enumerate(messages)]


def _common(
    body: Any, max_tokens_keys: tuple[str, ...], chat: bool, defaults: dict[str, Any] | None
) -> dict[str, Any]:
    _check_object(body)
    endpoint = CHAT if chat else COMPLETIONS
    check_unsupported(body, endpoint)
    warn_ignored_fields(body, _KNOWN_FIELDS[endpoint])
    _get(body, "user", "str")
    stream = _get(body, "stream", "bool", False)
    options = _get(body, "stream_options", "dict", {})
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad_request("'stream_options.include_usage' must be a bool", "stream_options")
    logprobs = _logprobs(body, chat)
    prompt_logprobs = _prompt_logprobs(body, stream, logprobs)
    echo = None if chat else body.get("echo") is True
    default_max_tokens = DEFAULT_MAX_TOKENS[CHAT if chat else COMPLETIONS]
    params = sampling_params(
        body, max_tokens_keys, logprobs, prompt_logprobs, echo, defaults, default_max_tokens
    )
    given = any(body.get(key) is not None for key in max_tokens_keys)
    return {
        "model": _get(body, "model", "str"),
        "request_id": _get(body, "request_id", "str"),
        "add_special_tokens": _get(body, "add_special_tokens", "bool"),
        "cache_salt": _cache_salt(body),
        "params": params,
        "stream": stream,
        "include_usage": stream and include_usage,
        "max_tokens": params.max_tokens if given else None,
    }


def _cache_salt(body: Any) -> str | None:
    salt = _get(body, "cache_salt", "str")
    if salt is not None and not salt:
        raise bad_request("'cache_salt' must be a non-empty string", "cache_salt")
    return salt


def completion_request(body: Any, defaults: dict[str, Any] | None = None) -> GenerateRequest:
    """``POST /v1/completions``: ``prompt`` as text, token ids, or a list of either (a
    batch: one choice per prompt, ``index`` in prompt order). ``defaults``: the model
    folder's sampling defaults (``sampling_params``)."""
    common = _common(body, ("max_tokens",), chat=False, defaults=defaults)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(_is_int(t) for t in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise bad_request(
                f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", "prompt"
            )
        prompts = tuple(_prompt(x, f"prompt[{i}]") for i, x in enumerate(prompt))
    else:
        prompts = (_prompt(prompt, "prompt"),)
    echo = _get(body, "echo", "bool", False)
    n = common["params"].n
    if len(prompts) * n > MAX_CHOICES:
        raise bad_request(
            f"at most {MAX_CHOICES} choices per request (prompts x n), got {len(prompts)} x {n}",
            "n",
        )
    echo_only = echo and body.get("max_tokens") == 0
    return GenerateRequest(prompts=prompts, echo=echo, echo_only=echo_only, **common)


def _prompt(prompt: Any, where: str) -> Prompt:
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request(f"'{where}' is empty", "prompt")
        return Prompt(text=prompt)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return Prompt(token_ids=list(prompt))
    raise bad_request(
        f"'{where}' must be a non-empty string or token id list, got {prompt!r}", "prompt"
    )


def chat_request(
    body: Any, defaults: dict[str, Any] | None = None, tool_call_parser: str = "hermes"
) -> GenerateRequest:
    """``POST /v1/chat/completions``: ``messages`` of ``{"role", "content"}`` (text content,
    or a list of ``{"type": "text", "text"}`` parts)."""
    common = _common(body, ("max_completion_tokens", "max_tokens"), chat=True, defaults=defaults)
    try:
        plan = tool_plan(body, tool_call_parser)
    except ToolError as e:
        raise bad_request(str(e), e.param) from None
    options = chat_options(body)
    if plan is not None:
        options = dataclasses.replace(options, tools=list(plan.tools))
        so = plan.structured_outputs()
        if so is not None:
            if common["params"].structured_outputs is not None:
                raise bad_request(
                    f"'tool_choice'={body.get('tool_choice')!r} constrains the output itself: "
                    "not with another structured output field",
                    "tool_choice",
                )
            common["params"] = dataclasses.replace(common["params"], structured_outputs=so)
    return GenerateRequest(
        messages=_messages(body.get("messages")), chat=options, tools=plan, **common
    )


# ``apply_chat_template``'s own parameters: not template variables (``chat_template_kwargs``)
_TEMPLATE_CALL_ARGS = frozenset(
    {"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "padding", "truncation", "max_length",
     "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


def chat_options(body: dict[str, Any]) -> ChatOptions:
    """vLLM's chat rendering fields: ``add_generation_prompt`` (default true),
    ``continue_final_message``, ``chat_template`` and ``chat_template_kwargs``."""
    generation_prompt = _get(body, "add_generation_prompt", "bool", True)
    continue_final = _get(body, "continue_final_message", "bool", False)
    if generation_prompt and continue_final:
        raise bad_request(
            "'continue_final_message': true needs 'add_generation_prompt': false (the last "
            "message is continued, not answered)", "continue_final_message",
        )  # fmt: skip
    kwargs = _get(body, "chat_template_kwargs", "dict", {})
    clash = sorted(set(kwargs) & _TEMPLATE_CALL_ARGS)
    if clash:
        raise bad_request(
            f"'chat_template_kwargs' may not set {', '.join(clash)} (the request's own "
            "fields)", "chat_template_kwargs",
        )  # fmt: skip
    return ChatOptions(
        add_generation_prompt=generation_prompt,
        continue_final_message=continue_final,
        chat_template=_get(body, "chat_template", "str"),
        template_kwargs=dict(kwargs),
    )


@dataclass(frozen=True)
class TokenizeRequest:
    """``POST /tokenize`` (vLLM's): a completion's ``prompt``, or a chat's ``messages``
    rendered as ``/v1/chat/completions`` renders them (the template, its generation prompt)."""

    model: str | None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True  # ``prompt``: the tokenizer's own (BOS), as a completion
    return_token_strs: bool = False  # each token's string too (``token_strs``)
    chat: ChatOptions | None = None  # ``messages``: vLLM's rendering fields


def tokenize_request(body: Any) -> TokenizeRequest:
    _check_object(body)
    warn_ignored_fields(body, _TOKENIZE_FIELDS)
    model = _get(body, "model", "str")
    strs = _get(body, "return_token_strs", "bool", False)
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise bad_request("give one of 'prompt' (text) or 'messages' (a chat)", "prompt")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise bad_request(f"'prompt' must be a string, got {type(prompt).__name__}", "prompt")
        special = _get(body, "add_special_tokens", "bool", True)
        return TokenizeRequest(model, prompt, add_special_tokens=special, return_token_strs=strs)
    chat = _messages(messages)
    if body.get("add_special_tokens") is not None:
        raise bad_request(
            "'add_special_tokens' applies to 'prompt'; a chat's special tokens are its "
            "template's", "add_special_tokens",
        )  # fmt: skip
    return TokenizeRequest(model, messages=chat, return_token_strs=strs, chat=chat_options(body))


def detokenize_request(body: Any) -> tuple[str | None, list[int]]:
    """``POST /detokenize`` (vLLM's): ``(model, tokens)``."""
    _check_object(body)
    warn_ignored_fields(body, _DETOKENIZE_FIELDS)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_int(t) and t >= 0 for t in tokens):
        raise bad_request("'tokens' must be a list of token ids (integers >= 0)", "tokens")
    return _get(body, "model", "str"), tokens


def _message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise bad_request(f"{where} must be an object with a string 'role'", "messages")
    content = message.get("content")
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_request(f"{where}: only text content parts are supported", "messages")
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{where}: a text part needs a string 'text'", "messages")
            texts.append(part["text"])
        content = "".join(texts)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise bad_request(f"{where}.content must be a string, got {content!r}", "messages")
    out: dict[str, Any] = {"role": message["role"], "content": content}
    for key in ("name", "tool_call_id"):  # a tool's answer names its call
        if message.get(key) is not None:
            if not isinstance(message[key], str):
                raise bad_request(f"{where}.{key} must be a string", "messages")
            out[key] = message[key]
    if message.get("tool_calls") is not None:  # an assistant's calls, for the template
        out["tool_calls"] = _tool_calls(where, message["tool_calls"])
    return out


def _tool_calls(where: str, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, each ``{"id", "type": "function", "function":
    {"name", "arguments"}}``, its ``arguments`` (OpenAI's JSON string) parsed into an object
    as vLLM hands it to chat templates (which iterate over it)."""
    if not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls must be a list", "messages")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(
                f"{where}.tool_calls[{i}] must be {{'function': {{'name', 'arguments'}}}}",
                "messages",
            )
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise bad_request(
                    f"{where}.tool_calls[{i}].function.arguments is not valid JSON: {args!r}",
                    "messages",
                ) from None
        out.append({**call, "function": {**fn, "arguments": args}})
    return out
