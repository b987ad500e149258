"""Chunked prefills without piggybacking (the paper's ablation): prefill-only micro-batches
of ``chunk_size`` tokens alternate with decode-only micro-batches."""

from __future__ import annotations

from sarathi_pp.scheduler.base import Selection
from sarathi_pp.scheduler.sarathi import SarathiScheduler


class SimpleChunkingScheduler(SarathiScheduler):
    _last_was_prefill = False

    def _select(self, now: float) -> Selection:
        decodes_first = self._last_was_prefill or not self._has_prefill_work(now)
        order = (
            (self._decodes, self._prefills) if decodes_first else (self._prefills, self._decodes)
        )
        for pick in order:
            selection = pick(now)
            if selection:
                self._last_was_prefill = pick == self._prefills
                return selection
        return []

    def _has_prefill_work(self, now: float) -> bool:
        return bool(self._partial_prefills() or self._arrived_waiting(now))

    def _decodes(self, now: float) -> Selection:
        selection: Selection = []
        self._take_decodes(selection, set(), min(self.chunk_size, self._decode_share()))
        return selection

    def _prefills(self, now: float) -> Selection:
        selection: Selection = []
        self._take_prefills(selection, set(), self.chunk_size, now)
        if self.config.tile_align:
            selection = self._trim_to_tile(selection)
        return self._reserve_prefills(selection)
