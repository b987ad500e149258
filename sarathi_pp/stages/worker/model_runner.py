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

from sarathi_pp.microbatch import AttentionReport, MicroBatch
from sarathi_pp.model_spec import ModelSpec
from sarathi_pp.placement import Placement
from sarathi_pp.stage_memory import StageMemory
from sarathi_pp.stages.model.attention import TorchAttention, make_backend
from sarathi_pp.stages.model.backend_choice import AttentionRecord, choose_backend
from sarathi_pp.stages.model.kv_cache import KVCache
from sarathi_pp.stages.model.llama import StageModel
from sarathi_pp.stages.worker.cuda_graphs import DecodeGraphs, cuda_capture, graph_buckets
from sarathi_pp.stages.worker.device import check_free_cuda_memory
from sarathi_pp.stages.worker.last_stage import LastStageSampler
from sarathi_pp.stages.worker.memory_probe import MemoryProbe, profiling_microbatch
from sarathi_pp.stages.worker.metadata import build_inputs
from sarathi_pp.stages.worker.penalties import PenaltyState
from sarathi_pp.stages.worker.structured import GrammarMasks
from sarathi_pp.stages.worker.timing import StageClock, WallClock, stage_clock
from sarathi_pp.stages.worker.upload import PinnedUpload, Upload

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
        self.graphs: DecodeGraphs | None = None  # model.enforce_eager false, on CUDA
        # Note [one upload per micro-batch] (upload.py); a test swaps in a counting one
        self.upload: Upload = PinnedUpload(self.device)
        # Note [compute spans from CUDA events] (timing.py); CUDA's made with the KV cache
        self.clock: StageClock = WallClock()
        # the last stage's penalties and structured output (``last_stage.py``)
        self.sampling = LastStageSampler(spec, self.device, tokenizer_dir or model_dir)

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
            self.sampling.reset()
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
        self.sampling.reset()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def penalties(self) -> PenaltyState:
        return self.sampling.penalties

    @property
    def grammar(self) -> GrammarMasks:
        return self.sampling.grammar

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
        prep = self.sampling.prepare(microbatch) if self.stage.is_last else None
        bucket = self.graphs.plan(microbatch) if self.graphs is not None else None
        if bucket is not None:  # Note [decode graphs]
            assert self.graphs is not None
            out = self.graphs.replay(bucket, inputs, meta)
        else:
            out = self.model.forward(inputs, meta, self.kv)
        if prep is None:
            return out
        return self.sampling.sample(self.model, microbatch, out, rows, prep)
