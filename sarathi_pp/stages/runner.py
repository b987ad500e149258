"""Turn a micro-batch into tensors and run one stage on it.

``StageWorker`` owns a stage's layers and KV cache. The same class runs in-process (one
stage), inside a Ray actor, or inside a torchrun rank: it only needs a micro-batch and, on stages
after the first, the hidden states received from the previous stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from sarathi_pp.config import CacheConfig
from sarathi_pp.executor import StepResult
from sarathi_pp.memory import StageMemory
from sarathi_pp.model_spec import ModelSpec
from sarathi_pp.microbatch import MicroBatch
from sarathi_pp.stages.attention import AttentionMetadata, PrefillSlice, select_backend
from sarathi_pp.stages.kv_cache import KVCache
from sarathi_pp.stages.model import StageModel
from sarathi_pp.stages.sampler import INVALID_TOKEN, sample

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

    @property
    def is_first(self) -> bool:
        return self.stage_idx == 0

    @property
    def is_last(self) -> bool:
        return self.stage_idx == self.num_stages - 1


def _slots(block_table: torch.Tensor, block_size: int, num_tokens: int) -> torch.Tensor:
    """Slot ids of positions ``[0, num_tokens)`` of a sequence, from its block table."""
    offsets = torch.arange(block_size, device=block_table.device)
    return (block_table.unsqueeze(-1) * block_size + offsets).flatten(-2)[..., :num_tokens]


def build_metadata(
    microbatch: MicroBatch, block_size: int, device: torch.device, backend: str = "torch"
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Token ids ``[num_tokens]`` and attention metadata for ``microbatch`` (prefills first)."""
    tokens: list[int] = []
    positions: list[torch.Tensor] = []
    slots: list[torch.Tensor] = []
    prefills: list[PrefillSlice] = []
    row = 0
    decodes = [c for c in microbatch.chunks if not c.is_prefill]
    for c in microbatch.chunks:
        if not c.is_prefill:
            continue
        num_ctx_blocks = -(-c.end // block_size)
        bt = torch.tensor(c.block_table[:num_ctx_blocks], dtype=torch.long, device=device)
        tokens += c.token_ids
        positions.append(torch.arange(c.start, c.end, device=device))
        slots.append(_slots(bt, block_size, c.end)[c.start :])
        prefills.append(PrefillSlice(row, row + c.num_tokens, c.start, bt))
        row += c.num_tokens
    decode_blocks = decode_mask = None
    if decodes:
        tokens += [c.token_ids[0] for c in decodes]
        pos = [c.start for c in decodes]
        pos_t = torch.tensor(pos, device=device)
        positions.append(pos_t)
        max_blocks = max(-(-(p + 1) // block_size) for p in pos)
        tables = [c.block_table[:max_blocks] for c in decodes]
        padded = [list(t) + [0] * (max_blocks - len(t)) for t in tables]  # 0: masked out
        decode_blocks = torch.tensor(padded, dtype=torch.long, device=device)  # [num_decodes, max_blocks]
        # slot of each decode token: its block's id * block_size + offset
        own_block = decode_blocks.gather(1, (pos_t // block_size).unsqueeze(1)).squeeze(1)
        slots.append(own_block * block_size + pos_t % block_size)
        arange = torch.arange(max_blocks * block_size, device=device)
        decode_mask = (arange.unsqueeze(0) <= pos_t.unsqueeze(1))[:, None, None, :]
    meta = AttentionMetadata(
        positions=torch.cat(positions),
        slot_mapping=torch.cat(slots),
        num_prefill_tokens=row,
        prefills=prefills,
        decode_blocks=decode_blocks,
        decode_mask=decode_mask,
        block_size=block_size,
    )
    if backend == "flash_attn":
        _add_flash_metadata(meta, microbatch, device)
    return torch.tensor(tokens, dtype=torch.long, device=device), meta


def _add_flash_metadata(meta: AttentionMetadata, microbatch: MicroBatch, device: torch.device) -> None:
    chunks = list(microbatch.chunks)  # prefills first, then decodes: the same order as the rows
    max_blocks = max(len(c.block_table) for c in chunks)
    tables = [list(c.block_table) + [0] * (max_blocks - len(c.block_table)) for c in chunks]
    meta.block_tables = torch.tensor(tables, dtype=torch.int32, device=device)
    meta.context_lens = torch.tensor([c.end for c in chunks], dtype=torch.int32, device=device)
    q_lens = [c.num_tokens for c in chunks if c.is_prefill]
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    meta.cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device=device)
    meta.max_query_len = max(q_lens, default=0)
    meta.max_context_len = max(c.end for c in chunks)


def sample_rows(microbatch: MicroBatch) -> list[int]:
    """Row index of the last token of every chunk that samples."""
    rows, row = [], 0
    for c in microbatch.chunks:
        row += c.num_tokens
        if c.do_sample:
            rows.append(row - 1)
    return rows


class StageWorker:
    def __init__(self, spec: ModelSpec, model_dir: str | Path, stage: StageSpec, max_model_len: int) -> None:
        self.spec = spec
        self.stage = stage
        self.device = torch.device(stage.device)
        self.dtype = TORCH_DTYPES[stage.dtype]
        self.max_model_len = max_model_len
        self.model_dir = str(model_dir)
        self.model: StageModel | None = None
        self.kv: KVCache | None = None
        self.backend = "torch"

    # --- set-up, in two steps: weights first, then the KV cache sized from what is left ---
    def load_model(self) -> int:
        """Load this stage's weights; returns their size in bytes (M_S)."""
        s = self.stage
        self.model = StageModel(
            self.spec, self.model_dir, s.layer_start, s.layer_end, s.is_first, s.is_last,
            self.dtype, self.device, max_positions=self.max_model_len + 1,
        )
        return self.model.param_bytes()

    def memory(self, param_bytes: int, cache: CacheConfig) -> StageMemory:
        """This stage's M_S, m_kv and M_G (CPU: the configured budget; CUDA: the device's
        memory x ``gpu_memory_utilization``)."""
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            budget = int(total * cache.gpu_memory_utilization)
        else:
            budget = cache.cpu_memory_budget
        s = self.stage
        m_kv = self.spec.kv_bytes_per_token(s.layer_end - s.layer_start, s.dtype)
        return StageMemory(s.stage_idx, param_bytes, m_kv, budget)

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        assert self.model is not None
        s = self.spec
        self.kv = KVCache(
            self.model.num_layers, num_blocks, block_size, s.num_kv_heads, s.head_dim, self.dtype, self.device
        )
        self.block_size = block_size
        self.backend = select_backend(self.device, block_size)
        if self.backend != "torch":
            from sarathi_pp.stages.attention import ATTENTION_BACKENDS

            attention = ATTENTION_BACKENDS[self.backend](s.num_heads, s.num_kv_heads, s.head_dim)
            for layer in self.model.layers:
                layer.attention = attention

    # --- one micro-batch -------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, microbatch: MicroBatch, hidden: torch.Tensor | None = None):
        """Run this stage on ``microbatch``. Returns hidden states ``[num_tokens, hidden]`` for the
        next stage, or on the last stage the sampled tokens ``{seq_id: token_id}``."""
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
        out = self.model.forward(inputs, meta, self.kv)
        if not self.stage.is_last:
            return out
        return self._sample(microbatch, out)

    def _sample(self, microbatch: MicroBatch, hidden: torch.Tensor) -> dict[int, int]:
        rows = sample_rows(microbatch)
        if not rows:
            return {}
        chunks = [c for c in microbatch.chunks if c.do_sample]
        logits = self.model.logits(hidden[torch.tensor(rows, device=self.device)])
        params = [c.sampling_params for c in chunks]
        tokens = sample(logits, params, [c.num_output_tokens for c in chunks])
        return {c.seq_id: t for c, t in zip(chunks, tokens)}


def to_step_result(sampled: dict[int, int]) -> StepResult:
    """Split the last stage's tokens into samples and per-request failures."""
    result = StepResult()
    for seq_id, token in sampled.items():
        if token == INVALID_TOKEN:
            result.errors[seq_id] = "the model produced non-finite logits"
        else:
            result.sampled[seq_id] = token
    return result
