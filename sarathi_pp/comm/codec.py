"""The control plane's messages as plain data: what ranks send each other, with no pickle.

A received message can only ever become one of the values below; nothing in it names a
class or a function to call, so a peer that sends garbage gets an error, never code run.

Wire form: msgpack (ints, floats, strings, lists only; no maps, no extension types) of
``[WIRE_VERSION, value]``, where a value is one of
  - ``None``, a bool, an int (64-bit), a float (float64, exact) or a str;
  - ``["tuple", value, ...]``: a tuple of values (at most ``MAX_DEPTH`` deep);
  - ``[tag, field, ...]``: a record, its fields in declaration order (``_RECORDS``):
    ``microbatch`` (``MicroBatch``; its chunks are ``ScheduledChunk`` records with an
    optional ``SamplingParams`` record), ``microbatch_result`` (``MicroBatchResult``: ``sampled``,
    ``errors``, ``logprobs`` (``TokenLogprobs`` records) and ``prompt_logprobs``
    (``PromptChunkLogprobs`` records of ``TokenLogprobs``) as ``[[seq_id, value], ...]``,
    ``events`` as ``StageEvent`` records, ``failure`` a str or ``None``),
    ``stage_event`` (``StageEvent``, with an optional ``AttentionReport`` record) and
    ``stage_memory`` (``StageMemory``).
Lists of token ids and block ids are plain msgpack arrays of ints.

Decoding checks every field's type (``bool`` is not an int here) and the record's own
``__post_init__`` (``SamplingParams`` validation, ``MicroBatch``'s prefill-first layout);
any failure is a ``CodecError`` whose message gives the path (``microbatch.chunks[3].
token_ids``). Sizes are the caller's business (``ObjectChannel`` refuses a length header
above its maximum before it allocates anything); msgpack itself never allocates more than
the buffer it is given suggests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack

from sarathi_pp.microbatch import (
    AttentionReport,
    MicroBatch,
    MicroBatchResult,
    PromptChunkLogprobs,
    ScheduledChunk,
    StageEvent,
    TokenLogprobs,
)
from sarathi_pp.sampling_params import SamplingParams, StructuredOutputsParams
from sarathi_pp.stage_memory import StageMemory

# 2: prompt log-probabilities (chunk targets, step results); 3: M_A; 4: allowed_token_ids,
# bad_words, truncate_prompt_tokens; 5: "step_result" renamed "microbatch_result"; 6: a
# stage event's attention report
WIRE_VERSION = 6
MAX_DEPTH = 8  # tuples inside tuples; the deepest real message is 2: ("ok", .., (result, event))


class CodecError(ValueError):
    """A value cannot be encoded, or bytes are not a message of this wire version. ``path``
    says where in the value (``microbatch.chunks[3].token_ids``)."""

    def __init__(self, problem: str, path: str = "") -> None:
        self.problem = problem
        self.path = path
        super().__init__(f"{path}: {problem}" if path else problem)

    def within(self, segment: str) -> CodecError:
        """The same error one level up (``segment`` is ``name``, ``.name`` or ``[i]``)."""
        return CodecError(self.problem, segment + self.path)


# --- field kinds: (to_plain, from_plain), the same check both ways ------------------------------
Convert = Callable[[Any], Any]
Kind = tuple[Convert, Convert]


def _type_name(v: Any) -> str:
    return "None" if v is None else type(v).__name__


def _scalar(*types: type) -> Kind:
    names = " or ".join(t.__name__ for t in types)

    def check(v: Any) -> Any:
        if type(v) not in types:  # exact: a bool is no int, a numpy int no int
            raise CodecError(f"expected {names}, got {_type_name(v)}")
        return v

    return check, check


INT, STR, BOOL = _scalar(int), _scalar(str), _scalar(bool)
FLOAT = _scalar(float, int)  # a user's temperature=0 stays the int 0 it was


def _optional(kind: Kind) -> Kind:
    to, back = kind
    return (lambda v: None if v is None else to(v)), (lambda v: None if v is None else back(v))


def _sequence(item: type, container: type[Any]) -> Kind:
    """A tuple (or list) of one scalar type <-> a list."""

    def check(v: Any, want: type[Any]) -> list:
        if type(v) is not want:
            raise CodecError(f"expected a {want.__name__} of {item.__name__}, got {_type_name(v)}")
        if not set(map(type, v)) <= {item}:  # one C pass: fast on long block tables
            bad = next(x for x in v if type(x) is not item)
            raise CodecError(f"expected {item.__name__} items, got {_type_name(bad)}")
        return v

    return (lambda v: list(check(v, container))), (lambda v: container(check(v, list)))


INTS, STRS, FLOATS = _sequence(int, tuple), _sequence(str, tuple), _sequence(float, tuple)


def _tuple_of(kind: Kind) -> Kind:
    """A tuple of values of ``kind`` <-> a list of theirs."""
    to, back = kind

    def check(v: Any, want: type) -> Any:
        if type(v) is not want:
            raise CodecError(f"expected a {want.__name__}, got {_type_name(v)}")
        return v

    return (
        lambda v: [_at(f"[{i}]", to, x) for i, x in enumerate(check(v, tuple))],
        lambda v: tuple(_at(f"[{i}]", back, x) for i, x in enumerate(check(v, list))),
    )


def _pairs(key: Kind, value: Kind) -> Kind:
    """A dict <-> ``[[key, value], ...]`` (msgpack maps would allow only string keys)."""

    def to(v: Any) -> list:
        if type(v) is not dict:
            raise CodecError(f"expected a dict, got {_type_name(v)}")
        return [[_at(f"[{k!r}]", key[0], k), _at(f"[{k!r}]", value[0], x)] for k, x in v.items()]

    def back(v: Any) -> dict:
        if type(v) is not list:
            raise CodecError(f"expected a list of pairs, got {_type_name(v)}")
        out = {}
        for i, pair in enumerate(v):
            if type(pair) is not list or len(pair) != 2:
                raise CodecError(f"expected a [key, value] pair, got {_type_name(pair)}", f"[{i}]")
            k = _at(f"[{i}]", key[1], pair[0])
            out[k] = _at(f"[{k!r}]", value[1], pair[1])
        return out

    return to, back


def _bias() -> Kind:
    """``SamplingParams.logit_bias``: ``{token id: bias}`` <-> ``[[id, bias], ...]``."""

    def to(v: Any) -> list:
        if type(v) is not dict:
            raise CodecError(f"expected a dict of token id -> bias, got {_type_name(v)}")
        return [
            [_at(f"[{i}]", INT[0], t), _at(f"[{i}]", FLOAT[0], b)]
            for i, (t, b) in enumerate(v.items())
        ]

    def back(v: Any) -> dict:
        if type(v) is not list or not all(type(p) is list and len(p) == 2 for p in v):
            raise CodecError(f"expected a list of [id, bias] pairs, got {_type_name(v)}")
        return {_at(f"[{i}]", INT[1], t): _at(f"[{i}]", FLOAT[1], b) for i, (t, b) in enumerate(v)}

    return to, back


def _record(cls: type) -> Kind:
    return (lambda v: _fields_to_plain(cls, v)), (lambda v: _fields_from_plain(cls, v))


def _records(cls: type, container: type[Any]) -> Kind:
    """A tuple (or list) of records <-> a list of their field lists."""
    item_to, item_back = _record(cls)

    def to(v: Any) -> list:
        if type(v) is not container:
            raise CodecError(f"expected a {container.__name__}, got {_type_name(v)}")
        return [_at(f"[{i}]", item_to, x) for i, x in enumerate(v)]

    def back(v: Any) -> Any:
        if type(v) is not list:
            raise CodecError(f"expected a list, got {_type_name(v)}")
        return container(_at(f"[{i}]", item_back, x) for i, x in enumerate(v))

    return to, back


def _at(segment: str, convert: Convert, v: Any) -> Any:
    try:
        return convert(v)
    except CodecError as e:
        raise e.within(segment) from None


# --- the records: tag and fields, in declaration order (a test checks them against the classes) --
_RECORDS: dict[type, tuple[str, dict[str, Kind]]] = {
    StructuredOutputsParams: (
        "structured_outputs",
        {
            "json": _optional(STR),
            "regex": _optional(STR),
            "choice": _optional(STRS),
            "grammar": _optional(STR),
            "json_object": BOOL,
            "disable_any_whitespace": BOOL,
        },
    ),
    SamplingParams: (
        "sampling_params",
        {
            "n": INT,
            "temperature": FLOAT,
            "top_p": FLOAT,
            "top_k": INT,
            "seed": _optional(INT),
            "max_tokens": _optional(INT),
            "stop": STRS,
            "stop_token_ids": INTS,
            "ignore_eos": BOOL,
            "logprobs": _optional(INT),
            "use_beam_search": BOOL,
            "min_p": FLOAT,
            "include_stop_str_in_output": BOOL,
            "skip_special_tokens": BOOL,
            "spaces_between_special_tokens": BOOL,
            "presence_penalty": FLOAT,
            "frequency_penalty": FLOAT,
            "repetition_penalty": FLOAT,
            "min_tokens": INT,
            "logit_bias": _bias(),
            "prompt_logprobs": _optional(INT),
            "allowed_token_ids": _optional(INTS),
            "bad_words": STRS,
            "truncate_prompt_tokens": _optional(INT),
            "bad_words_token_ids": _tuple_of(INTS),
            "structured_outputs": _optional(_record(StructuredOutputsParams)),
        },
    ),
    ScheduledChunk: (
        "chunk",
        {
            "seq_id": INT,
            "start": INT,
            "token_ids": INTS,
            "is_prefill": BOOL,
            "block_table": INTS,
            "sampling_params": _optional(_record(SamplingParams)),
            "num_output_tokens": INT,
            "ring_from": INT,
            "history": INTS,
            "prompt_targets": INTS,
            "prompt_logprobs": INT,
        },
    ),
    MicroBatch: (
        "microbatch",
        {"microbatch_id": INT, "chunks": _records(ScheduledChunk, tuple), "released": INTS},
    ),
    AttentionReport: ("attention_report", {"backend": STR, "fallbacks": STRS}),
    StageEvent: (
        "stage_event",
        {
            "stage": INT,
            "mb": INT,
            "kind": STR,
            "num_prefill_tokens": INT,
            "num_decode_tokens": INT,
            "wait_start": FLOAT,
            "input_ready": FLOAT,
            "compute_start": FLOAT,
            "compute_end": FLOAT,
            "send_end": FLOAT,
            "attention": _optional(_record(AttentionReport)),
        },
    ),
    TokenLogprobs: (
        "token_logprobs",
        {"logprob": FLOAT, "rank": INT, "top_ids": INTS, "top_logprobs": FLOATS},
    ),
    PromptChunkLogprobs: (
        "prompt_logprobs",
        {"first": INT, "tokens": _records(TokenLogprobs, tuple)},
    ),
    MicroBatchResult: (
        "microbatch_result",
        {
            "sampled": _pairs(INT, INT),
            "errors": _pairs(INT, STR),
            "events": _records(StageEvent, list),
            "failure": _optional(STR),
            "logprobs": _pairs(INT, _record(TokenLogprobs)),
            "prompt_logprobs": _pairs(INT, _record(PromptChunkLogprobs)),
            "num_grammar_masks": INT,
            "grammar_mask_s": FLOAT,
        },
    ),
    StageMemory: (
        "stage_memory",
        {
            "stage_idx": INT,
            "param_bytes": INT,
            "kv_bytes_per_token": INT,
            "memory_bytes": INT,
            "activation_bytes": INT,
        },
    ),
}
_BY_TAG = {tag: cls for cls, (tag, _) in _RECORDS.items()}
_TOP_LEVEL = ("microbatch", "microbatch_result", "stage_event", "stage_memory")  # tagged values


def _fields_to_plain(cls: type, v: Any) -> list:
    fields = _RECORDS[cls][1]
    if type(v) is not cls:
        raise CodecError(f"expected a {cls.__name__}, got {_type_name(v)}")
    return [_at(f".{name}", to, getattr(v, name)) for name, (to, _) in fields.items()]


def _fields_from_plain(cls: type, v: Any) -> Any:
    fields = _RECORDS[cls][1]
    if type(v) is not list or len(v) != len(fields):
        got = f"{len(v)} fields" if type(v) is list else _type_name(v)
        raise CodecError(f"expected the {len(fields)} fields of a {cls.__name__}, got {got}")
    kwargs = {name: _at(f".{name}", back, x) for (name, (_, back)), x in zip(fields.items(), v)}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError, AssertionError) as e:  # the value's own checks
        raise CodecError(f"not a valid {cls.__name__}: {e}") from None


# --- values ------------------------------------------------------------------------------------------
def _to_value(v: Any, depth: int = 0) -> Any:
    if v is None or type(v) in (bool, int, float, str):
        return v
    if type(v) is tuple:
        if depth >= MAX_DEPTH:
            raise CodecError(f"tuples nested deeper than {MAX_DEPTH}")
        return [
            "tuple",
            *(_at(f"[{i}]", lambda x: _to_value(x, depth + 1), x) for i, x in enumerate(v)),
        ]
    tag = _RECORDS[type(v)][0] if type(v) in _RECORDS else None
    if tag in _TOP_LEVEL:
        return [tag, *_at(tag, lambda x: _fields_to_plain(type(v), x), v)]
    raise CodecError(f"values of type {_type_name(v)} cannot travel between ranks")


def _from_value(v: Any, depth: int = 0) -> Any:
    if v is None or type(v) in (bool, int, float, str):
        return v
    if type(v) is not list or not v or type(v[0]) is not str:
        raise CodecError(f"expected a value, got {_type_name(v)}")
    tag, body = v[0], v[1:]
    if tag == "tuple":
        if depth >= MAX_DEPTH:
            raise CodecError(f"tuples nested deeper than {MAX_DEPTH}")
        return tuple(
            _at(f"[{i}]", lambda x: _from_value(x, depth + 1), x) for i, x in enumerate(body)
        )
    if tag not in _TOP_LEVEL:
        raise CodecError(f"unknown tag {tag[:40]!r}; known: tuple, {', '.join(_TOP_LEVEL)}")
    return _at(tag, lambda x: _fields_from_plain(_BY_TAG[tag], x), body)


def encode(value: Any) -> bytes:
    """``value`` (a message: see the module docstring) as bytes; ``CodecError`` naming the
    part that cannot travel."""
    plain = [WIRE_VERSION, _to_value(value)]
    try:
        return msgpack.packb(plain, use_bin_type=True)
    except (OverflowError, TypeError, ValueError) as e:  # e.g. an int beyond 64 bits
        raise CodecError(f"cannot encode: {e}") from None


def decode(data: bytes) -> Any:
    """The message in ``data``; ``CodecError`` when it is not one."""
    try:
        plain = msgpack.unpackb(data, use_list=True, raw=False, strict_map_key=True)
    except Exception as e:  # noqa: BLE001 - msgpack raises several kinds (ExtraData, FormatError, ...)
        detail = f": {e}" if str(e) else ""
        raise CodecError(f"not msgpack ({type(e).__name__}{detail})") from None
    if type(plain) is not list or len(plain) != 2 or type(plain[0]) is not int:
        raise CodecError(f"expected [wire version, value], got {_type_name(plain)}")
    if plain[0] != WIRE_VERSION:
        raise CodecError(
            f"wire version {plain[0]}, this rank speaks {WIRE_VERSION}: are all ranks running "
            "the same sarathi-pp?"
        )
    return _from_value(plain[1])


def record_fields(cls: type) -> list[str]:
    """The field names the codec sends for ``cls``, in order (for tests)."""
    return list(_RECORDS[cls][1])
