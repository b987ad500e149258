"""Prefill-prioritized baseline (vLLM V0 / nano-vLLM).

Whole prompts first: while requests wait and fit, a micro-batch holds only prefills (up to
``max_num_batched_tokens`` tokens); otherwise a decode-only micro-batch of every running
sequence. Prefills stall decodes (generation stalls) and the two kinds of micro-batch
differ widely in cost, which is what creates PB2 bubbles under pipeline parallelism.
"""

from __future__ import annotations

from sarathi_pp.scheduler.base import Scheduler, Selection
from sarathi_pp.sequence import SequenceStatus


class VLLMScheduler(Scheduler):
    # whole prompts: ``chunk_size`` is not used (``config.WHOLE_PROMPT_POLICIES``)

    def _select(self, now: float) -> Selection:
        selection = self._take_whole_prompts(now, self._token_cap())
        if selection:
            return selection
        return self._take_all_decodes(limit=self._decode_share())

    def _token_cap(self) -> int:
        return self.config.max_num_batched_tokens or self.max_model_len

    def _take_whole_prompts(self, now: float, token_cap: int) -> Selection:
        """FCFS whole prompts (or recomputes) that fit the token cap and the free blocks;
        the first one is taken even above the cap, so a long recompute is never stuck."""
        selection: Selection = []
        num_tokens = 0
        for seq in self._partial_prefills() + self._arrived_waiting(now):
            if seq.status is SequenceStatus.WAITING:
                hit = self._lookup(seq)
                if hit is None:  # waits for a prefix being written: the others go by
                    continue
                n = seq.num_pending_tokens - len(hit.blocks) * self.block_manager.block_size
                if selection and num_tokens + n > token_cap:
                    break
                started = self._start_prefill(seq, now)  # reserves every block
                if not started:
                    break
                if self._is_decode(seq):  # a recompute the cache left one token to
                    continue  # a decode now: with the decodes
                n = seq.num_pending_tokens
            else:
                n = seq.num_pending_tokens
                if selection and num_tokens + n > token_cap:
                    break
                if not self.block_manager.can_grow(seq, seq.num_scheduled_tokens + n):
                    break
                self.block_manager.grow(seq, seq.num_scheduled_tokens + n)
            selection.append((seq, n))
            num_tokens += n
        return selection

    def _take_all_decodes(self, limit: int) -> Selection:
        selection: Selection = []
        picked: set[int] = set()
        for seq in self._decode_candidates():
            if len(selection) == limit:
                break
            if seq not in self.running:
                continue  # preempted while reserving for an earlier decode
            if self._reserve(seq, 1, picked):  # ``seq`` may be the victim (see sarathi.py)
                picked.add(seq.seq_id)
                selection.append((seq, 1))
        return selection
