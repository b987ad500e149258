"""Requests in: the front door's half that turns what a front end hands over into a checked
request (vLLM V1's ``Processor``): the chat template, the tokenizer, truncation, and every
check a request must pass before it is queued.

``LLMEngine.add_requests`` is the one entry (``LLM.generate``, ``LLM.chat``, the server and
``add_request`` all go through it): it runs ``InputProcessor.process`` on every request of
a call before it adds any, so a bad one refuses the call whole, naming its request
(``RequestInput.where``) and its field (``InputError.param``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sarathi_pp import grammar
from sarathi_pp.checkpoint import Checkpoint
from sarathi_pp.config import ModelConfig
from sarathi_pp.engine.tokenizer import has_tokenizer, load_tokenizer
from sarathi_pp.sampling_params import SamplingParams, SamplingParamsError

# A prompt as the front ends take it (vLLM's): text, token ids, or a dict
# (``{"prompt": text}``, or ``{"prompt_token_ids": [...]}`` with an optional "prompt").
Prompt = str | list[int] | tuple[int, ...] | dict[str, Any]


class InputError(ValueError):
    """A request the front door refuses; ``param`` names its field at fault (``prompt``,
    ``messages``, ``max_tokens``), so a server can name it without reading the message
    (``SamplingParamsError`` does the same for a sampling parameter)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickled as built: args are (message, param)
        return type(self), (str(self), self.param)


@dataclass(frozen=True)
class ChatOptions:
    """How a chat is rendered (vLLM's chat request fields): the generation prompt after the
    last message (default), or the last message continued (``continue_final_message``:
    an assistant's reply prefilled, without the template's end of turn); ``chat_template``:
    a Jinja template instead of the tokenizer's; ``template_kwargs``: extra template
    variables (``chat_template_kwargs``, e.g. ``enable_thinking``)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    # OpenAI's ``tools`` (``[{"type": "function", "function": {...}}]``), for the template
    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class RequestInput:
    """One request as a front end hands it to ``LLMEngine.add_requests``: a ``prompt`` or a
    chat (``messages``, rendered by the tokenizer's chat template with the generation
    prompt), its sampling parameters (``n > 1``: a parent request of ``n`` completions),
    and how an error names it (``where``; default ``request '<id>'``)."""

    request_id: str
    params: Any  # SamplingParams; anything else is a TypeError naming the request
    prompt: Prompt | None = None
    messages: Any = None  # list[{"role", "content"}]; checked by ``render_chat``
    arrival_time: float | None = None  # on the engine's clock (LLMEngine.now()); None: now
    where: str = ""
    # Refuse a request whose prompt and ``max_tokens`` exceed ``max_model_len`` (an
    # ``InputError`` naming ``max_tokens``), as OpenAI's and vLLM's servers do for an
    # explicit ``max_tokens``; otherwise such a request stops at ``max_model_len``.
    max_tokens_must_fit: bool = False
    chat: ChatOptions | None = None  # ``messages``: how to render them (None: the default)
    # A text prompt's special tokens (BOS): None = the default (a prompt yes, a chat no:
    # its template writes its own)
    add_special_tokens: bool | None = None
    # vLLM's ``cache_salt``: the request shares prefix-cache blocks only with requests of
    # the same salt (a tenant's own); a dict prompt may carry it too
    cache_salt: str | None = None

    @property
    def name(self) -> str:
        return self.where or f"request {self.request_id!r}"

    @classmethod
    def one(
        cls,
        request_id: str,
        prompt: str | None,
        params: Any,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
    ) -> RequestInput:
        """vLLM's ``add_request`` arguments as a request: ``prompt_token_ids`` given, those
        tokens with ``prompt`` their text; else ``prompt``, which must be a string."""
        given: Any = prompt
        if prompt_token_ids is not None:
            given = {"prompt_token_ids": prompt_token_ids, "prompt": prompt}
        elif not isinstance(prompt, str):
            raise TypeError(f"request {request_id!r}: prompt must be a string, got {prompt!r}")
        return cls(request_id, params, given, arrival_time=arrival_time)


@dataclass(frozen=True)
class ProcessedRequest:
    """A request that passed every check: its prompt's text (where it has one: the text
    given, or the rendered chat), token ids (truncated as asked), its parameters (bad words
    as token ids) and arrival on the engine's clock."""

    request_id: str
    text: str | None
    token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    cache_salt: str | None = None


class InputProcessor:
    def __init__(self, model: ModelConfig, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint
        self.seed = model.seed
        tok_dir = model.tokenizer or checkpoint.path  # the model folder's by default
        if model.tokenizer is not None and not has_tokenizer(tok_dir):
            raise FileNotFoundError(f"tokenizer folder {tok_dir!r} has no tokenizer files")
        self.tokenizer: Any = load_tokenizer(tok_dir) if has_tokenizer(tok_dir) else None

    def seeded(self, params: SamplingParams, index: int) -> SamplingParams:
        """``params`` with a seed derived from the engine's ``model.seed`` and the request's
        ``index`` (its order of arrival), when it samples and has no seed of its own."""
        if self.seed is None or params.seed is not None or params.is_greedy:
            return params
        # Distinct per request, the same for the same request order on a rerun.
        return dataclasses.replace(params, seed=(self.seed * 1_000_003 + index) % (2**63 - 1))

    def check_params(self, params: SamplingParams, where: str) -> None:
        """``ValueError`` naming ``where`` for token ids the model does not have."""
        vocab = self.checkpoint.spec.vocab_size
        for name, ids in (
            ("logit_bias", list(params.logit_bias)),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("bad_words", [t for w in params.bad_words_token_ids for t in w]),
        ):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise SamplingParamsError(
                    name, f"{where}: {name} has token ids outside [0, {vocab}): {bad[:5]}"
                )
        if params.structured_outputs is not None:  # compiled here, before any work
            try:
                grammar.check(params.structured_outputs)
            except SamplingParamsError as e:
                raise SamplingParamsError(e.param, f"{where}: {e}") from None
        if params.allowed_token_ids is not None:  # what the last stage will rule out
            left = set(params.allowed_token_ids)
            left -= {w[0] for w in params.bad_words_token_ids if len(w) == 1}
            if params.min_tokens:
                left -= {*self.checkpoint.spec.eos_token_ids, *params.stop_token_ids}
            if not left:
                raise SamplingParamsError(
                    "allowed_token_ids",
                    f"{where}: allowed_token_ids leaves no token to sample: each is a bad word"
                    + (
                        " or an EOS or stop token, ruled out by min_tokens"
                        if params.min_tokens
                        else ""
                    ),
                )

    def with_bad_words(self, params: SamplingParams, where: str) -> SamplingParams:
        """``params`` with its ``bad_words`` as token ids (``bad_words_token_ids``), as
        vLLM's ``SamplingParams.update_from_tokenizer``: each word as it would begin the
        text, and after a space where that gives other tokens of the same number."""
        if not params.bad_words:
            return params
        if self.tokenizer is None:
            raise SamplingParamsError(
                "bad_words",
                f"{where}: bad_words needs a tokenizer, and model folder "
                f"{self.checkpoint.path!r} has none (give bad_words_token_ids instead)",
            )
        words: list[tuple[int, ...]] = []
        for word in params.bad_words:
            alone = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            words.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                words.append(spaced)
        every = dict.fromkeys((*params.bad_words_token_ids, *words))  # once each, in order
        return dataclasses.replace(params, bad_words_token_ids=tuple(every))

    def truncated(self, token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt's last ``truncate_prompt_tokens`` tokens (-1: ``max_model_len``);
        the prompt itself when it is not longer, or when ``None``."""
        k = params.truncate_prompt_tokens
        if k is None:
            return token_ids
        k = self.checkpoint.max_model_len if k == -1 else k
        return token_ids[-k:] if len(token_ids) > k else token_ids

    def eos_token_ids(self) -> set[int]:
        """The checkpoint's EOS ids and the tokenizer's."""
        ids = set(self.checkpoint.spec.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def process(
        self,
        request: RequestInput,
        validate: Callable[[list[int], str], None],
        now: float,
    ) -> ProcessedRequest:
        """``request`` checked and made ready to queue, or the error that refuses it
        (``TypeError`` for a value of the wrong type, ``InputError`` or
        ``SamplingParamsError`` naming the field otherwise). ``validate(token_ids, where)``:
        the engine's check that the prompt can run at all (``LLMEngine.validate_prompt``)."""
        where, params = request.name, request.params
        text: str | None
        if not isinstance(params, SamplingParams):
            raise TypeError(f"{where}: params must be SamplingParams, got {type(params).__name__}")
        # The request's own copy, checked as built: the caller's object stays theirs to
        # change (vLLM's SamplingParams is settable), reaching no request already added.
        params = params.clone()
        if request.messages is not None:
            if request.prompt is not None:
                raise InputError(f"{where}: give a prompt or messages, not both", "messages")
            try:
                text, token_ids = self.render_chat(
                    request.messages, request.chat, request.add_special_tokens
                )
            except ValueError as e:
                raise InputError(f"{where}: {e}", "messages") from None
            field = "messages"
        else:
            special = request.add_special_tokens is not False
            text, token_ids = self.prompt_tokens(request.prompt, where, special)
            field = "prompt"
        token_ids = self.truncated(token_ids, params)
        try:
            validate(token_ids, where)
        except ValueError as e:
            raise InputError(str(e), field) from None
        params = self.with_bad_words(params, where)
        self.check_params(params, where)
        max_len = self.checkpoint.max_model_len
        k = params.max_tokens
        if request.max_tokens_must_fit and k is not None and len(token_ids) + k > max_len:
            n = len(token_ids)
            raise InputError(
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {n + k} tokens ({n} in the {where}, {k} in the completion): "
                "reduce max_tokens",
                "max_tokens",
            )
        arrival = arrival_or_now(request.arrival_time, now)  # ValueError: not on our clock
        salt = request.cache_salt
        if isinstance(request.prompt, dict) and "cache_salt" in request.prompt:
            salt = request.prompt["cache_salt"]
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise InputError(f"{where}: cache_salt must be a non-empty string, got {salt!r}",
                             "cache_salt")  # fmt: skip
        return ProcessedRequest(request.request_id, text, token_ids, params, arrival, salt)

    def prompt_tokens(
        self, prompt: Any, where: str, add_special_tokens: bool = True
    ) -> tuple[str | None, list[int]]:
        """A prompt's text (``None`` for token ids alone) and token ids: text is tokenized
        (with the tokenizer's special tokens unless ``add_special_tokens`` is false), token
        ids checked to be integers (``as_token_ids``)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InputError(f"{where} is empty", "prompt")
            try:
                return prompt, self.tokenize(prompt, add_special_tokens)
            except ValueError as e:  # no tokenizer
                raise InputError(f"{where}: {e}", "prompt") from None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                if text is not None and not isinstance(text, str):
                    raise TypeError(f"{where}: 'prompt' must be a string, got {text!r}")
                return text, self._token_ids(prompt["prompt_token_ids"], where)
            if isinstance(prompt.get("prompt"), str):
                return self.prompt_tokens(prompt["prompt"], where, add_special_tokens)
            raise InputError(
                f"{where}: a dict prompt needs 'prompt_token_ids' or 'prompt'", "prompt"
            )
        if isinstance(prompt, (list, tuple)):
            return None, self._token_ids(prompt, where)
        raise TypeError(
            f"{where} must be a string, a token id list or a dict, got {type(prompt).__name__}"
        )

    @staticmethod
    def _token_ids(values: Any, where: str) -> list[int]:
        try:
            return as_token_ids(values, where)
        except ValueError as e:
            raise InputError(str(e), "prompt") from None

    def render_chat(
        self,
        messages: Any,
        options: ChatOptions | None = None,
        add_special_tokens: bool | None = None,
    ) -> tuple[str, list[int]]:
        """One conversation (``[{"role", "content"}, ...]``; an assistant's ``tool_calls``
        and a tool's ``tool_call_id`` are handed to the template as they are) through the
        chat template as ``options`` say (default: the tokenizer's, with the generation
        prompt): its text and token ids. The tokenizer's BOS is added only where the
        template did not write it (``add_special_tokens``: None), or as that says.
        ``ValueError`` for a model without a template."""
        options = options or ChatOptions()
        tok = self.tokenizer
        if tok is None:
            raise ValueError(
                f"model folder {self.checkpoint.path!r} has no tokenizer: chat needs one"
            )
        if not (options.chat_template or getattr(tok, "chat_template", None)):
            raise ValueError(
                f"the tokenizer of {self.checkpoint.path!r} has no chat template "
                "(tokenizer_config.json 'chat_template'): give plain prompts instead"
            )
        if (
            not isinstance(messages, list)
            or not all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
                for m in messages
            )
            or not messages
        ):
            raise ValueError(
                f"a conversation must be a non-empty list of {{'role': str, 'content': str}}, got {messages!r}"
            )
        if options.continue_final_message and messages[-1].get("role") != "assistant":
            raise ValueError(
                "continue_final_message: the last message must be the assistant's to "
                f"continue, got role {messages[-1].get('role')!r}"
            )
        try:
            text = tok.apply_chat_template(
                messages,
                chat_template=options.chat_template,
                tokenize=False,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message,
                **({"tools": options.tools} if options.tools else {}),
                **options.template_kwargs,
            )
        except Exception as e:  # a template refusing these messages (raise_exception)
            raise ValueError(f"the chat template failed on these messages: {e}") from e
        bos = getattr(tok, "bos_token", None)
        special = not (bos and text.startswith(bos))  # the template wrote the BOS itself
        if add_special_tokens is not None:
            special = add_special_tokens
        return text, list(tok.encode(text, add_special_tokens=special))

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(
                f"model folder {self.checkpoint.path!r} has no tokenizer: pass "
                "prompt_token_ids instead, or name a tokenizer folder (model.tokenizer: "
                "tokenizer= in Python, --set model.tokenizer=DIR on the command line)"
            )
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def validate(
        self,
        token_ids: list[int],
        where: str,
        kv_capacity: int,
        max_unchunked: int | None,
        policy: str,
    ) -> None:
        """``ValueError`` naming ``where`` unless the prompt can run at all: integers (see
        ``as_token_ids``) in the vocabulary, within ``max_model_len`` and the KV cache's
        ``kv_capacity`` tokens, and within ``max_unchunked`` tokens when the policy does not
        chunk prompts."""
        token_ids = as_token_ids(token_ids, where)
        if len(token_ids) == 0:
            raise ValueError(f"{where} is empty")
        vocab = self.checkpoint.spec.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{where} has token ids outside [0, {vocab}): {bad[:5]}")
        n, max_len = len(token_ids), self.checkpoint.max_model_len
        if n > max_len:
            raise ValueError(f"{where} has {n} tokens, more than max_model_len={max_len}")
        if n + 1 > kv_capacity:
            raise ValueError(f"{where} has {n} tokens; the whole KV cache holds {kv_capacity}")
        if max_unchunked is not None and n > max_unchunked:
            raise ValueError(
                f"{where} has {n} tokens, more than max_num_batched_tokens={max_unchunked} "
                f"(scheduler {policy!r} does not chunk prompts)"
            )


def as_token_ids(values: Iterable[Any], where: str) -> list[int]:
    """``values`` as a list of plain ``int``: any integer type is accepted (numpy's too, so
    ``np.array([...])`` or its elements can be passed), nothing else. ``ValueError`` naming
    ``where``, the position and the value otherwise: ``True`` is not a token id."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"{where}: token ids must be a list of integers, got {values!r}")
    if isinstance(values, (list, tuple)) and set(map(type, values)) <= {int}:
        return list(values)  # the common case, checked in C (bool's type is not int)
    token_ids = []
    for idx, t in enumerate(values):
        if type(t) is int:  # the common case, without the (slow) ABC check below
            token_ids.append(t)
            continue
        # bool is an Integral; numpy's bool_ is not.
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(
                f"{where}: token id at position {idx} is {t!r} ({type(t).__name__}), not an integer"
            )
        token_ids.append(int(t))
    return token_ids


# How far past the engine's clock an arrival_time may be: clocks read a moment apart.
ARRIVAL_SLACK_S = 1.0


def arrival_or_now(arrival_time: Any, now: float) -> float:
    """A request's arrival on the engine's clock (``time.monotonic()``): ``now`` when
    ``arrival_time`` is None. A finite number not later than ``now`` (+ a second of slack)
    is taken as is (a past arrival counts its wait); ``ValueError`` otherwise, since a
    request that has not arrived yet is never scheduled (a ``time.time()`` value would
    leave ``step()`` returning nothing forever)."""
    if arrival_time is None:
        return now
    clock = "arrival_time is on time.monotonic()'s clock (LLMEngine.now()), not time.time()'s"
    if isinstance(arrival_time, bool) or not isinstance(arrival_time, numbers.Real):
        raise ValueError(f"arrival_time must be a number or None, got {arrival_time!r}; {clock}")
    arrival = float(arrival_time)
    if not math.isfinite(arrival):
        raise ValueError(f"arrival_time must be finite, got {arrival_time!r}; {clock}")
    if arrival > now + ARRIVAL_SLACK_S:
        raise ValueError(
            f"arrival_time={arrival_time!r} is {arrival - now:.3f} s later than the engine's "
            f"clock now ({now:.3f}); {clock}"
        )
    return arrival
