"""``chunk_size: auto``: the token budget planned from the memory bound and the workload's
P:D ratio, and re-planned from the requests that finish (pure Python, no torch).

The rule is the planner's (``sarathi_pp.planner.chunk.planned_chunk_size``): a prefill chunk
``C = P/D x decodes per micro-batch``, clamped to ``[min_chunk_size, max_chunk_size]``,
plus those decodes, rounded to the tile (a multiple of ``tile_size`` whether or not
``tile_align`` trims the micro-batches). The tuner only decides which P:D feeds it (see
"P:D estimate" below) and when (after every request added or finished; the budget is read
by the policy before each micro-batch and never changes inside ``schedule``).

P:D estimate (token-weighted: prompt tokens / output tokens, the ratio of prefill to
decode work, which the long requests dominate as they dominate the pipeline):

* before any request: ``pd_ratio = max_chunk_size``, which puts C at the upper clamp
  whenever a micro-batch carries a decode: the largest budget the plan gives. It is never
  scheduled with: the first request re-plans.
* the prior: every request added so far with a ``max_tokens`` of its own, its prompt length
  and that ``max_tokens`` (capped at ``max_model_len``) as the expected output length. A
  request without one (``max_tokens=None``: the rest of the context, a bound and not a
  length) says nothing of its output until it finishes: it is left out of the prior.
* the window: the last ``auto_chunk_window`` finished requests (stopped or at their length
  limit; an aborted or failed one says nothing of the workload), with their actual prompt
  and output lengths (an EOS-stopped request is shorter than its ``max_tokens``). While the
  window is not full, each empty slot holds the prior's mean request, so the first request
  to finish (often an early EOS) moves the estimate by one slot's worth, not all of it; a
  full window is observed requests only.

No hysteresis: a change costs nothing here (the budget is a number the policy reads before
each micro-batch; no kernel or graph is specialized per budget), the tile rounding already
quantizes it, and one finished request moves a window of W by 1/W at most, so the budget
drifts by a tile at a time rather than jumping back and forth.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from sarathi_pp.config import SchedulerConfig
from sarathi_pp.planner.chunk import planned_chunk_size


class RequestShape(NamedTuple):
    num_prompt_tokens: int
    num_output_tokens: int


class ChunkTuner:
    """The current ``chunk_size`` of a scheduler with ``chunk_size: auto``."""

    def __init__(
        self,
        config: SchedulerConfig,
        max_decode_batch: int,
        num_microbatches_in_flight: int,
        max_model_len: int,
    ) -> None:
        if max_decode_batch < 1:
            raise ValueError(f"max_decode_batch must be >= 1, got {max_decode_batch}")
        self.config = config
        self.max_decode_batch = max_decode_batch  # B
        self.num_microbatches_in_flight = num_microbatches_in_flight  # n
        self.max_model_len = max_model_len
        self.window: deque[RequestShape] = deque(maxlen=config.auto_chunk_window)
        self._num_added = 0
        self._added_prompt_tokens = 0
        self._added_output_tokens = 0  # expected: max_tokens, capped at max_model_len
        self.pd_ratio: float | None = None  # what the budget is planned from; None: no request
        self.chunk_size = self.plan(float(config.max_chunk_size))

    def plan(self, pd_ratio: float) -> int:
        """The planner's token budget for ``pd_ratio`` with this B, n, clamp and tile."""
        c = self.config
        return planned_chunk_size(
            pd_ratio,
            self.max_decode_batch,
            self.num_microbatches_in_flight,
            c.min_chunk_size,
            c.max_chunk_size,
            c.tile_size,
        ).chunk_size

    def on_added(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """A request arrived: part of the prior (re-plans only while the window has room);
        ``max_tokens=None`` (no length asked for): not part of it."""
        if max_tokens is None:
            return
        self._num_added += 1
        self._added_prompt_tokens += num_prompt_tokens
        self._added_output_tokens += max(1, min(max_tokens, self.max_model_len - num_prompt_tokens))
        if len(self.window) < self.config.auto_chunk_window:
            self._replan()

    def on_finished(self, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """A request ended (stopped or at its length limit) with these actual lengths."""
        if num_output_tokens < 1:
            return  # no decode to learn from
        self.window.append(RequestShape(num_prompt_tokens, num_output_tokens))
        self._replan()

    def estimate_pd_ratio(self) -> float | None:
        """The window's P:D, its empty slots filled with the prior's mean request; ``None``
        before any request."""
        prompt: float = sum(r.num_prompt_tokens for r in self.window)
        output: float = sum(r.num_output_tokens for r in self.window)
        num_empty = self.config.auto_chunk_window - len(self.window)
        if num_empty and self._num_added:
            prompt += num_empty * self._added_prompt_tokens / self._num_added
            output += num_empty * self._added_output_tokens / self._num_added
        return prompt / output if output > 0 else None

    def _replan(self) -> None:
        ratio = self.estimate_pd_ratio()
        if ratio is not None:
            self.pd_ratio = ratio
            self.chunk_size = self.plan(ratio)
