"""Per-request sampling parameters, in vLLM's shape and with vLLM's defaults."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20  # vLLM's default ``max_logprobs``: most likely tokens per output token


class SamplingParamsError(ValueError):
    """A bad sampling parameter: ``param`` names the field (as ``SamplingParams`` spells
    it), so a CLI can name its flag and a server the request's field without reading the
    message."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickled as built (Ray, multiprocessing): args are (param, message)
        return type(self), (self.param, str(self))


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Output constrained to a grammar (vLLM's ``StructuredOutputsParams``): exactly one of
    ``json`` (a JSON schema, as a dict or its text), ``regex``, ``choice`` (the output is
    one of these strings), ``grammar`` (Lark or GBNF/EBNF, as llguidance reads them) or
    ``json_object`` (any JSON object: OpenAI's ``response_format`` ``json_object``).

    Checked here for shape (``SamplingParamsError`` naming ``structured_outputs``); whether
    the grammar engine can compile it is checked when the engine takes the request
    (``sarathi_pp/grammar.py``), before any work. ``json`` is kept as its text (keys in the
    schema's order: the order a model writes properties in), so the value is hashable and
    the last stage caches one compiled grammar per schema."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    # vLLM's: JSON without whitespace between its tokens (the default lets the model
    # write any, as vLLM's; a random or small model may fill its tokens with it)
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        name = "structured_outputs"
        if self.json is not None:
            set_("json", _json_text(self.json))
        if self.choice is not None:
            choice = () if isinstance(self.choice, str) else _as_tuple(name, self.choice)
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise SamplingParamsError(
                    name,
                    f"structured_outputs.choice must be non-empty strings, got {self.choice!r}",
                )
            set_("choice", choice)
        for field_name in ("regex", "grammar"):
            value = getattr(self, field_name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SamplingParamsError(
                    name,
                    f"structured_outputs.{field_name} must be a non-empty string, got {value!r}",
                )
        for flag in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, flag), bool):
                raise SamplingParamsError(
                    name,
                    f"structured_outputs.{flag} must be True or False, got {getattr(self, flag)!r}",
                )
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise SamplingParamsError(
                name,
                "structured_outputs takes exactly one of json, regex, choice, grammar, "
                f"json_object; got {given or 'none'}",
            )

    @property
    def kind(self) -> str:
        """Which constraint: ``json``, ``regex``, ``choice``, ``grammar`` or ``json_object``."""
        for k in ("json", "regex", "choice", "grammar"):
            if getattr(self, k) is not None:
                return k
        return "json_object"

    def __repr__(self) -> str:
        value = getattr(self, self.kind)
        text = str(value)
        return (
            f"StructuredOutputsParams({self.kind}={text[:60]!r}{'...' if len(text) > 60 else ''})"
        )


def _json_text(schema: Any) -> str:
    """A JSON schema as compact text, its keys in their order; ``SamplingParamsError`` for
    one that is not a JSON object."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise SamplingParamsError(
                "structured_outputs", f"structured_outputs.json is not valid JSON: {e}"
            ) from None
    if not isinstance(schema, dict):
        raise SamplingParamsError(
            "structured_outputs",
            f"structured_outputs.json must be a JSON schema (an object), got {schema!r}",
        )
    try:
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise SamplingParamsError(
            "structured_outputs", f"structured_outputs.json is not JSON-serializable: {e}"
        ) from None


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, per request.

    Defaults follow vLLM: ``temperature=1.0``, ``top_p=1.0``, ``top_k=0`` (off; ``-1`` is
    accepted as "off" too), ``min_p=0.0`` (off), ``max_tokens=16`` (``None``: the rest of the context,
    ``max_model_len`` less the prompt). ``temperature=0`` means greedy. The penalties are vLLM's (and OpenAI's): ``presence_penalty`` and
    ``frequency_penalty`` (-2 to 2) lower the logits of tokens already generated, once or
    per occurrence; ``repetition_penalty`` (> 0, 1 = off) divides the positive logits of
    every token of the prompt and the output (multiplies the negative), as Hugging Face's.
    ``n``: completions per prompt (``engine/parallel_sampling.py``); ``logprobs``:
    the log-probabilities of each sampled token and of the ``logprobs`` most likely;
    ``prompt_logprobs``: the same for every prompt token after the first
    (``RequestOutput.prompt_logprobs``), from the raw logits as ``logprobs``.
    ``allowed_token_ids``, ``bad_words`` and ``truncate_prompt_tokens`` are vLLM's: the
    first two rule tokens out before sampling (not from the reported log-probabilities,
    which stay the raw logits'); the last cuts the prompt from the left before it is
    checked against ``max_model_len``. ``structured_outputs`` (vLLM's) constrains the
    output to a JSON schema, a regex, a choice or a grammar
    (``StructuredOutputsParams``; a dict of its fields is accepted): a token mask applied
    on the last stage before sampling, greedy or random.

    Checked at construction (``SamplingParamsError``, a ``ValueError``, naming the field and
    the value, the field also in its ``param``): integer fields take any integer type
    (numpy's included; stored as ``int``) but not ``True``/``False`` or floats such as
    ``3.0``; ``temperature`` and ``top_p`` must be finite real numbers.

    Settable, as vLLM's (``params.temperature = 0.5``): a field set later is checked when
    the params are used. The engine takes its own copy of them when a request is added
    (``clone``: built again, so checked again), so a change made afterwards reaches no
    request already added, none of its ``n > 1`` completions and no recomputation.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    use_beam_search: bool = False
    min_p: float = 0.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: a slow tokenizer's decode puts spaces between special tokens (a fast
    # tokenizer's decoder joins tokens as trained and takes no such option, as in vLLM)
    spaces_between_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    # token id -> a number added to its logit (-100..100, OpenAI's); (id, bias) pairs are
    # accepted too; kept as a dict sorted by token id
    logit_bias: dict[int, float] = field(default_factory=dict)
    # The log-probability of every prompt token after the first (given those before it) and
    # of the ``prompt_logprobs`` most likely tokens at each position (vLLM's; ``None``: off)
    prompt_logprobs: int | None = None
    # vLLM's: only these token ids may be sampled (``None``: any; never empty)
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's: words never generated: the last token of a word's tokens is ruled out where
    # the output so far ends with the tokens before it (each word tokenized as it would
    # start the text and after a space; ``bad_words_token_ids``, set by the engine)
    bad_words: tuple[str, ...] = field(default_factory=tuple)
    # vLLM's: only the last k tokens of the prompt are used (left truncation; -1: the last
    # max_model_len; ``None``: the whole prompt)
    truncate_prompt_tokens: int | None = None
    # ``bad_words`` as token ids (the engine tokenizes them: ``InputProcessor.with_bad_words``)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default_factory=tuple, repr=False)
    # vLLM's: the output follows a JSON schema, regex, choice or grammar (None: free)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # Normalise to plain Python types (numpy scalars would otherwise travel to the
        # stages and into the outputs) and fresh containers (a caller's list or dict is
        # never shared).
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        for name in ("n", "top_k", "min_tokens"):
            set_(name, _as_int(name, getattr(self, name)))
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens"):
            value = getattr(self, name)
            set_(name, None if value is None else _as_int(name, value, "an integer or None"))
        for name in (
            "temperature", "top_p", "min_p",
            "presence_penalty", "frequency_penalty", "repetition_penalty",
        ):  # fmt: skip
            set_(name, _as_finite(name, getattr(self, name)))
        for name in (
            "ignore_eos",
            "use_beam_search",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        ):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(
                    name, f"{name} must be True or False, got {getattr(self, name)!r}"
                )
        set_("stop", (self.stop,) if isinstance(self.stop, str) else _as_tuple("stop", self.stop))
        ids = _as_tuple("stop_token_ids", self.stop_token_ids)
        set_(
            "stop_token_ids",
            tuple(_as_int("stop_token_ids", t, "non-negative integers") for t in ids),
        )
        set_("logit_bias", _as_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            allowed = _as_tuple("allowed_token_ids", self.allowed_token_ids)
            set_(
                "allowed_token_ids",
                tuple(_as_int("allowed_token_ids", t, "non-negative integers") for t in allowed),
            )
        words = self.bad_words
        set_("bad_words", (words,) if isinstance(words, str) else _as_tuple("bad_words", words))
        set_(
            "bad_words_token_ids",
            tuple(
                tuple(_as_int("bad_words", t, "token ids") for t in _as_tuple("bad_words", w))
                for w in _as_tuple("bad_words", self.bad_words_token_ids)
            ),
        )
        if isinstance(self.structured_outputs, dict):
            try:
                set_("structured_outputs", StructuredOutputsParams(**self.structured_outputs))
            except TypeError as e:
                raise SamplingParamsError(
                    "structured_outputs", f"structured_outputs: {e}"
                ) from None
        elif self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise SamplingParamsError(
                "structured_outputs",
                "structured_outputs must be a StructuredOutputsParams, a dict of its fields or "
                f"None, got {self.structured_outputs!r}",
            )
        if self.top_k == -1:
            set_("top_k", 0)
        self._validate()

    def _validate(self) -> None:
        if self.n < 1:
            raise SamplingParamsError("n", f"n must be an integer >= 1, got {self.n!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise SamplingParamsError(
                "logprobs",
                f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise SamplingParamsError(
                "prompt_logprobs",
                f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}], "
                f"got {self.prompt_logprobs!r}",
            )
        if self.use_beam_search:
            raise SamplingParamsError("use_beam_search", "beam search is not supported")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise SamplingParamsError("seed", f"seed must be a 64-bit integer, got {self.seed}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise SamplingParamsError(
                "max_tokens",
                f"max_tokens must be None or an integer >= 1, got {self.max_tokens!r}",
            )
        if self.min_tokens < 0 or (
            self.max_tokens is not None and self.min_tokens > self.max_tokens
        ):
            raise SamplingParamsError(
                "min_tokens",
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
            )
        if self.temperature < 0:
            raise SamplingParamsError(
                "temperature", f"temperature must be >= 0, got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingParamsError(
                    name, f"{name} must be in [-2, 2], got {getattr(self, name)}"
                )
        if self.repetition_penalty <= 0:
            raise SamplingParamsError(
                "repetition_penalty",
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            )
        if self.top_k < 0:
            raise SamplingParamsError(
                "top_k", f"top_k must be 0 or -1 (off) or a positive integer, got {self.top_k!r}"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise SamplingParamsError(
                    "stop", f"stop strings must be non-empty strings, got {s!r}"
                )
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise SamplingParamsError(
                    "allowed_token_ids", "allowed_token_ids must be None or a non-empty list"
                )
            negative = [t for t in self.allowed_token_ids if t < 0]
            if negative:
                raise SamplingParamsError(
                    "allowed_token_ids",
                    f"allowed_token_ids must be non-negative integers, got {negative[0]!r}",
                )
        for w in self.bad_words:
            if not isinstance(w, str) or not w.strip():
                raise SamplingParamsError(
                    "bad_words", f"bad_words must be non-blank strings, got {w!r}"
                )
        for ids in self.bad_words_token_ids:
            if not ids or min(ids) < 0:
                raise SamplingParamsError(
                    "bad_words",
                    f"bad_words_token_ids must be non-empty lists of token ids >= 0, got {ids!r}",
                )
        if self.truncate_prompt_tokens is not None and (
            self.truncate_prompt_tokens == 0 or self.truncate_prompt_tokens < -1
        ):
            raise SamplingParamsError(
                "truncate_prompt_tokens",
                "truncate_prompt_tokens must be None, -1 (max_model_len) or an integer >= 1, "
                f"got {self.truncate_prompt_tokens}",
            )
        for t in self.stop_token_ids:
            if t < 0:
                raise SamplingParamsError(
                    "stop_token_ids", f"stop_token_ids must be non-negative integers, got {t!r}"
                )

    def clone(self) -> SamplingParams:
        """A copy built again from these fields (vLLM's ``clone``): normalised and checked
        as at construction, so a field set to a bad value since is refused here, naming
        it."""
        return dataclasses.replace(self)

    @property
    def has_penalties(self) -> bool:
        """Whether the last stage must know the sequence's tokens to sample it."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def keeps_tokens(self) -> bool:
        """Whether the last stage keeps the sequence's tokens (``stages/worker/penalties.py``):
        for the penalties, for a bad word of more than one token (its prefix is matched
        against the output) and for structured output (its grammar matcher is rebuilt from
        the output after a recompute)."""
        return (
            self.has_penalties
            or any(len(w) > 1 for w in self.bad_words_token_ids)
            or self.structured_outputs is not None
        )

    @property
    def is_greedy(self) -> bool:
        # As vLLM: a temperature this small is greedy (dividing by it would overflow).
        return self.temperature < SAMPLING_EPS


def _as_int(name: str, value: Any, what: str = "an integer") -> int:
    """``value`` as ``int``: any integer type (numpy's too), never a bool or a float."""
    # bool is an Integral, but True as a token count or a seed is always a mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SamplingParamsError(
            name, f"{name} must be {what}, got {value!r} ({type(value).__name__})"
        )
    return int(value)


def _as_finite(name: str, value: Any) -> float:
    """``value`` as ``float``: a finite real number (NaN would sample uniformly at random)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SamplingParamsError(
            name, f"{name} must be a real number, got {value!r} ({type(value).__name__})"
        )
    if not math.isfinite(value):
        raise SamplingParamsError(name, f"{name} must be finite, got {value!r}")
    return float(value)


def _as_tuple(name: str, value: Any) -> tuple:
    if value is None:
        return ()
    try:
        return tuple(value)
    except TypeError:
        raise SamplingParamsError(name, f"{name} must be a list, got {value!r}") from None


def _as_bias(value: Any) -> dict[int, float]:
    """``logit_bias`` as a dict sorted by token id, from a dict or ``(id, bias)`` pairs."""
    if isinstance(value, dict):
        value = value.items()
    pairs: dict[int, float] = {}
    for item in _as_tuple("logit_bias", value):
        try:
            token, bias = item
        except (TypeError, ValueError):
            raise SamplingParamsError(
                "logit_bias", f"logit_bias must map token ids to numbers, got {item!r}"
            ) from None
        token = _as_int("logit_bias", token, "a map from token ids (non-negative integers)")
        bias = _as_finite("logit_bias", bias)
        if token < 0 or not -100.0 <= bias <= 100.0:
            raise SamplingParamsError(
                "logit_bias",
                f"logit_bias must map token ids >= 0 to biases in [-100, 100], got {token}: {bias}",
            )
        pairs[token] = bias
    return dict(sorted(pairs.items()))
