"""The layer loop (``stages/model/layer_loop.py``: a stage's layers as one C call) gives the per-op
path's hidden states and KV cache bit for bit: prefill chunks (first and later, two in one
micro-batch), decode rows of mixed context lengths over shuffled block tables, and hybrids of
both; GQA with head_dim 16 (the decode kernel's AVX2 loop) and 64 (its AVX-512 path where the
CPU has it), Qwen2's QKV bias, first and non-first stages (whose input is left untouched).
It applies only where its kernels do, turns off with its switch, and refuses a position or
a KV slot outside its tables before it writes anything."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY_DIMS
from transformers import LlamaConfig

from sarathi_pp.checkpoint import load_model_spec
from sarathi_pp.microbatch import MicroBatch, ScheduledChunk
from sarathi_pp.stages.kernels.cpu import layer_loop as kernel_layer_loop
from sarathi_pp.stages.kernels.cpu import panel_gemm
from sarathi_pp.stages.kernels.cpu.paged_attention import load_kernel, load_prefill
from sarathi_pp.stages.loader.builtin import BYTE_VOCAB_SIZE, build_model_dir
from sarathi_pp.stages.model import layer_loop, linear
from sarathi_pp.stages.model.attention import CpuPagedAttention, TorchAttention
from sarathi_pp.stages.model.kv_cache import KVCache
from sarathi_pp.stages.model.llama import StageModel
from sarathi_pp.stages.worker.metadata import build_metadata

needs_loop = pytest.mark.skipif(
    kernel_layer_loop.load_loop() is None
    or panel_gemm.load_gemm() is None
    or load_kernel() is None
    or load_prefill() is None,
    reason="the layer loop needs its C kernels (a compiler; AVX2 + FMA)",
)
CPU = torch.device("cpu")
BLOCK = 4
NUM_BLOCKS = 96
MAX_POS = 256


@pytest.fixture(scope="module")
def head64_dir(tmp_path_factory):
    """Llama with head_dim 64 (4 heads, 2 KV heads over hidden 256)."""
    dims = {**TINY_DIMS, "hidden_size": 256, "intermediate_size": 320}
    return build_model_dir(
        tmp_path_factory.mktemp("loop") / "head64",
        LlamaConfig(**dims, tie_word_embeddings=False),
        5,
    )


@pytest.fixture
def packed(monkeypatch):
    """Every layer weight packed for the panel GEMM (the test models are below the size at
    which the real models' are), so the loop applies."""
    monkeypatch.setattr(linear, "MIN_PACKED_ELEMENTS", 1)


def stage(model_dir, first=True, last=True, layers=None) -> tuple[StageModel, KVCache]:
    spec = load_model_spec(model_dir)
    start, end = layers or (0, spec.num_layers)
    model = StageModel(spec, model_dir, start, end, first, last, torch.float32, CPU, MAX_POS)
    attention = CpuPagedAttention(spec.num_heads, spec.num_kv_heads, spec.head_dim)
    for layer in model.layers:
        layer.attention = attention
    kv = KVCache(model.num_layers, NUM_BLOCKS, BLOCK, spec.num_kv_heads, spec.head_dim,
                 torch.float32, CPU)  # fmt: skip
    return model, kv


class Sequences:
    """Sequences with shuffled block tables and random tokens; micro-batches over them."""

    def __init__(self, lengths: list[int], seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)
        order = torch.randperm(NUM_BLOCKS, generator=self.g).tolist()
        self.tables, self.tokens = [], []
        for n in lengths:
            need = -(-n // BLOCK)
            self.tables.append(tuple(order[:need]))
            order = order[need:]
            self.tokens.append(torch.randint(0, BYTE_VOCAB_SIZE, (n,), generator=self.g).tolist())

    def chunk(self, seq: int, start: int, end: int, prefill: bool = True) -> ScheduledChunk:
        tokens = tuple(self.tokens[seq][start:end])
        return ScheduledChunk(seq, start, tokens, prefill, self.tables[seq])


def plan(seqs: Sequences) -> list[MicroBatch]:
    """Micro-batches that fill the sequences' caches chunk by chunk and then decode: first
    chunks, later chunks beside decodes (hybrid), two chunks at once, decode-only."""
    c = seqs.chunk
    steps = [
        [c(0, 0, 13), c(1, 0, 9)],  # two first chunks
        [c(0, 13, 30), c(2, 0, 21)],  # a later chunk over a cached prefix
        [c(1, 9, 40), c(0, 30, 31, False), c(2, 21, 22, False)],  # hybrid
        [c(3, 0, 5), c(0, 31, 32, False), c(1, 40, 41, False), c(2, 22, 23, False)],
        [c(0, 32, 33, False), c(1, 41, 42, False), c(2, 23, 24, False)],  # decode-only
    ]
    return [MicroBatch(i, tuple(chunks)) for i, chunks in enumerate(steps)]


def inputs(model: StageModel, mb: MicroBatch, meta_tokens: torch.Tensor, seed: int):
    if model.is_first:
        return meta_tokens
    g = torch.Generator().manual_seed(seed)
    return torch.randn(mb.num_tokens, model.spec.hidden_size, generator=g) * 3


def run_both(model_dir, first=True, layers=None):
    """Each micro-batch through the loop (one cache) and op by op (another); the hidden states
    and the caches compared after every step."""
    model, kv = stage(model_dir, first=first, layers=layers)
    _, kv_ref = stage(model_dir, first=first, layers=layers)
    loop = model.layer_loop(kv)
    assert loop is not None
    seqs = Sequences([33, 42, 24, 5], seed=7)
    outs = []
    for i, mb in enumerate(plan(seqs)):
        tokens, meta = build_metadata(mb, BLOCK, CPU, "cpu_paged")
        x = inputs(model, mb, tokens, seed=i)
        before = x.clone()
        got = model.forward(x, meta, kv)
        ref = model.forward_layers(
            F.embedding(x, model.embed) if model.is_first else x, meta, kv_ref
        )
        assert torch.equal(got, ref), (i, (got - ref).abs().max())
        assert torch.equal(x, before)  # the stage's input is not changed
        for a, b in zip(kv.k + kv.v, kv_ref.k + kv_ref.v, strict=True):
            assert torch.equal(a, b), i
        outs.append(got)
    assert all(o.std() > 0.1 for o in outs)  # not all zero or constant
    return model, kv


@needs_loop
@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_the_loop_equals_the_op_by_op_path(tiny_model, packed, variant):
    model, _ = run_both(tiny_model(variant))
    if variant == "qwen2":
        assert model.layers[0].qkv.bias is not None


@needs_loop
def test_head_dim_64_and_a_later_stage(head64_dir, packed):
    run_both(head64_dir)
    run_both(head64_dir, first=False, layers=(1, 2))


@needs_loop
def test_the_loop_runs_where_its_kernels_do(tiny_model, packed, monkeypatch):
    model_dir = tiny_model("llama")
    model, kv = stage(model_dir)
    assert model.layer_loop(kv) is not None
    # a backend that gathers, a cache of another dtype, F.linear weights, the switch: op by op
    model, kv = stage(model_dir)
    for layer in model.layers:
        layer.attention = TorchAttention(4, 2, 16)
    assert model.layer_loop(kv) is None
    model, kv = stage(model_dir)
    other = KVCache(model.num_layers, 8, BLOCK, 2, 16, torch.float64, CPU)
    assert model.layer_loop(other) is None
    monkeypatch.setenv(layer_loop.SWITCH, "0")
    model, kv = stage(model_dir)
    assert model.layer_loop(kv) is None
    monkeypatch.delenv(layer_loop.SWITCH)
    monkeypatch.setattr(linear, "MIN_PACKED_ELEMENTS", 1 << 30)  # F.linear weights
    model, kv = stage(model_dir)
    assert model.layer_loop(kv) is None


@needs_loop
def test_without_the_prefill_kernel_prefill_rows_go_op_by_op(tiny_model, packed):
    model_dir = tiny_model("llama")
    model, kv = stage(model_dir)
    _, kv_ref = stage(model_dir)
    loop = model.layer_loop(kv)
    loop.has_prefill = False
    seqs = Sequences([20, 6], seed=3)
    prefill = MicroBatch(0, (seqs.chunk(0, 0, 20), seqs.chunk(1, 0, 5)))
    decode = MicroBatch(1, (seqs.chunk(1, 5, 6, False),))
    for mb, expect in ((prefill, False), (decode, True)):
        tokens, meta = build_metadata(mb, BLOCK, CPU, "cpu_paged")
        assert loop.applies(meta) is expect
        got = model.forward(tokens, meta, kv)
        ref = model.forward_layers(F.embedding(tokens, model.embed), meta, kv_ref)
        assert torch.equal(got, ref)


@needs_loop
def test_a_position_or_slot_outside_the_tables_is_refused(tiny_model, packed):
    model, kv = stage(tiny_model("llama"))
    seqs = Sequences([8], seed=1)
    mb = MicroBatch(0, (seqs.chunk(0, 0, 8),))
    tokens, meta = build_metadata(mb, BLOCK, CPU, "cpu_paged")
    meta.positions = meta.positions + MAX_POS - 4  # the last rows past the rotary tables
    with pytest.raises(IndexError, match=rf"outside \[0, {MAX_POS}\) \(min {MAX_POS - 4}, max"):
        model.forward(tokens, meta, kv)
    tokens, meta = build_metadata(mb, BLOCK, CPU, "cpu_paged")
    meta.slot_mapping = meta.slot_mapping.clone()
    meta.slot_mapping[-1] = NUM_BLOCKS * BLOCK
    before = [t.clone() for t in kv.k]
    with pytest.raises(IndexError, match=r"KV slot outside \[0, 384\)"):
        model.forward(tokens, meta, kv)
    assert all(torch.equal(a, b) for a, b in zip(kv.k, before, strict=True))  # nothing written
