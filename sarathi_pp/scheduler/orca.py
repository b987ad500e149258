"""Orca-style iteration-level batching: every running decode plus whole new prompts in the
same micro-batch, without chunking (so a long prompt makes its micro-batch long)."""

from __future__ import annotations

from sarathi_pp.scheduler.base import Selection
from sarathi_pp.scheduler.vllm import VLLMScheduler


class OrcaScheduler(VLLMScheduler):
    def _select(self, now: float) -> Selection:
        decodes = self._take_all_decodes(limit=self._decode_share())
        prompts = self._take_whole_prompts(now, self._token_cap())
        return prompts + decodes
