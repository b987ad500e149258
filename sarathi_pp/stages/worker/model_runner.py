"""``ModelRunner`` (vLLM's name for the same part): one stage's layers and KV cache, run on
one micro-batch at a time, and on the last stage the sampler.

The same class runs in-process (one stage, ``executors/uniproc.py``) and inside a
``PipelineStage`` (a Ray actor or a torchrun rank): it only needs a micro-batch and, on
stages after the first, the hidden states received from the previous stage.
``metadata.py`` turns the micro-batch into tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
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
from sarathi_pp.stages.model.attention import TorchAttention, make_backend
from sarathi_pp.stages.model.backend_choice import AttentionRecord, choose_backend
from sarathi_pp.stages.model.kv_cache import KVCache
from sarathi_pp.stages.model.llama import StageModel
from sarathi_pp.stages.worker.cuda_graphs import DecodeGraphs, cuda_capture, graph_buckets
from sarathi_pp.stages.worker.device import check_free_cuda_memory
from sarathi_pp.stages.worker.memory_probe import MemoryProbe, profiling_microbatch
from sarathi_pp.stages.worker.metadata import build_inputs, sample_rows
from sarathi_pp.stages.worker.penalties import PenaltyState, apply_penalties
from sarathi_pp.stages.worker.sampler import (
    INVALID_TOKEN,
    logprobs,
    processed_logits,
    sample_on_device,
    target_logprobs,
    tokens_to_host,
)
from sarathi_pp.stages.worker.timing import StageClock, WallClock, stage_clock
from sarathi_pp.stages.worker.upload import PinnedUpload, Upload

# A row's logits are not all finite (a sampled token's, a prompt position's): its request fails.
NON_FINITE = "the model produced non-finite logits"
RULED_OUT = (
    "every token was ruled out (allowed_token_ids, bad_words, min_tokens): nothing to sample"
)
# The largest decode batch with a CUDA graph (Note [decode graphs]); vLLM's default is 512.
MAX_GRAPH_BATCH = 256
logger = logging.getLogger(__name__)
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
    enforce_eager: bool = True  # model.enforce_eager: no CUDA graphs

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
            placement.enforce_eager,
        )  # fmt: skip

    @property
    def is_first(self) -> bool:
        return self.stage_idx == 0

    @property
    def is_last(self) -> bool:
        return self.stage_idx == self.num_stages - 1


class ModelRunner:
    def __init__(
        self, spec: ModelSpec, model_dir: str | Path, stage: StageSpec, max_model_len: int
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
        self.graphs: DecodeGraphs | None = None  # model.enforce_eager false, on CUDA
        # Note [one upload per micro-batch] (upload.py); a test swaps in a counting one
        self.upload: Upload = PinnedUpload(self.device)
        # Note [compute spans from CUDA events] (timing.py); CUDA's made with the KV cache
        self.clock: StageClock = WallClock()

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
        # Note [decode graphs]: graphs pad with a decode writing to a scratch block, the last
        scratch = int(not st.enforce_eager)
        check_free_cuda_memory(
            self.device, (num_blocks + scratch) * block_size * m_kv,
            f"stage {st.stage_idx}'s KV cache ({num_blocks} blocks of {block_size} tokens)",
        )  # fmt: skip
        s = self.spec
        self.kv = KVCache(
            self.model.num_layers,
            num_blocks + scratch,
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
        attention = self._attention_backend()  # one, shared by the layers
        for layer in self.model.layers:
            layer.attention = attention
        record = self.attention
        self.clock = stage_clock(
            self.device, st.stage_idx, lambda why: record.fallback(why, strict=False)
        )
        self.graphs = None
        if scratch and self.device.type == "cuda":
            pool = torch.cuda.graph_pool_handle()
            self.capture_graphs(lambda fn: cuda_capture(fn, pool))

    def _attention_backend(self) -> TorchAttention:
        s, record = self.spec, self.attention
        assert record is not None
        return make_backend(
            self.backend, s.num_heads, s.num_kv_heads, s.head_dim, record,
            max_blocks_per_seq=self.max_blocks_per_seq,
        )  # fmt: skip

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-(self.max_model_len + 1) // self.block_size)

    def capture_graphs(
        self,
        capture: Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]],
        buckets: tuple[int, ...] | None = None,
    ) -> DecodeGraphs:
        """Capture the decode graphs of every bucket (Note [decode graphs]) with ``capture``
        (on CUDA ``cuda_capture``; a test's runs the function itself, on CPU); the layers'
        attention is a fresh instance meanwhile, whose buffers the graphs keep."""
        assert self.model is not None and self.kv is not None and self.attention is not None
        assert self.kv.num_blocks > 0
        record = self.attention
        graphs = DecodeGraphs(
            self.stage.stage_idx, buckets or graph_buckets(MAX_GRAPH_BATCH),
            lambda why: record.fallback(why, strict=False),
        )  # fmt: skip
        hidden = None if self.stage.is_first else self.spec.hidden_size
        graphs.capture(
            self.model.forward, self.model.layers, self._attention_backend(), self.kv,
            self.max_blocks_per_seq, hidden, self.dtype, capture,
        )  # fmt: skip
        self.graphs = graphs
        return graphs

    def profile_activations(
        self, rows: int, sampled: int, in_flight: int, block_size: int, probe: MemoryProbe
    ) -> int:
        """``M_A`` of this stage measured by a profiling forward of ``rows`` rows, the last
        stage sampling ``sampled`` of them, with ``in_flight`` micro-batches in flight
        (Note [profiling forward], ``memory_probe.py``); before ``init_kv_cache``."""
        assert self.model is not None and self.kv is None, "after load_model, before the cache"
        if rows < 1:
            raise ValueError(f"a profiling forward needs rows >= 1, got {rows}")
        microbatch, num_blocks = profiling_microbatch(
            rows, max(1, min(sampled, rows)), self.max_model_len, block_size
        )
        self.init_kv_cache(num_blocks, block_size)
        hidden = None
        if not self.stage.is_first:
            hidden = torch.zeros(rows, self.spec.hidden_size, dtype=self.dtype, device=self.device)
        try:
            probe.reset_peak()
            base = probe.allocated()
            self.execute(microbatch, hidden)
            peak = probe.peak() - base
        finally:
            self.kv, self.graphs = None, None
            self.penalties = PenaltyState()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        waiting = (in_flight - 1) * rows * self.spec.hidden_size * self.dtype.itemsize
        return max(0, peak) + max(0, waiting)

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
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # --- one micro-batch -------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, microbatch: MicroBatch, hidden: torch.Tensor | None = None):
        """Run this stage on ``microbatch``. Returns hidden states ``[num_tokens, hidden]`` for the
        next stage, or on the last stage its ``MicroBatchResult`` (the sampled tokens)."""
        assert self.model is not None and self.kv is not None, "load_model/init_kv_cache first"
        self.clock.begin(microbatch.microbatch_id)
        try:
            return self._execute(microbatch, hidden)
        finally:
            self.clock.end(microbatch.microbatch_id)

    def _execute(self, microbatch: MicroBatch, hidden: torch.Tensor | None):
        assert self.model is not None and self.kv is not None
        token_ids, meta, rows = build_inputs(
            microbatch, self.block_size, self.device, self.backend, self.upload
        )
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
        bucket = self.graphs.plan(microbatch) if self.graphs is not None else None
        if bucket is not None:  # Note [decode graphs]
            assert self.graphs is not None
            out = self.graphs.replay(bucket, inputs, meta)
        else:
            out = self.model.forward(inputs, meta, self.kv)
        if not self.stage.is_last:
            return out
        return self._sample(microbatch, out, rows)

    def _sample(
        self, microbatch: MicroBatch, hidden: torch.Tensor, row_idx: torch.Tensor
    ) -> MicroBatchResult:
        """The last stage's result: each sampling sequence's token (and its log-probabilities
        if asked for), or its failure (non-finite logits: that request fails alone)."""
        assert self.model is not None
        rows = sample_rows(microbatch)
        result = MicroBatchResult()
        self.penalties.release(microbatch)
        self._prompt_logprobs(microbatch, hidden, result)
        if not rows:
            return result
        chunks = [c for c in microbatch.chunks if c.do_sample]
        logits = self.model.logits(hidden[row_idx])  # row_idx: ``rows`` on the device
        # every chunk's (do_sample: sampling_params is not None); the filter narrows the type
        params = [c.sampling_params for c in chunks if c.sampling_params is not None]
        num_outputs = [c.num_output_tokens for c in chunks]
        sampling_logits, kept, outputs = self._penalized(logits, chunks, result)
        sampling_logits = processed_logits(  # penalized rows: a copy already, changed in place
            sampling_logits,
            params,
            num_outputs,
            self.spec.eos_token_ids,
            in_place=sampling_logits is not logits,
            outputs=outputs,
        )
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

    def _penalized(
        self, logits: torch.Tensor, chunks: list, result: MicroBatchResult
    ) -> tuple[torch.Tensor, list[int], dict[int, list[int]]]:
        """The logits to sample from (penalized where asked; ``stages/worker/penalties.py``), the
        rows whose tokens the stage keeps (``SamplingParams.keeps_tokens``) and, for those
        with bad words, their output tokens so far. A row whose tokens the stage lacks fails
        its request."""
        kept, rows, histories = [], [], []
        outputs: dict[int, list[int]] = {}
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
            if p.bad_words_token_ids:
                outputs[i] = tokens[len(tokens) - c.num_output_tokens :]
            if p.has_penalties:
                rows.append(i)
                histories.append(tokens)
        if not rows:
            return logits, kept, outputs
        return apply_penalties(logits, rows, histories, [chunks[i] for i in rows]), kept, outputs
