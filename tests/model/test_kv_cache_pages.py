"""The CPU KV cache (``kv_cache._zeros``): zeros whose pages are mapped only as blocks are
written (an anonymous mapping of its own, whatever the C heap holds), in transparent huge
pages where Linux offers them on request: ``KVCache`` advises ``MADV_HUGEPAGE`` for it (as
numpy does for its large buffers; torch's allocator does not unless
``THP_MEM_ALLOC_ENABLE=1``). Attention reads blocks scattered over the cache, so a
replacement allocator must keep both properties: one layer of 32 x 1k decode attention ran
3-14% slower on a cache of 4 KiB pages (interleaved in one process). The packed weights ask for
huge pages too (``host_pages.empty_huge``: aligned to 2 MB), unless switched off."""

from __future__ import annotations

import ctypes
import mmap
import sys
from pathlib import Path

import pytest
import torch

from sarathi_pp.stages.model import host_pages, kv_cache
from sarathi_pp.stages.model.kv_cache import KVCache

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def rss_mib() -> float:
    """This process's resident memory now (not its high-water mark)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def thp_mode() -> str | None:
    """The bracketed THP mode (``always``, ``madvise``, ``never``), or None without THP."""
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def smaps_field(address: int, field: str) -> str | None:
    """``field`` of the mapping that holds ``address`` in /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    return None


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or thp_mode() in (None, "never"),
    reason=f"transparent huge pages not offered here (mode {thp_mode()})",
)
def test_cpu_cache_is_eligible_for_huge_pages_and_zero():
    cache = KVCache(1, 1024, 16, 4, 64, torch.float32, torch.device("cpu"))  # 16 MiB per K
    k, _ = cache.flat(0)
    assert smaps_field(k.data_ptr() + (8 << 20), "THPeligible") == "1"
    assert torch.count_nonzero(k) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_cpu_cache_costs_memory_as_blocks_are_written():
    """A 2 GiB cache (two layers' K and V, 512 MiB each) maps next to nothing until written."""
    before = rss_mib()
    cache = KVCache(2, 32768, 16, 4, 64, torch.float32, torch.device("cpu"))
    k, v = cache.flat(1)
    k[:16].fill_(1.0)  # one block
    grown_mib = rss_mib() - before
    assert grown_mib < 64, grown_mib
    assert float(k[:16].sum()) == 16 * 4 * 64 and float(v.abs().max()) == 0.0


def mapped_mib(t: torch.Tensor) -> float:
    """Resident MiB of tensor ``t``'s own pages (``mincore`` over its address range). Not the
    ``Rss`` of its mapping in smaps: the kernel merges neighbouring anonymous mappings of
    the same flags, so a lazy cache next to a prefaulted one read as resident (31.9 MiB of
    32 in a CI run, depending on where earlier tests left holes in the address space)."""
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    end = -(-(t.data_ptr() + t.numel() * t.element_size()) // page) * page
    vec = (ctypes.c_ubyte * ((end - start) // page))()
    libc = host_pages.libc()  # the project's handle on the C library, errno kept
    assert libc is not None, "no C library found"
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec) * page / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore: Linux's")
def test_cpu_cache_is_unmapped_even_where_the_c_heap_has_room():
    """The state earlier tests left in a CI run: a freed mmapped chunk raised glibc's mmap
    threshold, the next large buffers came from the heap and were freed, leaving a free
    region larger than a layer's K. calloc would hand that region back and clear it (32 MiB
    resident before any block was written); the cache's own mapping stays unmapped."""
    big = torch.ones(30 << 20, dtype=torch.uint8)  # mmapped; its free raises the threshold
    del big
    heap = [torch.ones(20 << 20, dtype=torch.uint8) for _ in range(3)]  # now from the heap
    fence = torch.ones(1 << 20, dtype=torch.uint8)  # keeps the freed region off the heap's top
    del heap
    cache = KVCache(1, 2048, 16, 4, 64, torch.float32, torch.device("cpu"))  # 32 MiB per K
    for t in (cache.k[0], cache.v[0]):
        assert mapped_mib(t) < 8, mapped_mib(t)
        assert torch.count_nonzero(t) == 0
    del fence


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and madvise: Linux's")
@pytest.mark.parametrize("how", ["madvise", "writes"])
def test_prefault_maps_every_page_and_keeps_the_zeros(how, monkeypatch):
    """``cache.prefault``: the whole cache is resident before any block is written, by
    ``MADV_POPULATE_WRITE`` or, where the kernel lacks it, by writing every page."""
    if how == "writes":
        monkeypatch.setattr(kv_cache, "_madvise_populate", lambda addr, nbytes: False)
    lazy = KVCache(1, 2048, 16, 4, 64, torch.float32, torch.device("cpu"))  # 32 MiB per K
    cache = KVCache(1, 2048, 16, 4, 64, torch.float32, torch.device("cpu"), prefault=True)
    assert mapped_mib(lazy.k[0]) < 8
    for t in (cache.k[0], cache.v[0]):
        assert mapped_mib(t) > 31.9, mapped_mib(t)
        assert torch.count_nonzero(t) == 0
    assert cache.nbytes() == 2 * (32 << 20)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_prefault_that_cannot_map_names_the_size():
    """The kernel's ENOMEM becomes a ``MemoryError`` naming the bytes and the settings to
    lower (here: a range with nothing mapped behind it, which madvise reports the same way
    as memory that cannot be had)."""
    region = mmap.mmap(-1, 1 << 20)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(region))
    region.close()  # unmapped now: the addresses stay, the pages are gone
    try:
        ok = kv_cache._madvise_populate(addr, 1 << 20)
    except MemoryError as e:
        assert "1048576 bytes" in str(e) and "cpu_memory_budget" in str(e)
    else:
        assert not ok, "an unmapped range was populated"
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")


def test_prefault_through_the_engine_maps_the_cache_and_changes_no_output(llama_dir):
    """``prefault_kv_cache`` reaches the stage's cache. 20000 blocks = 39 MiB per K of the
    tiny model: above glibc's largest mmap threshold (32 MiB), so each tensor is a mapping
    of its own whose resident size is its own pages."""
    from sarathi_pp import LLM, SamplingParams

    prompts = [[5, 9, 13, 2, 7] * 6, [11, 3] * 20]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = {}
    for prefault in (False, True):
        llm = LLM(
            str(llama_dir), max_model_len=128, num_kv_blocks=20000, prefault_kv_cache=prefault
        )
        try:
            kv = llm.engine.executor.runner.kv
            assert (mapped_mib(kv.k[0]) > 0.99 * kv.k[0].numel() * 4 / 2**20) == prefault
            outs[prefault] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.shutdown()
    assert outs[True] == outs[False] and len(set(map(tuple, outs[True]))) == 2


needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or thp_mode() in (None, "never"),
    reason=f"transparent huge pages not offered here (mode {thp_mode()})",
)


@needs_thp
def test_packed_weights_start_on_a_huge_page_and_stay_exact():
    """``Linear``'s packed panel weight (``host_pages.empty_huge``): on a 2 MB boundary,
    eligible for huge pages, the same values."""
    from sarathi_pp.stages.model.linear import Linear, panel_gemm_applies

    w = torch.randn(1024, 1536)  # 6 MiB
    if not panel_gemm_applies(w):
        pytest.skip("the panel GEMM kernel does not load here")
    lin = Linear(w, kind="panel_gemm")
    assert lin.packed is not None and lin.packed.data_ptr() % host_pages.HUGE_PAGE == 0
    assert smaps_field(lin.packed.data_ptr() + (2 << 20), "THPeligible") == "1"
    x = torch.randn(5, 1536)
    torch.testing.assert_close(lin(x), x @ w.T, atol=1e-4, rtol=1e-5)


@needs_thp
def test_empty_huge_below_a_huge_page_or_switched_off_is_plain(monkeypatch):
    t = host_pages.empty_huge((3 << 20,), torch.uint8)
    assert t.data_ptr() % host_pages.HUGE_PAGE == 0 and t.shape == (3 << 20,)
    assert host_pages.advise_huge(t)
    small = host_pages.empty_huge((1000,), torch.float32)
    assert small.shape == (1000,) and small.untyped_storage().nbytes() == 4000
    monkeypatch.setenv(host_pages.SWITCH, "0")
    off = host_pages.empty_huge((3 << 20,), torch.uint8)
    assert off.untyped_storage().nbytes() == 3 << 20  # no 2 MB of slack: plain torch.empty
    assert not host_pages.advise_huge(t)
