"""The control plane's codec (``sarathi_pp/comm/codec.py``): every message type survives
encode -> decode unchanged (hypothesis: random values of each type), the codec sends every
field of each value type, and bytes that are not a message fail with a ``CodecError``
saying where, never with anything else (and never run anything: there is no pickle)."""

from __future__ import annotations

import dataclasses
import math
import pickle

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sarathi_pp.comm.codec import MAX_DEPTH, WIRE_VERSION, CodecError, decode, encode, record_fields
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

INT64 = st.integers(-(2**63), 2**63 - 1)
IDS = st.integers(0, 2**31 - 1)
TIMES = st.floats(allow_nan=False)  # NaN != NaN; NaN itself is checked below
TEXT = st.text(max_size=20)

sampling_params = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0), st.floats(0, 5)),
    top_p=st.floats(0.01, 1.0),
    top_k=st.integers(0, 100),
    seed=st.one_of(st.none(), INT64),
    max_tokens=st.integers(1, 4096),
    stop=st.lists(st.text(min_size=1, max_size=8), max_size=3).map(tuple),
    stop_token_ids=st.lists(IDS, max_size=3).map(tuple),
    ignore_eos=st.booleans(),
    n=st.integers(1, 8),
    logprobs=st.one_of(st.none(), st.integers(0, 20)),
    min_p=st.floats(0.0, 1.0),
    include_stop_str_in_output=st.booleans(),
    skip_special_tokens=st.booleans(),
    presence_penalty=st.floats(-2.0, 2.0),
    frequency_penalty=st.floats(-2.0, 2.0),
    repetition_penalty=st.floats(0.01, 10.0),
    min_tokens=st.integers(0, 1),
    logit_bias=st.dictionaries(IDS, st.floats(-100.0, 100.0), max_size=3),
    prompt_logprobs=st.one_of(st.none(), st.integers(0, 20)),
    allowed_token_ids=st.one_of(st.none(), st.lists(IDS, min_size=1, max_size=3)),
    bad_words=st.lists(st.text(min_size=1, max_size=8).filter(str.strip), max_size=2),
    truncate_prompt_tokens=st.one_of(st.none(), st.just(-1), st.integers(1, 4096)),
    bad_words_token_ids=st.lists(st.lists(IDS, min_size=1, max_size=3), max_size=2),
    structured_outputs=st.one_of(
        st.none(),
        st.builds(StructuredOutputsParams, regex=st.text(min_size=1, max_size=8)),
        st.builds(
            StructuredOutputsParams,
            json=st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
            disable_any_whitespace=st.booleans(),
        ),
        st.builds(
            StructuredOutputsParams, choice=st.lists(TEXT.filter(bool), min_size=1, max_size=3)
        ),
        st.builds(StructuredOutputsParams, json_object=st.just(True)),
    ),
)


def chunks(is_prefill: bool) -> st.SearchStrategy[ScheduledChunk]:
    return st.builds(
        ScheduledChunk,
        seq_id=IDS,
        start=IDS,
        token_ids=st.lists(IDS, min_size=1, max_size=40).map(tuple),
        is_prefill=st.just(is_prefill),
        block_table=st.lists(IDS, max_size=40).map(tuple),
        sampling_params=st.one_of(st.none(), sampling_params),
        num_output_tokens=st.integers(0, 4096),
        history=st.lists(IDS, max_size=20).map(tuple),
        prompt_targets=st.lists(IDS, max_size=20).map(tuple) if is_prefill else st.just(()),
        prompt_logprobs=st.integers(0, 20),
    )


microbatches = st.builds(
    lambda mb_id, prefills, decodes, released: MicroBatch(
        mb_id, tuple(prefills + decodes), tuple(released)
    ),
    IDS,
    st.lists(chunks(True), max_size=3),
    st.lists(chunks(False), max_size=5),
    st.lists(IDS, max_size=4),
)
stage_events = st.builds(
    StageEvent,
    stage=st.integers(0, 63),
    mb=IDS,
    kind=st.sampled_from(["prefill", "decode", "hybrid"]),
    num_prefill_tokens=IDS,
    num_decode_tokens=IDS,
    wait_start=TIMES,
    input_ready=TIMES,
    compute_start=TIMES,
    compute_end=TIMES,
    send_end=TIMES,
    attention=st.none()
    | st.builds(
        AttentionReport,
        backend=st.sampled_from(["torch", "cpu_paged", "flex_paged", "flash_attn"]),
        fallbacks=st.lists(st.text(max_size=40), max_size=3).map(tuple),
    ),
)
LOGPROBS = st.floats(max_value=0.0, allow_nan=False)
token_logprobs = st.integers(0, 5).flatmap(
    lambda k: st.builds(
        TokenLogprobs,
        logprob=LOGPROBS,
        rank=st.integers(1, 2**31 - 1),
        top_ids=st.lists(IDS, min_size=k, max_size=k).map(tuple),
        top_logprobs=st.lists(LOGPROBS, min_size=k, max_size=k).map(tuple),
    )
)
prompt_chunk_logprobs = st.builds(
    PromptChunkLogprobs,
    first=st.integers(1, 2**31 - 1),
    tokens=st.lists(token_logprobs, max_size=6).map(tuple),
)
microbatch_results = st.builds(
    MicroBatchResult,
    prompt_logprobs=st.dictionaries(IDS, prompt_chunk_logprobs, max_size=3),
    sampled=st.dictionaries(IDS, IDS, max_size=8),
    logprobs=st.dictionaries(IDS, token_logprobs, max_size=4),
    errors=st.dictionaries(IDS, TEXT, max_size=3),
    events=st.lists(stage_events, max_size=3),
    failure=st.one_of(st.none(), TEXT),
)
stage_memories = st.builds(StageMemory, IDS, INT64, INT64, INT64, INT64)
# Everything that travels on torchrun's control plane, in the shapes it travels in.
messages = st.one_of(
    st.none(),  # the stop signal
    microbatches,
    stage_events,
    stage_memories,
    st.tuples(IDS, IDS),  # (num_blocks, block_size)
    st.tuples(st.just("ok"), IDS, IDS, st.tuples(microbatch_results, stage_events)),
    st.tuples(st.just("error"), IDS, IDS, TEXT),
)


@settings(max_examples=300, deadline=None)
@given(messages)
def test_every_message_round_trips(message):
    assert decode(encode(message)) == message


@pytest.mark.parametrize(
    "strategy", [microbatches, microbatch_results, stage_events, stage_memories]
)
@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_each_type_round_trips_with_its_types(strategy, data):
    value = data.draw(strategy)
    back = decode(encode(value))
    assert back == value and type(back) is type(value)
    if isinstance(value, MicroBatch):  # tuples stay tuples (the values are hashable, frozen)
        assert all(type(c.token_ids) is tuple and type(c.block_table) is tuple for c in back.chunks)
        # the derived counts (not sent) are rebuilt
        assert (back.num_prefill_tokens, back.num_decode_tokens) == (
            sum(c.num_tokens for c in value.chunks if c.is_prefill),
            sum(1 for c in value.chunks if not c.is_prefill),
        )


def test_floats_are_exact_and_nan_travels():
    event = StageEvent(0, 1, "decode", 0, 1, math.pi, 1e-300, 1e300, -0.0, math.nan)
    back = decode(encode(event))
    assert back.wait_start == math.pi and back.input_ready == 1e-300
    assert math.copysign(1, back.compute_end) == -1 and math.isnan(back.send_end)


def test_an_attention_report_travels_with_its_stage_event():
    report = AttentionReport("torch", ("flex_paged cannot run here: why", "another"))
    event = StageEvent(1, 2, "decode", 0, 1, 0.0, 0.0, 0.0, 0.0, 0.0, report)
    assert decode(encode(event)) == event
    assert decode(encode(event.shifted(1.0))).attention == report


@pytest.mark.parametrize(
    "cls",
    [
        SamplingParams,
        ScheduledChunk,
        MicroBatch,
        StageEvent,
        AttentionReport,
        TokenLogprobs,
        PromptChunkLogprobs,
        MicroBatchResult,
        StageMemory,
        StructuredOutputsParams,
    ],
)
def test_the_codec_sends_every_field(cls):
    """A field added to a value type must be added to the codec too (or it would be lost);
    fields ``__post_init__`` derives (``init=False``) are rebuilt, not sent."""
    assert record_fields(cls) == [f.name for f in dataclasses.fields(cls) if f.init]


def _packed(value) -> bytes:
    return msgpack.packb([WIRE_VERSION, value], use_bin_type=True)


CHUNK = [1, 0, [5, 6], True, [0], None, 1, -1, [], [6], 0]  # a valid ScheduledChunk's fields


def _params(**fields) -> list:
    """A valid SamplingParams' fields as sent, with ``fields`` changed."""
    from sarathi_pp.comm.codec import _RECORDS, _fields_to_plain

    plain = _fields_to_plain(SamplingParams, SamplingParams())
    names = list(_RECORDS[SamplingParams][1])
    for name, value in fields.items():
        plain[names.index(name)] = value
    return plain


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"", "not msgpack"),
        (b"\xc1", "not msgpack"),
        (b"\x92\x01\xc0\xc0", "not msgpack"),  # trailing bytes
        (pickle.dumps(("ok", 1)), "not msgpack"),
        (msgpack.packb({"a": 1}), "expected [wire version, value], got dict"),
        (msgpack.packb([WIRE_VERSION + 1, None]), f"wire version {WIRE_VERSION + 1}"),
        (_packed(["builtins.eval", "1"]), "unknown tag 'builtins.eval'"),
        (_packed(b"raw bytes"), "expected a value, got bytes"),
        (_packed(msgpack.ExtType(1, b"x")), "expected a value, got ExtType"),
        (_packed(["microbatch", 1]), "microbatch: expected the 3 fields of a MicroBatch, got 1"),
        (
            _packed(["microbatch", 1, [CHUNK[:3]], []]),
            "microbatch.chunks[0]: expected the 11 fields",
        ),
        (
            _packed(["microbatch", 1, [[1, 0, [5, "6"], True, [0], None, 1, -1, [], [], 0]], []]),
            "microbatch.chunks[0].token_ids: expected int items, got str",
        ),
        (
            _packed(["microbatch", 1, [[1, 0, [5], 1, [0], None, 1, -1, [], [], 0]], []]),
            "microbatch.chunks[0].is_prefill: expected bool, got int",
        ),
        (
            _packed(["microbatch", True, [CHUNK], []]),
            "microbatch.microbatch_id: expected int, got bool",
        ),
        (
            _packed(["microbatch", 1, [[*CHUNK[:3], False, *CHUNK[4:]], CHUNK], []]),
            "prefill chunk after a decode",  # MicroBatch's own layout check
        ),
        (
            _packed(
                ["microbatch", 1, [[*CHUNK[:5], _params(logit_bias=[[3, "x"]]), *CHUNK[6:]]], []]
            ),
            "microbatch.chunks[0].sampling_params.logit_bias[0]: expected float or int, got str",
        ),
        (
            _packed(["microbatch", 1, [CHUNK], [1.5]]),
            "microbatch.released: expected int items, got float",
        ),
        (
            _packed(
                [
                    "microbatch",
                    1,
                    [
                        [
                            *CHUNK[:5],
                            [1, 0.5, 1, 0, None, 0, [], [], False, None, False, 0.0, False, True]
                            + [True, 0.0, 0.0, 1.0, 0, [], None, None, [], None, [], None],
                            0,
                            -1,
                            [],
                            [],
                            0,
                        ]
                    ],
                    [],
                ]
            ),
            "max_tokens must be None or an integer >= 1",  # SamplingParams' own validation
        ),
        (_packed(["stage_memory", 0, 1, 2, 3]), "expected the 5 fields of a StageMemory, got 4"),
        (
            _packed(["microbatch_result", [[1]], [], [], None, [], [], 0, 0.0]),
            "microbatch_result.sampled[0]: expected a [key, value] pair",
        ),
        (
            _packed(["microbatch_result", [], [], [], 5, [], [], 0, 0.0]),
            "microbatch_result.failure: expected str, got int",
        ),
        (
            _packed(
                [
                    "microbatch_result",
                    [],
                    [],
                    [],
                    None,
                    [[2, ["token_logprobs", -1.0, 1, [], []]]],
                    [],
                    0,
                    0.0,
                ]
            ),
            "microbatch_result.logprobs[2]: expected the 4 fields of a TokenLogprobs",
        ),
        (
            _packed(
                [
                    "microbatch_result",
                    [],
                    [],
                    [],
                    None,
                    [],
                    [[2, [1, [[-1.0, 1, [], [], 0]]]]],
                    0,
                    0.0,
                ]
            ),
            "microbatch_result.prompt_logprobs[2].tokens[0]: expected the 4 fields of a TokenLogprobs",
        ),
    ],
)
def test_malformed_messages_are_codec_errors(data, says):
    with pytest.raises(CodecError) as info:
        decode(data)
    assert says in str(info.value)


def test_tuples_nest_only_so_deep():
    deep: object = None
    for _ in range(MAX_DEPTH + 1):
        deep = (deep,)
    with pytest.raises(CodecError, match=f"nested deeper than {MAX_DEPTH}"):
        encode(deep)
    plain: object = None
    for _ in range(MAX_DEPTH + 1):
        plain = ["tuple", plain]
    with pytest.raises(CodecError, match=f"nested deeper than {MAX_DEPTH}"):
        decode(_packed(plain))
    with pytest.raises(CodecError, match="not msgpack"):  # msgpack's own nesting limit
        decode(b"\x91" * 100_000 + b"\xc0")


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (object(), "values of type object cannot travel"),
        ((1, [2]), "[1]: values of type list cannot travel"),
        ({"a": 1}, "values of type dict cannot travel"),
        (MicroBatchResult(sampled={1: 2**70}), "cannot encode"),
        (
            MicroBatchResult(sampled={1: True}),
            "microbatch_result.sampled[1]: expected int, got bool",
        ),
        (
            MicroBatchResult(logprobs={3: TokenLogprobs(-0.5, 1, (4,), (1,))}),
            "microbatch_result.logprobs[3].top_logprobs: expected float items, got int",
        ),
        (StageMemory(0, 1.5, 2, 3), "stage_memory.param_bytes: expected int, got float"),
        ("\udc80", "cannot encode"),  # a lone surrogate is no UTF-8
    ],
)
def test_values_that_cannot_travel_fail_at_the_sender(value, says):
    with pytest.raises(CodecError) as info:
        encode(value)
    assert says in str(info.value)


def test_a_long_microbatch_round_trips():
    decode_chunks = tuple(
        ScheduledChunk(i, 4095, (7,), False, tuple(range(i, i + 256)), SamplingParams(), 100)
        for i in range(256)
    )
    mb = MicroBatch(
        3, (ScheduledChunk(999, 0, tuple(range(2048)), True, tuple(range(128))), *decode_chunks)
    )
    assert decode(encode(mb)) == mb
