"""SARATHI: decode-maximal batching with chunked prefills.

Every micro-batch has ``chunk_size`` rows at most (``Scheduler.chunk_size``: the budget in
force, fixed or ``chunk_size: auto``'s current value). The running decodes go first (they
are nearly free when they ride along a prefill chunk's matmuls); the rest of the budget
takes the next chunk of the prefill in progress and then of waiting requests (FCFS). With
``tile_align`` the prefill is trimmed so that ``Lp + Bd`` is a multiple of ``tile_size``.

Balanced to the end: the decodes are shared across the micro-batches in flight
(``scheduler.balance_microbatches``, on by default; ``Scheduler._decode_share``: counts
within one of each other) and, with ``scheduler.prefill_pacing`` (off by default), the
prefill tokens paced by the prefill work pending: at most
``max(tile_size, ceil(W / M))``, W the prompt tokens left to issue (admitted prompts, and
the arrived waiting ones the free KV blocks hold), M the micro-batches in flight, while at
least M sequences decode. The last prompts' chunks then spread over the micro-batches in flight instead of filling the first
and leaving the ones behind it decode-only, and prefill work reaches into what would be the
decode-only tail (as gLLM's token throttling, SC'25).
"""

from __future__ import annotations

from sarathi_pp.scheduler.base import Scheduler, Selection
from sarathi_pp.sequence import Sequence, SequenceStatus


class SarathiScheduler(Scheduler):
    def _select(self, now: float) -> Selection:
        budget = self.chunk_size
        selection: Selection = []
        picked: set[int] = set()
        budget -= self._take_decodes(selection, picked, min(budget, self._decode_share()))
        if self.config.prefill_pacing:
            budget = min(budget, self._prefill_pace(now))
        self._take_prefills(selection, picked, budget, now)
        if self.config.tile_align:
            selection = self._trim_to_tile(selection)
        return self._reserve_prefills(selection)

    def _take_decodes(self, selection: Selection, picked: set[int], limit: int) -> int:
        """Up to ``limit`` ready decodes, least recently scheduled first; returns how many."""
        taken = 0
        for seq in self._decode_candidates():
            if taken == limit:
                break
            if seq.is_finished or seq not in self.running:
                continue  # preempted while reserving for an earlier decode
            # ``seq`` itself is not protected: if it is the most recently admitted, it is
            # the victim (preempted, not scheduled) rather than an older sequence.
            if self._reserve(seq, 1, picked):
                picked.add(seq.seq_id)
                selection.append((seq, 1))
                taken += 1
        return taken

    def _take_prefills(
        self, selection: Selection, picked: set[int], budget: int, now: float
    ) -> None:
        """Prefill chunks sized by the budget and the free blocks; blocks of a prefill in
        progress are taken later, after tile trimming, by ``_reserve_prefills``."""
        bs = self.block_manager.block_size
        free_slots = self.block_manager.num_free_blocks * bs
        for seq in self._partial_prefills() + self._arrived_waiting(now):
            if budget == 0:
                break
            if seq.status is SequenceStatus.WAITING:
                # Admit only a prompt whose every block is free (or cached), and reserve
                # them all now (as Sarathi-Serve): a prompt admitted on a few free blocks
                # would force preemptions later. FCFS: nobody overtakes a prompt that does
                # not fit; one waiting for a prefix being written lets the others by.
                free_before = self.block_manager.num_free_blocks
                started = self._start_prefill(seq, now)
                if started is None:
                    continue
                if not started:
                    break
                free_slots -= (free_before - self.block_manager.num_free_blocks) * bs
                if self._is_decode(seq):  # a recompute that the cache left one token to
                    continue
            n = min(seq.num_pending_tokens, budget, self._slots_for(seq, free_slots))
            if n <= 0:
                break
            selection.append((seq, n))
            picked.add(seq.seq_id)
            budget -= n
            free_slots -= self._new_slots(seq, n)

    def _prefill_pace(self, now: float) -> int:
        """Most prefill tokens this micro-batch takes: ``max(tile_size, ceil(W / M))``, W
        the prefill tokens pending (those the free KV blocks allow), M the in-flight limit
        in force; no limit while fewer than M sequences decode (the micro-batches in flight
        cannot all carry decodes then, and a prompt split further only waits longer for its
        first token). O(running + the bounded waiting look, ``_arrived_waiting``)."""
        partial = self._partial_prefills()
        if len(self.running) - len(partial) < self._decode_groups:
            return self.chunk_size
        pending = sum(s.num_pending_tokens for s in partial)
        bs = self.block_manager.block_size
        free_slots = self.block_manager.num_free_blocks * bs
        for seq in self._arrived_waiting(now):
            need = -(-seq.num_pending_tokens // bs) * bs
            if need > free_slots:
                break  # FCFS: the prompts behind it do not start before it
            free_slots -= need
            pending += seq.num_pending_tokens
        return max(self.config.tile_size, -(-pending // self._decode_groups))

    def _slots_for(self, seq: Sequence, free_slots: int) -> int:
        bs = self.block_manager.block_size
        own = len(seq.block_table) * bs - seq.num_scheduled_tokens
        return own + free_slots

    def _new_slots(self, seq: Sequence, n: int) -> int:
        bs = self.block_manager.block_size
        return self.block_manager.num_missing_blocks(seq, seq.num_scheduled_tokens + n) * bs

    def _reserve_prefills(self, selection: Selection) -> Selection:
        for seq, n in selection:
            if not self._is_decode(seq):
                self.block_manager.grow(seq, seq.num_scheduled_tokens + n)
        return selection
