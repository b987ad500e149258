"""The scheduler's output: one micro-batch, a small immutable value (no tensors).

A micro-batch says which token range of which sequence runs next on the pipeline. Every
pipeline stage receives the same micro-batch and turns it into tensors on its own; the rows of
the flat batch follow the order of ``chunks``: prefill chunks first, then decodes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from sarathi_pp.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Tokens ``[start, start + len(token_ids))`` of sequence ``seq_id``."""

    seq_id: int
    start: int
    token_ids: tuple[int, ...]
    is_prefill: bool
    block_table: tuple[int, ...]  # the sequence's blocks covering at least [0, end)
    # Set on the chunk that reaches the end of the known tokens: the last stage samples
    # one token from its last row. ``num_output_tokens`` keys per-request seeded sampling.
    sampling_params: SamplingParams | None = None
    num_output_tokens: int = 0
    # Scheduling ahead (``parallel.schedule_ahead``): a decode whose input token is still
    # being sampled by micro-batch ``ring_from`` (``token_ids == (RING_TOKEN,)``); stage 0
    # fills it in from that micro-batch's result (``fill_ring``) before running. -1: known.
    ring_from: int = -1
    # Penalties or bad words (``SamplingParams.keeps_tokens``): on the prefill chunk that
    # samples, the sequence's tokens before ``start``, so the last stage knows the whole
    # sequence from then on (it adds each token it samples; ``stages/worker/penalties.py``).
    history: tuple[int, ...] = ()
    # Prompt log-probabilities (``SamplingParams.prompt_logprobs``): the prompt tokens this
    # chunk's rows predict, row ``r`` the token at ``start + r + 1`` (so at most one per row,
    # none past the prompt), and how many of the most likely tokens to report beside each.
    # The last stage answers in ``MicroBatchResult.prompt_logprobs``.
    prompt_targets: tuple[int, ...] = ()
    prompt_logprobs: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def do_sample(self) -> bool:
        return self.sampling_params is not None

    def __repr__(self) -> str:
        kind = "P" if self.is_prefill else "D"
        s = "*" if self.do_sample else ""
        ring = f"<-MB{self.ring_from}" if self.ring_from >= 0 else ""
        return f"{kind}{self.seq_id}[{self.start}:{self.end}]{s}{ring}"


@dataclass(frozen=True, slots=True)
class MicroBatch:
    microbatch_id: int
    chunks: tuple[ScheduledChunk, ...]
    # Penalized sequences finished since the last micro-batch: the last stage forgets them.
    released: tuple[int, ...] = ()
    # Counted once here: the engine, its records and the simulator's cost model ask often.
    num_prefill_tokens: int = field(init=False, repr=False, compare=False)
    num_decode_tokens: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        prefill = [len(c.token_ids) for c in self.chunks if c.is_prefill]
        object.__setattr__(self, "num_prefill_tokens", sum(prefill))
        object.__setattr__(self, "num_decode_tokens", len(self.chunks) - len(prefill))
        # Layout invariant: prefill rows first, then decode rows.
        seen_decode = False
        for c in self.chunks:
            if c.is_prefill:
                assert not seen_decode, f"prefill chunk after a decode in {self}"
            else:
                seen_decode = True

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def ring_sources(self) -> tuple[int, ...]:
        """The micro-batches (ids, ascending) whose sampled tokens this one's decodes take
        as input: empty unless it was scheduled ahead of their results."""
        return tuple(sorted({c.ring_from for c in self.chunks if c.ring_from >= 0}))

    @property
    def sampled_seq_ids(self) -> list[int]:
        return [c.seq_id for c in self.chunks if c.do_sample]

    @property
    def kind(self) -> str:
        """``prefill``, ``decode`` or ``hybrid`` (both)."""
        p, d = self.num_prefill_tokens, self.num_decode_tokens
        if p and d:
            return "hybrid"
        return "prefill" if p else "decode"

    def __repr__(self) -> str:
        body = " ".join(repr(c) for c in self.chunks)
        return (
            f"MB{self.microbatch_id}<{self.kind} P={self.num_prefill_tokens} "
            f"D={self.num_decode_tokens}: {body}>"
        )


# The input token of a decode scheduled ahead, until ``fill_ring`` replaces it.
RING_TOKEN = -1


def fill_ring(microbatch: MicroBatch, sampled: dict[int, dict[int, int]]) -> MicroBatch:
    """``microbatch`` with the input token of every decode scheduled ahead of micro-batch
    ``j`` taken from ``sampled[j]`` (``seq_id -> token``, the last stage's result of ``j``),
    for the ``j`` that ``sampled`` has. A sequence that ``j`` did not sample (it failed
    there) gets token 0: its row still runs (every stage expects it) and the engine drops
    what it samples, since the sequence has ended with ``j``'s error."""
    if not any(c.ring_from in sampled for c in microbatch.chunks):
        return microbatch
    chunks = tuple(
        replace(c, token_ids=(sampled[c.ring_from].get(c.seq_id, 0),), ring_from=-1)
        if c.ring_from in sampled
        else c
        for c in microbatch.chunks
    )
    return MicroBatch(microbatch.microbatch_id, chunks, microbatch.released)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The log-probabilities around one sampled token (``SamplingParams.logprobs``), from
    the model's raw logits (before temperature, top-k and top-p, as vLLM's default):
    the sampled token's own and its rank (1 = the most likely), and the ``logprobs`` most
    likely tokens, most likely first."""

    logprob: float
    rank: int
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class PromptChunkLogprobs:
    """One prefill chunk's prompt log-probabilities (``ScheduledChunk.prompt_targets``):
    ``tokens[i]`` is about the prompt token at position ``first + i``, given the tokens
    before it (its ``rank`` and ``logprob``; the most likely tokens there beside it)."""

    first: int
    tokens: tuple[TokenLogprobs, ...]


@dataclass(frozen=True, slots=True)
class AttentionReport:
    """The attention backend a stage runs (``torch``, ``cpu_paged``, ``flex_paged``,
    ``flash_attn``) and every fallback it took so far, each with its reason."""

    backend: str
    fallbacks: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class StageEvent:
    """One stage's timing of one micro-batch (absolute monotonic seconds until written);
    ``attention``: the stage's ``AttentionReport`` on the first micro-batch it runs and
    whenever a new fallback was taken, else ``None``."""

    stage: int
    mb: int
    kind: str
    num_prefill_tokens: int
    num_decode_tokens: int
    wait_start: float
    input_ready: float
    compute_start: float
    compute_end: float
    send_end: float
    attention: AttentionReport | None = None

    def shifted(self, offset: float) -> StageEvent:
        """The same event with ``offset`` subtracted from every time."""
        times = ("wait_start", "input_ready", "compute_start", "compute_end", "send_end")
        return replace(self, **{k: getattr(self, k) - offset for k in times})


@dataclass
class MicroBatchResult:
    """What came back for one micro-batch: produced by the last stage, relayed by the
    executor, applied by the engine."""

    sampled: dict[int, int] = field(default_factory=dict)  # seq_id -> token id
    errors: dict[int, str] = field(default_factory=dict)  # seq_id -> why it failed
    events: list[StageEvent] = field(default_factory=list)  # each stage's timing of it
    # Set when the micro-batch raised on a stage ("stage S: Error: ..."): the executor
    # then retries its sequences one at a time, so only a request that fails alone fails.
    failure: str | None = None
    # seq_id -> its token's log-probabilities, for the sequences that asked for them
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    # seq_id -> its chunk's prompt log-probabilities (``ScheduledChunk.prompt_targets``)
    prompt_logprobs: dict[int, PromptChunkLogprobs] = field(default_factory=dict)
    # Structured output: the token masks the last stage computed and applied for this
    # micro-batch (one per constrained sequence) and the seconds that took
    num_grammar_masks: int = 0
    grammar_mask_s: float = 0.0

    def add(self, other: MicroBatchResult) -> None:
        """Take ``other``'s tokens, log-probabilities and failures (a retry's, one
        sequence at a time)."""
        self.sampled.update(other.sampled)
        self.logprobs.update(other.logprobs)
        self.prompt_logprobs.update(other.prompt_logprobs)
        self.errors.update(other.errors)
        self.num_grammar_masks += other.num_grammar_masks
        self.grammar_mask_s += other.grammar_mask_s


def retry_one_at_a_time(
    microbatch: MicroBatch, failed: MicroBatchResult, run: Callable[[MicroBatch], MicroBatchResult]
) -> MicroBatchResult:
    """A stage raised on ``microbatch`` (``failed.failure``): its sequences again, each
    alone through ``run`` (a micro-batch through the pipeline -> its result), so only a
    request that fails alone fails (``errors``). The failed run's timing stands; the
    retries' are left out."""
    result = MicroBatchResult(events=failed.events)
    for chunk in microbatch.chunks:
        r = run(MicroBatch(microbatch.microbatch_id, (chunk,), microbatch.released))
        if r.failure is not None:
            result.errors[chunk.seq_id] = r.failure
        else:
            result.add(r)
    return result


def without_failed(microbatch: MicroBatch, result: MicroBatchResult) -> MicroBatch:
    """``microbatch`` (same id) less the sequences ``result`` failed: a micro-batch that
    was behind a retried one goes again without them."""
    kept = tuple(c for c in microbatch.chunks if c.seq_id not in result.errors)
    return MicroBatch(microbatch.microbatch_id, kept, microbatch.released)
