"""The last stage's sampling (``ModelRunner``'s, on the last stage only): the kept tokens of
penalized and constrained sequences, structured output's token masks (computed on a
thread beside the forward), the logits of the sampled rows, and each row's token, its
log-probabilities or its failure."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from sarathi_pp.microbatch import (
    MicroBatch,
    MicroBatchResult,
    PromptChunkLogprobs,
    TokenLogprobs,
)
from sarathi_pp.model_spec import ModelSpec
from sarathi_pp.stage_memory import PROMPT_LOGITS_ROWS
from sarathi_pp.stages.model.llama import StageModel
from sarathi_pp.stages.worker.metadata import sample_rows
from sarathi_pp.stages.worker.penalties import PenaltyState, apply_penalties
from sarathi_pp.stages.worker.sampler import (
    INVALID_TOKEN,
    logprobs,
    processed_logits,
    sample_on_device,
    target_logprobs,
    tokens_to_host,
)
from sarathi_pp.stages.worker.structured import GrammarMasks

# A row's logits are not all finite (a sampled token's, a prompt position's): its request fails.
NON_FINITE = "the model produced non-finite logits"
RULED_OUT = (
    "every token was ruled out (allowed_token_ids, bad_words, min_tokens, structured_outputs): "
    "nothing to sample"
)


class LastStageSampler:
    """The sampling state the last stage keeps between micro-batches: penalized sequences'
    tokens (``penalties.py``) and structured output's matchers (``structured.py``)."""

    def __init__(self, spec: ModelSpec, device: torch.device, tokenizer_dir: str | Path) -> None:
        self.spec = spec
        self.device = device
        self.tokenizer_dir = str(tokenizer_dir)  # read on the first constrained request
        self.penalties = PenaltyState()
        self.grammar = GrammarMasks(self.tokenizer_dir, spec.vocab_size, spec.eos_token_ids)
        self._mask_thread: ThreadPoolExecutor | None = None  # Note [mask beside the forward]

    def reset(self) -> None:
        """Forget every sequence (the stage is shut down or its cache was a probe's)."""
        self.penalties = PenaltyState()
        self.grammar = GrammarMasks(
            self.tokenizer_dir, self.spec.vocab_size, self.spec.eos_token_ids
        )
        if self._mask_thread is not None:
            self._mask_thread.shutdown()
            self._mask_thread = None

    def prepare(self, microbatch: MicroBatch) -> _Prepared:
        """What the last stage's sampling needs before the logits: the sequences' kept
        tokens (``stages/worker/penalties.py``) and structured output's token masks, those
        computed on a thread while the layers run (Note [mask beside the forward])."""
        result = MicroBatchResult()
        self.penalties.release(microbatch)
        self.grammar.release(microbatch)
        chunks = [c for c in microbatch.chunks if c.do_sample]
        kept, outputs, histories = self._kept_tokens(chunks, result)
        rows = [
            i
            for i in kept
            if (p := chunks[i].sampling_params) is not None and p.structured_outputs is not None
        ]
        masks = None
        if rows:
            if self._mask_thread is None:
                self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
            outs = [outputs[i] for i in rows]
            masks = self._mask_thread.submit(self._timed_masks, chunks, rows, outs)
        return _Prepared(result, chunks, kept, outputs, histories, rows, masks)

    def _timed_masks(self, chunks: list, rows: list[int], outputs: list[list[int]]):
        start = time.perf_counter()
        allowed, errors = self.grammar.masks(chunks, rows, outputs)
        return allowed, errors, time.perf_counter() - start

    def sample(
        self,
        model: StageModel,
        microbatch: MicroBatch,
        hidden: torch.Tensor,
        row_idx: torch.Tensor,
        prep: _Prepared,
    ) -> MicroBatchResult:
        """The last stage's result: each sampling sequence's token (and its log-probabilities
        if asked for), or its failure (non-finite logits: that request fails alone)."""
        rows = sample_rows(microbatch)
        result, chunks, kept, outputs = prep.result, prep.chunks, prep.kept, prep.outputs
        self._prompt_logprobs(model, microbatch, hidden, result)
        if not rows:
            return result
        logits = model.logits(hidden[row_idx])  # row_idx: ``rows`` on the device
        # every chunk's (do_sample: sampling_params is not None); the filter narrows the type
        params = [c.sampling_params for c in chunks if c.sampling_params is not None]
        num_outputs = [c.num_output_tokens for c in chunks]
        sampling_logits = logits
        if prep.histories:
            pen_rows = list(prep.histories)
            sampling_logits = apply_penalties(
                logits, pen_rows, list(prep.histories.values()), [chunks[i] for i in pen_rows]
            )
        sampling_logits = processed_logits(  # penalized rows: a copy already, changed in place
            sampling_logits,
            params,
            num_outputs,
            self.spec.eos_token_ids,
            in_place=sampling_logits is not logits,
            outputs=outputs,
        )
        sampling_logits = self._grammar_masked(sampling_logits, logits, prep)
        on_device = sample_on_device(sampling_logits, params, num_outputs)
        if sampling_logits is not logits:  # a row whose every token its rules ruled out
            lowest = torch.finfo(sampling_logits.dtype).min
            ruled_out = (sampling_logits.amax(dim=-1) <= lowest).long()
            # one copy to the host for both (Note [one upload per micro-batch])
            tokens, ruled = tokens_to_host(torch.stack([on_device, ruled_out]))
            for i in (i for i, r in enumerate(ruled) if r):
                result.errors.setdefault(chunks[i].seq_id, RULED_OUT)
        else:
            tokens = tokens_to_host(on_device)
        for i in kept:
            self.penalties.sampled(chunks[i], tokens[i])
        for i, lp in logprobs(logits, params, tokens).items():
            result.logprobs[chunks[i].seq_id] = lp
        for chunk, token in zip(chunks, tokens):
            if chunk.seq_id in result.errors:
                continue
            if token == INVALID_TOKEN:
                result.errors[chunk.seq_id] = NON_FINITE
            else:
                result.sampled[chunk.seq_id] = token
        return result

    def _grammar_masked(
        self, sampling_logits: torch.Tensor, logits: torch.Tensor, prep: _Prepared
    ) -> torch.Tensor:
        """``sampling_logits`` with the tokens each structured row's grammar rules out set
        to the lowest finite value (``stages/worker/structured.py``); a copy of ``logits``
        first if it is still the raw logits (log-probabilities are reported from them)."""
        if prep.masks is None:
            return sampling_logits
        allowed, errors, mask_s = prep.masks.result()
        start = time.perf_counter()
        result, chunks, rows = prep.result, prep.chunks, prep.mask_rows
        for i, why in errors.items():
            result.errors[chunks[i].seq_id] = why
        out = sampling_logits.clone() if sampling_logits is logits else sampling_logits
        idx = torch.tensor(rows, device=self.device)
        lowest = torch.finfo(out.dtype).min
        out[idx] = out[idx].masked_fill(~allowed.to(self.device), lowest)
        result.num_grammar_masks += len(rows)
        # the masks' own time (on the thread, beside the forward) and applying them here
        result.grammar_mask_s += mask_s + time.perf_counter() - start
        return out

    def _prompt_logprobs(
        self,
        model: StageModel,
        microbatch: MicroBatch,
        hidden: torch.Tensor,
        result: MicroBatchResult,
    ) -> None:
        """The prompt log-probabilities of every chunk that asks (``prompt_targets``), from
        its rows' logits, ``PROMPT_LOGITS_ROWS`` rows at a time (a chunk's logits at once
        would be ``chunk x vocab`` floats). Non-finite logits fail the request."""
        row = 0
        for c in microbatch.chunks:
            if not c.is_prefill:  # prefill chunks first: the rest are decodes
                break
            first_row, row = row, row + c.num_tokens
            if not c.prompt_targets:
                continue
            parts: list[TokenLogprobs] = []
            for lo in range(0, len(c.prompt_targets), PROMPT_LOGITS_ROWS):
                targets = list(c.prompt_targets[lo : lo + PROMPT_LOGITS_ROWS])
                at = first_row + lo
                logits = model.logits(hidden[at : at + len(targets)])
                part = target_logprobs(logits, targets, c.prompt_logprobs)
                if part is None:
                    result.errors[c.seq_id] = NON_FINITE
                    break
                parts.extend(part)
            else:
                result.prompt_logprobs[c.seq_id] = PromptChunkLogprobs(c.start + 1, tuple(parts))

    def _kept_tokens(
        self, chunks: list, result: MicroBatchResult
    ) -> tuple[list[int], dict[int, list[int]], dict[int, list[int]]]:
        """The rows whose tokens the stage keeps (``SamplingParams.keeps_tokens``; a row
        whose tokens the stage lacks fails its request), the output tokens so far of those
        with bad words or structured output, and the tokens of those with penalties."""
        kept: list[int] = []
        outputs: dict[int, list[int]] = {}
        histories: dict[int, list[int]] = {}
        for i, c in enumerate(chunks):
            p = c.sampling_params
            if not p.keeps_tokens:
                continue
            try:
                tokens = self.penalties.before_sampling(c)
            except ValueError as e:
                result.errors[c.seq_id] = str(e)
                continue
            kept.append(i)
            if p.bad_words_token_ids or p.structured_outputs is not None:
                outputs[i] = tokens[len(tokens) - c.num_output_tokens :]
            if p.has_penalties:
                histories[i] = tokens
        return kept, outputs, histories


@dataclass
class _Prepared:
    """The last stage's sampling state of one micro-batch, set before its forward."""

    result: MicroBatchResult
    chunks: list  # the sampling chunks, in row order
    kept: list[int]
    outputs: dict[int, list[int]]  # row -> its output so far (bad words, structured output)
    histories: dict[int, list[int]]  # row -> its tokens (penalties)
    mask_rows: list[int]  # the rows structured output constrains
    masks: Future | None  # their (allowed [rows, vocab], errors, seconds), from the thread


# Note [mask beside the forward]: a constrained sequence's mask depends only on its
# tokens so far, all known when the micro-batch arrives, so the last stage computes it on
# a thread (llguidance works without the GIL) while its layers run and only applies it
# after the logits: on a GPU the host is otherwise idle then; on a CPU the thread shares
# the cores with torch's.
