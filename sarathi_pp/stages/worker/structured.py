"""Structured output on the last stage: one llguidance matcher per sequence whose
``SamplingParams.structured_outputs`` asks, and the token mask it allows, applied to the
logits before sampling (greedy and random, after penalties and the other rules).

A matcher follows the sequence's output as the last stage knows it
(``PenaltyState``, ``stages/worker/penalties.py``: structured output keeps the tokens,
``SamplingParams.keeps_tokens``): before each sampling it consumes the output tokens it
has not seen yet. So it advances in the order the stage samples, scheduling ahead
included (a decode scheduled ahead samples after the token before it was sampled here),
and a recompute (preemption, stage recovery, a micro-batch run again one sequence at a
time) starts it again: the prefill chunk that samples rebuilds it from the chunk's
history, and a decode whose output is shorter than the matcher's rebuilds it too.
Compiled grammars are cached per constraint (a fresh matcher, copied per sequence).
"""

from __future__ import annotations

from pathlib import Path

import llguidance
import llguidance.hf
import torch

from sarathi_pp.grammar import grammar_text
from sarathi_pp.microbatch import MicroBatch, ScheduledChunk
from sarathi_pp.sampling_params import StructuredOutputsParams

WORD_BITS = 32  # llguidance's mask: one bit per token, in int32 words
MAX_COMPILED = 256  # compiled grammars kept (least recently used dropped)


class _Follow:
    """A sequence's matcher and how many of its output tokens it has consumed."""

    __slots__ = ("matcher", "num_consumed")

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.num_consumed = 0


class GrammarMasks:
    """The last stage's matchers (``seq_id`` -> its matcher), built on first use; the
    tokenizer is read from ``tokenizer_dir`` then (``vocab_size``: the logits' width)."""

    def __init__(self, tokenizer_dir: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer_dir = str(tokenizer_dir)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: dict[StructuredOutputsParams, llguidance.LLMatcher] = {}
        self._follow: dict[int, _Follow] = {}

    def release(self, microbatch: MicroBatch) -> None:
        for seq_id in microbatch.released:
            self._follow.pop(seq_id, None)

    def masks(
        self, chunks: list[ScheduledChunk], rows: list[int], outputs: list[list[int]]
    ) -> tuple[torch.Tensor, dict[int, str]]:
        """The allowed tokens of each of ``rows`` (``chunks[row]``'s, whose output so far
        is ``outputs[i]``) as a bool tensor ``[len(rows), vocab]``, and the rows whose
        matcher cannot go on (row -> why: its request fails alone)."""
        words = -(-self.vocab_size // WORD_BITS)
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
        errors: dict[int, str] = {}
        for i, (row, output) in enumerate(zip(rows, outputs)):
            chunk = chunks[row]
            try:
                matcher = self._advanced(chunk, output)
            except ValueError as e:
                errors[row] = str(e)
                continue
            v = bitmask[i]
            matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())
            if matcher.is_error():
                errors[row] = f"structured output: {matcher.get_error()}"
        bits = torch.arange(WORD_BITS, dtype=torch.int32)
        # [rows, words, 32] -> [rows, words * 32]: bit b of word w is token w * 32 + b
        allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, : self.vocab_size]
        return allowed, errors

    def _advanced(self, chunk: ScheduledChunk, output: list[int]) -> llguidance.LLMatcher:
        """``chunk``'s sequence's matcher, having consumed exactly ``output``."""
        so = chunk.sampling_params.structured_outputs if chunk.sampling_params else None
        assert so is not None
        follow = self._follow.get(chunk.seq_id)
        if chunk.is_prefill or follow is None or follow.num_consumed > len(output):
            follow = self._follow[chunk.seq_id] = _Follow(self._compiled_for(so).deep_copy())
        new = output[follow.num_consumed :]
        if new and not follow.matcher.consume_tokens(new):
            raise ValueError(
                f"sequence {chunk.seq_id}: its output does not follow its structured output "
                f"({follow.matcher.get_error()})"
            )
        follow.num_consumed = len(output)
        return follow.matcher

    def _compiled_for(self, so: StructuredOutputsParams) -> llguidance.LLMatcher:
        matcher = self._compiled.pop(so, None)
        if matcher is None:
            matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar_text(so), log_level=0)
            if matcher.is_error():  # the engine checked it: a bug if it shows here
                raise ValueError(f"structured output {so!r}: {matcher.get_error()}")
            if len(self._compiled) >= MAX_COMPILED:
                del self._compiled[next(iter(self._compiled))]
        self._compiled[so] = matcher  # most recently used last
        return matcher

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            from transformers import AutoTokenizer, PreTrainedTokenizerFast

            hf = AutoTokenizer.from_pretrained(self.tokenizer_dir, trust_remote_code=False)
            if not isinstance(hf, PreTrainedTokenizerFast):
                raise ValueError(
                    f"structured output needs a fast (Rust) tokenizer; {self.tokenizer_dir} "
                    f"has a {type(hf).__name__}"
                )
            self._tokenizer = llguidance.hf.from_tokenizer(
                hf, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
            )
        return self._tokenizer
