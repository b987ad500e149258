"""The reused gather buffers of the CPU attention backend give the fresh gather's values,
whatever the order of sizes (grow, shrink, grow again) and whichever cache they read."""

from __future__ import annotations

import torch

from sarathi_pp.stages.model.attention import TorchAttention, gather_blocks


def test_workspace_gather_equals_fresh_gather():
    torch.manual_seed(0)
    bs, kvh, d = 4, 2, 8
    k_cache, v_cache = torch.randn(2, 64 * bs, kvh, d).unbind(0)
    attn = TorchAttention(4, kvh, d)
    for shape in [(3, 5), (1, 2), (6, 9), (2, 1), (6, 9)]:
        blocks = torch.randint(0, 64, shape)
        k = attn._gather("k", k_cache, blocks, bs)
        v = attn._gather("v", v_cache, blocks, bs)
        assert torch.equal(k, gather_blocks(k_cache, blocks, bs))
        assert torch.equal(v, gather_blocks(v_cache, blocks, bs))
        assert k.shape == (shape[0], shape[1] * bs, kvh, d)
    # the buffers were reused, not reallocated per call: one per name, of the largest size
    assert set(attn._workspace) == {"k", "v"}
    assert attn._workspace["k"].numel() == 6 * 9 * bs * kvh * d
