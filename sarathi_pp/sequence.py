"""A request's sequence and its state machine (pure Python, no torch).

Token accounting (see DESIGN.md, "One request's way through"):

* ``token_ids`` = prompt + generated tokens.
* ``num_scheduled_tokens``: how many leading tokens have been issued in a micro-batch;
  their K/V is in the paged cache once that micro-batch has run. With pipeline parallelism a later
  prefill chunk may be issued while an earlier one is still in flight, so this counts
  *issued*, not *finished*, tokens.
* A sequence is schedulable while ``num_scheduled_tokens < num_tokens``. After its last
  token is issued it waits for the sampled token (``num_scheduled == num_tokens``), which is
  exactly the decode dependency of a pipeline.
* Scheduling ahead (``parallel.schedule_ahead``) may issue that next token's decode before
  it is sampled (its input comes from the last stage over the token ring): then
  ``num_scheduled_tokens == num_tokens + 1`` until the sampled token is appended.
* Preemption by recompute resets ``num_scheduled_tokens`` to 0 and frees the blocks; the
  generated tokens are kept and are recomputed as part of the next prefill.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from sarathi_pp.outputs import RequestMetrics
from sarathi_pp.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sarathi_pp.microbatch import TokenLogprobs


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted and waiting to be readmitted
    RUNNING = "running"  # admitted: holds KV blocks
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self not in _LIVE

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


_LIVE = (SequenceStatus.WAITING, SequenceStatus.RUNNING)  # a tuple: members compare by identity


class Sequence:
    """One request (``n == 1``, so a request is one sequence)."""

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        prompt: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # One per output token when ``params.logprobs`` is set (kept across preemption:
        # the recomputed tokens are not sampled again).
        self.output_logprobs: list[TokenLogprobs] = []
        # With ``params.prompt_logprobs``: prompt positions 1, 2, ... in order, as their
        # chunks finish (kept across preemption: a recomputed position is not taken again).
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.num_scheduled_tokens = 0
        self.num_inflight = 0  # micro-batches issued and not yet done that hold this seq
        # The micro-batch in flight whose last stage samples this sequence's next token
        # (-1: none). Scheduling ahead issues a decode of that token before it is known.
        self.sampling_microbatch = -1
        self.block_table: list[int] = []
        # Prefix caching (``scheduler/block_manager.py``): the chained names of the full
        # blocks of ``token_ids`` computed so far, and how many leading blocks of
        # ``block_table`` are published (found by content).
        self.block_hashes: list[bytes] = []
        self.num_published_blocks = 0
        self.cache_salt = cache_salt  # folded into the first block's hash
        self.admit_order = -1  # set at each admission; larger = admitted more recently
        self.last_scheduled_step = -1
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.stop_reason: int | str | None = None
        self.error: str | None = None

    # --- sizes -------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens not yet issued in any microbatch."""
        return len(self.token_ids) - self.num_scheduled_tokens

    # --- state predicates (asked of every running sequence at every scheduling step: the
    # simulator's 600,000-step runs feel each attribute lookup, hence no property chains) ---
    @property
    def is_finished(self) -> bool:
        return self.status not in _LIVE

    @property
    def is_decode(self) -> bool:
        """True when the next step is a single decode token (not a prompt/recompute chunk).

        The last token of a recompute whose previous chunk is still in flight is the tail of
        that prefill, not a decode: a decoding sequence is in at most one micro-batch in flight."""
        return (
            self.num_inflight == 0
            and len(self.token_ids) - self.num_scheduled_tokens == 1
            and len(self.output_token_ids) > 0
        )

    @property
    def is_schedulable(self) -> bool:
        return self.status in _LIVE and len(self.token_ids) > self.num_scheduled_tokens

    def append_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        m = self.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.token_times.append(now)

    def add_prompt_logprobs(self, first: int, tokens: tuple[TokenLogprobs, ...]) -> None:
        """Take prompt positions ``first, first + 1, ...`` (a chunk's) that are new."""
        have = len(self.prompt_logprobs) + 1  # the next position wanted
        if first <= have < first + len(tokens):
            self.prompt_logprobs.extend(tokens[have - first :])

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Asked for, and some prompt position (after the first) still missing."""
        return (
            self.params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1
        )

    def finish(self, status: SequenceStatus, now: float, reason: int | str | None = None) -> None:
        assert status.is_finished, status
        self.status = status
        self.stop_reason = reason
        self.metrics.finished_time = now

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, scheduled={self.num_scheduled_tokens}, "
            f"blocks={len(self.block_table)})"
        )
