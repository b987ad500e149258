"""``ModelRunner`` (vLLM's name for the same part): one stage's layers and KV cache, run on
one micro-batch at a time, and on the last stage the sampler.

The same class runs in-process (one stage, ``executors/uniproc.py``) and inside a
``PipelineStage`` (a Ray actor or a torchrun rank): it only needs a micro-batch and, on
stages after the first, the hidden states received from the previous stage.
``metadata.py`` turns the micro-batch into tensors.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from sarathi_pp.microbatch import (
    AttentionReport,
    MicroBatch,
    MicroBatchResult,
    PromptChunkLogprobs,
    TokenLogprobs,
)
from sarathi_pp.model_spec import ModelSpec
from sarathi_pp.placement import Placement
from sarathi_pp.stage_memory import PROMPT_LOGITS_ROWS, StageMemory
from sarathi_pp.stages.model.attention import make_backend
from sarathi_pp.stages.model.backend_choice import AttentionRecord, choose_backend
from sarathi_pp.stages.model.kv_cache import KVCache
from sarathi_pp.stages.model.llama import StageModel
from sarathi_pp.stages.worker.device import check_free_cuda_memory
from sarathi_pp.stages.worker.metadata import build_metadata, sample_rows
from sarathi_pp.stages.worker.penalties import PenaltyState, apply_penalties
from sarathi_pp.stages.worker.sampler import (
    INVALID_TOKEN,
    logprobs,
    processed_logits,
    sample,
    target_logprobs,
)
from sarathi_pp.stages.worker.structured import GrammarMasks

# A row's logits are not all finite (a sampled token's, a prompt position's): its request fails.
NON_FINITE = "the model produced non-finite logits"
RULED_OUT = (
    "every token was ruled out (allowed_token_ids, bad_words, min_tokens, structured_outputs): "
    "nothing to sample"
)
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class StageSpec:
    """Where a stage sits in the pipeline and what it runs on."""

    stage_idx: int
    num_stages: int
    layer_start: int
    layer_end: int
    dtype: str  # resolved: float32 / bfloat16 / float16
    device: str  # resolved: cpu / cuda / cuda:N
    memory_bytes: int  # M_G: what the stage may use for parameters + KV cache
    num_threads: int | None = None  # CPU intra-op threads; None: torch's default
    token_ring: bool = False  # scheduling ahead: stage 0 and the last stage hold the ring
    prefault: bool = False  # cache.prefault: map the whole KV cache at start-up
    attention_backend: str = "auto"  # model.attention_backend
    strict_attention_backend: bool = False  # model.strict_attention_backend

    @classmethod
    def of(
        cls,
        placement: Placement,
        stage_idx: int,
        device: str | None = None,
        *,
        token_ring: bool = False,
        prefault: bool = False,
    ) -> StageSpec:
        """Stage ``stage_idx`` of ``placement`` (``device``: a specific one, e.g. ``cuda:1``;
        ``token_ring``: the driver schedules ahead; ``prefault``: ``cache.prefault``)."""
        start, end = placement.layer_ranges[stage_idx]
        return cls(
            stage_idx, placement.num_stages, start, end, placement.dtype,
            device or placement.device, placement.memory_bytes, placement.num_threads,
            token_ring, prefault, placement.attention_backend, placement.strict_attention_backend,
        )  # fmt: skip

    @property
    def is_first(self) -> bool:
        return self.stage_idx == 0

    @property
    def is_last(self) -> bool:
        return self.stage_idx == self.num_stages - 1


class ModelRunner:
    def __init__(
        self,
        spec: ModelSpec,
        model_dir: str | Path,
        stage: StageSpec,
        max_model_len: int,
        tokenizer_dir: str | Path | None = None,
    ) -> None:
        self.spec = spec
        self.stage = stage
        self.device = torch.device(stage.device)
        self.dtype = TORCH_DTYPES[stage.dtype]
        self.max_model_len = max_model_len
        self.model_dir = str(model_dir)
        self.model: StageModel | None = None
        self.kv: KVCache | None = None
        self.backend = "torch"
        self.attention: AttentionRecord | None = None  # set with the KV cache
        self.penalties = PenaltyState()  # the last stage's: penalized sequences' tokens
        # the last stage's: structured output's matchers (the tokenizer read on first use)
        self.tokenizer_dir = str(tokenizer_dir or model_dir)
        self.grammar = self._new_grammar()
        self._mask_thread: ThreadPoolExecutor | None = None  # Note [mask beside the forward]

    # --- set-up, in two steps: weights first, then the KV cache sized from what is left ---
    def load_model(self) -> int:
        """Load this stage's weights; returns their size in bytes (M_S)."""
        s = self.stage
        self.model = StageModel(
            self.spec,
            self.model_dir,
            s.layer_start,
            s.layer_end,
            s.is_first,
            s.is_last,
            self.dtype,
            self.device,
            max_positions=self.max_model_len + 1,
        )
        return self.model.param_bytes()

    def memory(self, param_bytes: int) -> StageMemory:
        """This stage's M_S (``param_bytes``, as loaded), m_kv and M_G (the placement's)."""
        s = self.stage
        m_kv = self.spec.kv_bytes_per_token(s.layer_end - s.layer_start, s.dtype)
        return StageMemory(s.stage_idx, param_bytes, m_kv, s.memory_bytes)

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        assert self.model is not None
        st = self.stage
        m_kv = self.spec.kv_bytes_per_token(st.layer_end - st.layer_start, st.dtype)
        check_free_cuda_memory(
            self.device, num_blocks * block_size * m_kv,
            f"stage {st.stage_idx}'s KV cache ({num_blocks} blocks of {block_size} tokens)",
        )  # fmt: skip
        s = self.spec
        self.kv = KVCache(
            self.model.num_layers,
            num_blocks,
            block_size,
            s.num_kv_heads,
            s.head_dim,
            self.dtype,
            self.device,
            prefault=self.stage.prefault,
        )
        self.block_size = block_size
        # Note [no silent fallback] (stages/model/backend_choice.py)
        self.attention = AttentionRecord(st.stage_idx, "torch", st.strict_attention_backend)
        self.backend = choose_backend(
            st.attention_backend, self.device, self.dtype, block_size, self.attention
        )
        attention = make_backend(
            self.backend, s.num_heads, s.num_kv_heads, s.head_dim, self.attention,
            max_blocks_per_seq=-(-(self.max_model_len + 1) // block_size),
        )  # fmt: skip
        for layer in self.model.layers:
            layer.attention = attention

    def take_attention_report(self) -> AttentionReport | None:
        """The stage's attention backend and fallbacks when they changed since last taken
        (the first call after ``init_kv_cache``: always), for its next ``StageEvent``."""
        return self.attention.take_report() if self.attention is not None else None

    def release(self) -> None:
        """Drop the weights and the KV cache (the stage is shut down); on CUDA, hand the
        memory back to the device, so a pipeline started next in this process, or another
        process on the same device, can have it."""
        self.model = None
        self.kv = None
        self.penalties = PenaltyState()
        self.grammar = self._new_grammar()
        if self._mask_thread is not None:
            self._mask_thread.shutdown()
            self._mask_thread = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _new_grammar(self) -> GrammarMasks:
        return GrammarMasks(self.tokenizer_dir, self.spec.vocab_size, self.spec.eos_token_ids)

    # --- one micro-batch -------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, microbatch: MicroBatch, hidden: torch.Tensor | None = None):
        """Run this stage on ``microbatch``. Returns hidden states ``[num_tokens, hidden]`` for the
        next stage, or on the last stage its ``MicroBatchResult`` (the sampled tokens)."""
        assert self.model is not None and self.kv is not None, "load_model/init_kv_cache first"
        token_ids, meta = build_metadata(microbatch, self.block_size, self.device, self.backend)
        if self.stage.is_first:
            inputs = token_ids
        else:
            if hidden is None or hidden.shape != (microbatch.num_tokens, self.spec.hidden_size):
                got = None if hidden is None else tuple(hidden.shape)
                raise ValueError(
                    f"stage {self.stage.stage_idx}: micro-batch {microbatch.microbatch_id} expects hidden "
                    f"[{microbatch.num_tokens}, {self.spec.hidden_size}], got {got}"
                )
            inputs = hidden
        prep = self._prepare_sampling(microbatch) if self.stage.is_last else None
        out = self.model.forward(inputs, meta, self.kv)
        if prep is None:
            return out
        return self._sample(microbatch, out, prep)

    def _prepare_sampling(self, microbatch: MicroBatch) -> _Prepared:
        """What the last stage's sampling needs before the logits: the sequences' kept
        tokens (``stages/worker/penalties.py``) and structured output's token masks, those
        computed on a thread while the layers run (Note [mask beside the forward])."""
        result = MicroBatchResult()
        self.penalties.release(microbatch)
        self.grammar.release(microbatch)
        chunks = [c for c in microbatch.chunks if c.do_sample]
        kept, outputs, histories = self._kept_tokens(chunks, result)
        rows = [i for i in kept if chunks[i].sampling_params.structured_outputs is not None]
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

    def _sample(
        self, microbatch: MicroBatch, hidden: torch.Tensor, prep: _Prepared
    ) -> MicroBatchResult:
        """The last stage's result: each sampling sequence's token (and its log-probabilities
        if asked for), or its failure (non-finite logits: that request fails alone)."""
        assert self.model is not None
        rows = sample_rows(microbatch)
        result, chunks, kept, outputs = prep.result, prep.chunks, prep.kept, prep.outputs
        self._prompt_logprobs(microbatch, hidden, result)
        if not rows:
            return result
        logits = self.model.logits(hidden[torch.tensor(rows, device=self.device)])
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
        tokens = sample(sampling_logits, params, num_outputs)
        if sampling_logits is not logits:  # a row whose every token its rules ruled out
            lowest = torch.finfo(sampling_logits.dtype).min
            for i in (sampling_logits.amax(dim=-1) <= lowest).nonzero().flatten().tolist():
                result.errors.setdefault(chunks[i].seq_id, RULED_OUT)
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
        self, microbatch: MicroBatch, hidden: torch.Tensor, result: MicroBatchResult
    ) -> None:
        """The prompt log-probabilities of every chunk that asks (``prompt_targets``), from
        its rows' logits, ``PROMPT_LOGITS_ROWS`` rows at a time (a chunk's logits at once
        would be ``chunk x vocab`` floats). Non-finite logits fail the request."""
        assert self.model is not None
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
                logits = self.model.logits(hidden[at : at + len(targets)])
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
