"""How a micro-batch's host-built integers reach the device: one copy per micro-batch.

Note [one upload per micro-batch]: ``torch.tensor(list, device="cuda")`` copies from
pageable memory and waits for the device's stream to drain first, so every such call in a
step is a host stall behind the kernels already queued (the previous micro-batch's layers).
``metadata.py`` therefore builds every integer a micro-batch needs (token ids, positions,
KV slots, block tables, the rows to sample) on the host into one int64 buffer, which
``PinnedUpload`` moves with a single non-blocking copy from pinned memory; the tensors the
layers read are views of the copy. The pinned source stays valid until the copy has run:
torch's pinned-memory allocator does not reuse a block before the copies recorded on it
completed.

``Upload`` is the interface (a test counts the copies per micro-batch through it).
"""

from __future__ import annotations

from typing import Protocol

import torch


class Upload(Protocol):
    """Moves one host int64 buffer ``[n]`` to the stage's device. An ``Upload`` whose
    ``packs`` attribute is false (``PinnedUpload`` on CPU) is not called: the host tensors
    are the device's."""

    def __call__(self, host: torch.Tensor) -> torch.Tensor: ...


class PinnedUpload:
    """The stage's ``Upload``: on CUDA, ``host`` (pinned where the buffer was built pinned,
    ``pin``) copied without blocking the host; on CPU ``host`` itself (no copy at all)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # pinned staging only where a device copy follows (pinning needs a CUDA context)
        self.pin = device.type == "cuda"
        # on CPU nothing is copied, so the host tensors are used as they are: packing them
        # into one buffer would only cost time (Note [one upload per micro-batch])
        self.packs = device.type != "cpu"

    def __call__(self, host: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return host
        return host.to(self.device, non_blocking=True)


def to_device(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` without waiting for the device:
    on CUDA from pinned memory, non-blocking (the last stage's sampling parameters, which
    vary per row: Note [one upload per micro-batch]); on CPU the same tensor as before."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
