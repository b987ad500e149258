"""The paged KV cache tensors of one stage's layers.

Layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and for V
(flash-attn's paged layout); the runner addresses it through flat slot indices
``block_id * block_size + offset``.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import mmap
import sys
import time

import torch

from sarathi_pp.stages.model import host_pages

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault a range in, writable, without writing it


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        prefault: bool = False,
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        for t in self.k + self.v:  # before any page is touched (Note [huge pages])
            host_pages.advise_huge(t)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefault_s: float | None = None  # seconds ``prefault`` took; None: not done
        if prefault and torch.device(device).type == "cpu":
            t0 = time.perf_counter()
            for t in self.k + self.v:
                populate(t)
            self.prefault_s = time.perf_counter() - t0
            log.info(
                "KV cache: %d blocks, %.2f GiB committed in %.1f s (cache.prefault)",
                num_blocks, self.nbytes() / 2**30, self.prefault_s,
            )  # fmt: skip

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def flat(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as ``[num_slots, num_kv_heads, head_dim]`` views."""
        k, v = self.k[layer_idx], self.v[layer_idx]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype_bytes: int
    ) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes  # 2: K, V


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros, not empty: a masked-out slot still enters the matmul as 0 * value, and
    uninitialised memory could hold NaN (0 * NaN = NaN). On CPU the zeros are an anonymous
    mapping of their own: the kernel's zero pages, backed by memory only as the blocks are
    written, where ``torch.zeros`` would touch every page up front.

    Not calloc (numpy's ``np.zeros``, before): calloc serves a request from a free region of
    the C heap when one is large enough, whatever its size, and must then clear it, touching
    every page. Earlier frees leave such regions (a freed mmapped chunk raises glibc's mmap
    threshold, so the next large buffers come from the heap), and a 32 MiB cache came back
    fully resident after the tests before it had run (tests/model/test_kv_cache_pages.py).
    ``KVCache`` advises huge pages for it (Note [huge pages]) before any page is touched."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # Private: Python's default for an anonymous map is shared memory (shmem), which the
    # kernel neither counts nor pages like the heap, and gives no anonymous huge pages.
    if hasattr(mmap, "MAP_PRIVATE"):
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:  # no flags to give (Windows): a map of its own, private to this process
        buf = mmap.mmap(-1, nbytes)
    # The tensor keeps the mapping alive; it is unmapped when the last view of it goes.
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def populate(t: torch.Tensor) -> None:
    """Map every page of CPU tensor ``t`` now (``cache.prefault``), keeping its contents.

    Note [KV cache prefault]: by default the cache's pages are mapped as the blocks are first
    written (``_zeros``), and that first write is paid inside the steps. On bare metal it
    is small, but in a VM whose host backs guest memory on demand, such as this project's
    CI machines (Firecracker, free page reporting), a first touch costs tens of times more,
    and the prompts' K/V writes pay it inside the steps (the figures: the lab notebook's
    "Figures moved out of the code", Note [KV cache prefault]). Prefaulting moves that cost
    to start-up and commits the memory there, so a cache the machine cannot hold fails
    before any request is taken instead of ending in an out-of-memory kill mid-run.

    ``madvise(MADV_POPULATE_WRITE)`` where Linux has it (5.14+): it reports ENOMEM rather
    than letting the OOM killer decide. Elsewhere every page is written (zeros: the values
    stay) as the fallback."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return
    if _madvise_populate(t.data_ptr(), nbytes):
        return
    t.view(-1)[:: max(1, mmap.PAGESIZE // t.element_size())] = 0


def _madvise_populate(addr: int, nbytes: int) -> bool:
    """``MADV_POPULATE_WRITE`` over the pages holding ``[addr, addr + nbytes)``; False where
    the kernel or platform lacks it. ``MemoryError`` with the size when memory runs out."""
    if not sys.platform.startswith("linux"):
        return False
    libc = host_pages.libc()
    if libc is None:
        return False
    page = mmap.PAGESIZE
    start = addr - addr % page
    length = -(-(addr + nbytes - start) // page) * page
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), MADV_POPULATE_WRITE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOMEM, errno.EFAULT):  # EFAULT: no memory behind part of the range
        raise MemoryError(
            f"cache.prefault: could not commit {nbytes} bytes ({nbytes / 2**30:.2f} GiB) of KV "
            f"cache on this machine (errno {err}): lower cache.cpu_memory_budget, "
            "kv_cache_memory or num_kv_blocks"
        )
    return False  # EINVAL: a kernel before 5.14
