"""Small picklable control messages (micro-batches, sampled tokens) between ranks over a gloo group.

Why not ``broadcast_object_list`` / ``send_object_list``: both block the sender until the
receivers take part. With several micro-batches in flight that deadlocks: rank 0 blocks
broadcasting micro-batch j+1 while the last rank blocks sending micro-batch j's tokens to rank 0. Here a
send only starts (``isend``) and returns; its buffers are kept until a later ``wait``
(gloo reports a send complete only on ``wait``), oldest first, so memory stays bounded.
"""

from __future__ import annotations

import pickle
from collections import deque
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from sarathi_pp.comm.p2p import StageCommError, StageTimeoutError


class ObjectChannel:
    def __init__(self, group: Any, timeout_s: float, max_pending_sends: int = 64) -> None:
        self.group = group
        self.timeout_s = timeout_s
        self.max_pending_sends = max_pending_sends
        self._pending: deque[tuple[Any, Any, torch.Tensor, torch.Tensor]] = deque()

    def send(self, obj: Any, dst: int) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        w1 = dist.isend(size, dst, group=self.group)
        w2 = dist.isend(payload, dst, group=self.group)
        self._pending.append((w1, w2, size, payload))  # tensors alive until sent
        while len(self._pending) > self.max_pending_sends:
            self._wait_oldest()

    def recv(self, src: int, what: str = "a message") -> Any:
        size = torch.empty(1, dtype=torch.int64)
        self._wait(dist.irecv(size, src, group=self.group), f"{what} from rank {src}")
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self._wait(dist.irecv(payload, src, group=self.group), f"{what} from rank {src}")
        return pickle.loads(payload.numpy().tobytes())

    def flush(self) -> None:
        while self._pending:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        w1, w2, _, _ = self._pending.popleft()
        self._wait(w1, "a send")
        self._wait(w2, "a send")

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError for both
            if "timed out" in str(e).lower():
                raise StageTimeoutError(f"no {what} within {self.timeout_s:g} s") from e
            raise StageCommError(f"waiting for {what}: {e}") from e
