"""Transparent huge pages (2 MB) for a stage's large, long-lived CPU tensors: the KV cache and
the packed weights.

Note [huge pages]: every step streams the weights (360 MB for the embedded model) and reads
each decode's K/V from blocks scattered over a cache of gigabytes, so on 4 KB pages nearly
every 4 KB read is also a TLB miss and a page walk (a 16-token block of the embedded model's
K is 16 KB: four pages). Linux gives 2 MB pages to memory that asks for them
(``madvise(MADV_HUGEPAGE)``) where ``/sys/kernel/mm/transparent_hugepage/enabled`` is
``madvise`` (the default of many distributions, and this project's CI machines) and to all
memory where it is ``always``. Fewer TLB misses make the decode attention kernel and the
panel GEMM a few percent faster on small rows (the figures: the lab notebook's "Figures
moved out of the code", Note [huge pages]).

The KV cache's memory is an anonymous mapping of its own (``kv_cache._zeros``), which
``KVCache`` advises for huge pages before any page is touched (it once came from numpy,
which advises them for its large buffers too). The packed weights came from torch's
allocator, which does not (unless ``THP_MEM_ALLOC_ENABLE=1``): ``linear.Linear`` packs into
``empty_huge``.

Only the parts of a tensor that cover whole 2 MB pages can get them; ``empty_huge`` starts
its tensor on a 2 MB boundary for that. The advice must come before the pages are first
touched (pages already mapped stay 4 KB until ``khugepaged`` merges them). Where THP is off
(``never``), outside Linux, or with ``SARATHI_PP_HUGE_PAGES=0``, nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import sys
from functools import cache

import torch

MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20
SWITCH = "SARATHI_PP_HUGE_PAGES"


@cache
def libc() -> ctypes.CDLL | None:
    """The C library with ``madvise``'s signature, errno kept; None where it is not found."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    lib = ctypes.CDLL(name, use_errno=True)
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return lib


def advise_huge(t: torch.Tensor) -> bool:
    """Ask for 2 MB pages behind the whole 2 MB pages inside CPU tensor ``t``'s memory.
    True when the kernel took the advice; False where it cannot apply (see the module
    docstring) or ``t`` covers no whole huge page."""
    if t.device.type != "cpu" or os.environ.get(SWITCH, "1") == "0":
        return False
    if not sys.platform.startswith("linux") or (lib := libc()) is None:
        return False
    addr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    start = -(-addr // HUGE_PAGE) * HUGE_PAGE
    end = (addr + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return False
    return lib.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE) == 0


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor of ``shape`` that starts on a 2 MB boundary, advised for
    huge pages (``advise_huge``); below one huge page, or with ``SARATHI_PP_HUGE_PAGES=0``,
    plain ``torch.empty``. It views a buffer 2 MB larger whose extra pages are never
    touched (so never backed by memory)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or os.environ.get(SWITCH, "1") == "0":
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    t = raw[offset : offset + nbytes].view(dtype).view(shape)
    advise_huge(t)
    return t
