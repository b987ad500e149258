"""The paged KV cache tensors of one stage's layers.

Layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and for V
(flash-attn's paged layout); the runner addresses it through flat slot indices
``block_id * block_size + offset``.
"""

from __future__ import annotations

import math

import numpy as np
import torch


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
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size

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
    uninitialised memory could hold NaN (0 * NaN = NaN). On CPU the zeros come from calloc
    (numpy), whose pages the kernel maps lazily: a large cache costs memory only as its
    blocks are written, where ``torch.zeros`` would touch every page up front."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
