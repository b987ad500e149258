"""Decode attention that reads the paged KV cache in place equals SDPA over the same K/V laid
out contiguously (both its AVX-512 and AVX2 builds): shuffled (non-contiguous) block tables,
a partial last block, GQA, head_dim 32 to 256, mixed context lengths, block sizes 1, 5, 16
and 256; so does prefill-chunk attention (both builds), first and later chunks, block sizes
1, 5, 16 and 256; and a whole hybrid micro-batch through the ``cpu_paged`` backend equals
the ``torch`` backend. Without the kernel the backend falls back to ``torch``. FlexAttention
(``flex_paged``) and the backend choice: ``test_flex_paged.py``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from sarathi_pp.microbatch import MicroBatch, ScheduledChunk
from sarathi_pp.stages.kernels.cpu import build as cpu_kernels
from sarathi_pp.stages.kernels.cpu import paged_attention
from sarathi_pp.stages.model.attention import ATTENTION_BACKENDS, select_backend
from sarathi_pp.stages.worker.metadata import build_metadata

needs_kernel = pytest.mark.skipif(
    paged_attention.load_kernel() is None, reason="no C compiler: the CPU paged kernel cannot build"
)


def paged_case(lens: list[int], block_size: int, heads: int, kv_heads: int, head_dim: int):
    """A cache whose blocks are handed out in shuffled order, and each sequence's K/V."""
    g = torch.Generator().manual_seed(block_size * 1000 + len(lens))
    tables_needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(tables_needed) + 3  # a few blocks nobody owns
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=g)
    order = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(tables_needed)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.long)
    for i, n in enumerate(tables_needed):
        tables[i, :n] = torch.tensor(order[:n])
        order = order[n:]
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    return q, k_cache, v_cache, tables


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` (the kernel follows it), then restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def reference(q, k_cache, v_cache, tables, lens, block_size):
    """SDPA per sequence over its K/V copied out contiguously."""
    outs = []
    for i, n in enumerate(lens):
        slots = (tables[i, :, None] * block_size + torch.arange(block_size)).flatten()[:n]
        k = k_cache[slots].transpose(0, 1)[None]  # [1, kv_heads, n, d]
        v = v_cache[slots].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(
            q[i][None, :, None], k, v, scale=q.shape[-1] ** -0.5, enable_gqa=True
        )
        outs.append(o[0, :, 0])
    return torch.stack(outs)


def kernel_builds(native, build) -> dict[str, object]:
    """A kernel's builds for this CPU: ``native`` (None: it does not build here) and, on an
    AVX-512 CPU, its AVX2 path too (``build(("-mno-avx512f",))``), so both paths are checked
    wherever AVX-512 runs."""
    if native is None:
        return {}
    kernels = {"native": native}
    if "avx512f" in cpu_kernels.cpu_flags():
        kernels["avx2"] = build(("-mno-avx512f",))
    return kernels


# the decode kernel's AVX-512 path takes head_dim a multiple of 64, the AVX2 loop the rest
DECODE_KERNELS = kernel_builds(paged_attention.load_kernel(), paged_attention.build_decode)
each_decode_kernel = pytest.mark.parametrize("kernel", sorted(DECODE_KERNELS) or ["none"])


@needs_kernel
@each_decode_kernel
@pytest.mark.parametrize("block_size", [1, 5, 16, 256])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [
        (8, 2, 64),
        (4, 4, 128),
        (6, 3, 40),
        (9, 3, 64),
        (10, 2, 64),
        (16, 2, 32),
        (2, 2, 96),
        (16, 2, 128),
        (4, 2, 256),
    ],
)  # GQA 4 heads per KV head; MHA; an odd head_dim (the generic loop); 3, 5 (4 + 1) and 8
# (4 + 4) heads per KV head (V is weighed for up to 4 heads at once); MHA at a head_dim the
# one-head vector pass does not divide (its plain loop); 8 heads per KV head at 128 (two
# 64-column passes of the AVX-512 V loop) and 2 at 256 (Gemma's head_dim: four passes, 16
# registers of q per key). Block size 5: blocks of fewer than 16 keys.
def test_paged_decode_equals_sdpa(kernel, block_size, heads, kv_heads, head_dim):
    lens = [1, 17, 300, block_size, block_size + 1, 513]  # mixed, partial last blocks
    q, k_cache, v_cache, tables = paged_case(lens, block_size, heads, kv_heads, head_dim)
    lens_t = torch.tensor(lens)
    out = paged_attention.paged_decode(
        q, k_cache, v_cache, tables, lens_t, block_size, head_dim**-0.5, DECODE_KERNELS[kernel]
    )
    ref = reference(q, k_cache, v_cache, tables, lens, block_size)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


@needs_kernel
def test_paged_decode_one_thread_and_many_agree():
    lens = [5, 900, 2, 1200, 700]  # 2.9 M multiply-adds: enough to split over threads
    q, k_cache, v_cache, tables = paged_case(lens, 16, 8, 2, 64)
    run = lambda: paged_attention.paged_decode(  # noqa: E731
        q, k_cache, v_cache, tables, torch.tensor(lens), 16, 0.125
    )
    with torch_threads(1):
        one = run()
    with torch_threads(3):
        many = run()
    assert torch.equal(one, many)  # each sequence is computed whole by one thread


@needs_kernel
@each_decode_kernel
@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize(
    "lens", [[5000], [2500, 2], [4000, 40, 5]]
)  # >= 1 M multiply-adds a thread
def test_fewer_sequences_than_threads_split_their_blocks(kernel, block_size, lens):
    """With fewer sequences than threads each sequence's blocks are split over the threads
    (partial results merged by their maxima and sums): still SDPA's values, parts that hold
    no block included (a 2-token sequence split in 2)."""
    q, k_cache, v_cache, tables = paged_case(lens, block_size, 16, 4, 64)
    with torch_threads(4):
        out = paged_attention.paged_decode(
            q, k_cache, v_cache, tables, torch.tensor(lens), block_size, 0.125,
            DECODE_KERNELS[kernel],
        )  # fmt: skip
    ref = reference(q, k_cache, v_cache, tables, lens, block_size)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


PREFILL_KERNELS = kernel_builds(paged_attention.load_prefill(), paged_attention.build_prefill)
needs_prefill_kernel = pytest.mark.skipif(
    not PREFILL_KERNELS,
    reason="the prefill kernel needs AVX-512 or AVX2 + FMA and a C compiler (this CPU's "
    f"flags: {sorted(f for f in cpu_kernels.cpu_flags() if f.startswith(('avx', 'fma')))})",
)
each_prefill_kernel = pytest.mark.parametrize("kernel", sorted(PREFILL_KERNELS) or ["none"])


def prefill_reference(q, k_cache, v_cache, blocks, start, block_size):
    """SDPA over the chunk's context copied out contiguously, causal from ``start``."""
    end = start + q.shape[0]
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:end]
    k = k_cache[slots].transpose(0, 1)[None]
    v = v_cache[slots].transpose(0, 1)[None]
    mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k, v, attn_mask=mask[None, None], scale=q.shape[-1] ** -0.5,
        enable_gqa=True,
    )  # fmt: skip
    return o[0].transpose(0, 1)


def prefill_case(start, n, block_size, heads, kv_heads, head_dim):
    """One chunk's queries and ``paged_case``'s cache for a sequence of its context."""
    _, k_cache, v_cache, tables = paged_case([start + n], block_size, heads, kv_heads, head_dim)
    g = torch.Generator().manual_seed(start * 7 + n)
    q = torch.randn(n, heads, head_dim, generator=g) * 2  # sharper softmax than N(0, 1)
    return q, k_cache, v_cache, tables[0]


@needs_prefill_kernel
@each_prefill_kernel
@pytest.mark.parametrize("block_size", [1, 5, 16, 256])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(8, 2, 64), (4, 4, 128), (6, 2, 40), (16, 2, 32), (2, 2, 96)],
)  # GQA 4, MHA, 3 query heads per KV head (tiles cut across tokens) at an odd head_dim, 8, MHA
@pytest.mark.parametrize(("start", "n"), [(0, 1), (0, 37), (20, 12), (300, 45), (250, 256)])
def test_paged_prefill_equals_sdpa(kernel, block_size, heads, kv_heads, head_dim, start, n):
    """A chunk (first or later, partial tiles and blocks) over shuffled blocks; block sizes
    that hold a step's 16 (8 with AVX2) keys in place (16, 256) and those copied out first
    (1, 5)."""
    q, k_cache, v_cache, blocks = prefill_case(start, n, block_size, heads, kv_heads, head_dim)
    fn = PREFILL_KERNELS[kernel]
    out = paged_attention.paged_prefill(
        q, k_cache, v_cache, blocks, start, block_size, head_dim**-0.5, kernel=fn
    )
    assert_as_exact_as_sdpa(out, q, k_cache, v_cache, blocks, start, block_size)


def assert_as_exact_as_sdpa(out, q, k_cache, v_cache, blocks, start, block_size):
    """``out`` within 1e-5 of attention in float64, and no further from it than 3x SDPA's
    float32 result is (+ 1e-6): the kernel sums in another order than SDPA, so the two
    float32 results differ by a few ulps either way (up to ~4e-6 on these cases)."""
    exact = prefill_reference(
        q.double(), k_cache.double(), v_cache.double(), blocks, start, block_size
    )
    sdpa = prefill_reference(q, k_cache, v_cache, blocks, start, block_size)
    torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-5)
    ours_err = (out.double() - exact).abs().max().item()
    sdpa_err = (sdpa.double() - exact).abs().max().item()
    assert ours_err <= 3 * sdpa_err + 1e-6, (ours_err, sdpa_err)


@needs_prefill_kernel
@each_prefill_kernel
def test_paged_prefill_reads_strided_rows_and_threads_agree(kernel):
    """Query rows at a stride (a view into wider rows) read in place; one thread and many give
    the same bits (each tile is computed whole by one thread)."""
    start, n, heads, kv_heads, d = 700, 200, 8, 2, 64
    q, k_cache, v_cache, blocks = prefill_case(start, n, 16, heads, kv_heads, d)
    wide = torch.randn(n, heads * d + 96)
    wide[:, : heads * d] = q.reshape(n, -1)
    strided = wide[:, : heads * d].view(n, heads, d)
    assert strided.stride(0) == heads * d + 96
    fn = PREFILL_KERNELS[kernel]
    with torch_threads(1):
        one = paged_attention.paged_prefill(strided, k_cache, v_cache, blocks, start, 16, 0.125, fn)
    with torch_threads(3):
        many = paged_attention.paged_prefill(
            strided, k_cache, v_cache, blocks, start, 16, 0.125, fn
        )
    assert torch.equal(one, many)
    assert_as_exact_as_sdpa(one, q, k_cache, v_cache, blocks, start, 16)


torch_libgomp = cpu_kernels.loaded_libgomp()


@needs_kernel
@pytest.mark.skipif(
    len(torch_libgomp) != 1, reason=f"torch's OpenMP runtime is not one libgomp: {torch_libgomp}"
)
def test_kernel_runs_on_torchs_openmp_threads():
    """Where torch runs on libgomp the kernel is its OpenMP build, linked to the libgomp
    torch loaded: no second runtime (whose threads would compete with torch's)."""
    assert paged_attention.kernel_threads().startswith("openmp")
    assert cpu_kernels.loaded_libgomp() == torch_libgomp


def test_pthreads_build_equals_sdpa(monkeypatch, tmp_path):
    """The build for processes whose OpenMP runtime is not libgomp: its own threads."""
    monkeypatch.setenv("SARATHI_PP_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "loaded_libgomp", lambda: [])
    paged_attention.load_kernel.cache_clear()
    try:
        if paged_attention.load_kernel() is None:
            pytest.skip("no C compiler: the CPU paged kernel cannot build")
        assert paged_attention.kernel_threads() == "pthreads"
        lens = [900, 1200, 33, 700]
        q, k_cache, v_cache, tables = paged_case(lens, 16, 8, 2, 64)
        with torch_threads(2):
            out = paged_attention.paged_decode(
                q, k_cache, v_cache, tables, torch.tensor(lens), 16, 0.125
            )
        ref = reference(q, k_cache, v_cache, tables, lens, 16)
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
        if paged_attention.load_prefill() is not None:  # the prefill kernel of the same library
            q, k_cache, v_cache, blocks = prefill_case(500, 300, 16, 8, 2, 64)
            with torch_threads(2):
                out = paged_attention.paged_prefill(q, k_cache, v_cache, blocks, 500, 16, 0.125)
            assert_as_exact_as_sdpa(out, q, k_cache, v_cache, blocks, 500, 16)
    finally:
        paged_attention.load_kernel.cache_clear()


def hybrid_microbatch(block_size: int) -> tuple[MicroBatch, int]:
    """A prefill chunk over a cached prefix plus decodes of mixed lengths, shuffled tables."""
    g = torch.Generator().manual_seed(7)
    num_blocks = 64
    order = torch.randperm(num_blocks, generator=g).tolist()
    chunks = []
    for seq_id, (start, n, prefill) in enumerate(
        [(20, 12, True), (0, 1, False), (33, 1, False), (47, 1, False)]
    ):
        need = -(-(start + n) // block_size)
        table, order = tuple(order[:need]), order[need:]
        tokens = tuple(range(n))
        chunks.append(ScheduledChunk(seq_id, start, tokens, prefill, table))
    return MicroBatch(1, tuple(chunks)), num_blocks


@needs_kernel
@pytest.mark.parametrize("block_size", [1, 16])
def test_cpu_paged_backend_equals_torch_backend(block_size):
    microbatch, num_blocks = hybrid_microbatch(block_size)
    heads, kv_heads, d = 8, 2, 16
    g = torch.Generator().manual_seed(1)
    n = microbatch.num_tokens
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (heads, kv_heads, kv_heads))
    outs = {}
    for name in ("torch", "cpu_paged"):
        torch.manual_seed(0)
        k_cache = torch.randn(num_blocks * block_size, kv_heads, d, generator=g.manual_seed(2))
        v_cache = torch.randn(num_blocks * block_size, kv_heads, d, generator=g.manual_seed(3))
        _, meta = build_metadata(microbatch, block_size, torch.device("cpu"), name)
        outs[name] = ATTENTION_BACKENDS[name](heads, kv_heads, d).forward(
            q, k, v, k_cache, v_cache, meta
        )
    torch.testing.assert_close(outs["cpu_paged"], outs["torch"], atol=2e-6, rtol=1e-5)


def test_without_the_kernel_cpu_falls_back_to_torch(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("SARATHI_PP_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    paged_attention.load_kernel.cache_clear()
    try:
        assert paged_attention.load_kernel() is None
        assert "using gather + SDPA" in caplog.text
        assert select_backend(torch.device("cpu"), 16, torch.float32) == "torch"
        monkeypatch.setenv("SARATHI_PP_CPU_KERNEL", "0")
        paged_attention.load_kernel.cache_clear()
        assert paged_attention.load_kernel() is None
    finally:
        paged_attention.load_kernel.cache_clear()
    assert not list(tmp_path.iterdir())  # nothing half-built left behind


@needs_kernel
def test_select_backend_on_cpu():
    cpu = torch.device("cpu")
    assert select_backend(cpu, 16, torch.float32) == "cpu_paged"
    assert select_backend(cpu, 16, torch.bfloat16) == "torch"  # the kernel is float32 only
