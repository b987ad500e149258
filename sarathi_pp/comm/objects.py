"""Small control messages (micro-batches, sampled tokens, set-up figures) between ranks over a
gloo group, as plain data (``codec``: msgpack, no pickle) with a size limit.

Wire format, per message: a length header ``int64 [1]`` (the payload's bytes), then the
payload ``uint8 [length]``. The receiver refuses a length outside ``[1, max_message_bytes]``
before it allocates anything, and a payload that is not a message (``codec.decode``); both
are a ``StageCommError`` naming the peer rank. After either, the channel is out of step
with that peer (the rest of its message is not drained) and must not be used again.

Note [message size]: ``MAX_MESSAGE_BYTES`` (64 MiB) bounds what one message may make the
receiver allocate. The largest message is a micro-batch: at most ``chunk_size`` token ids
plus, per sequence in it, a block table of ``max_model_len / block_size`` block ids, each id
at most 9 bytes of msgpack. 256 sequences of 32k tokens in 16-token blocks are 0.5 M ids,
under 5 MiB; 1024 sequences of 128k tokens, 8 M ids, about 40 MiB. A sender refuses to send
a message over the limit (``ValueError`` with the size) rather than let the peer fail on it.

Why not ``broadcast_object_list`` / ``send_object_list``: besides pickling, both block the
sender until the receivers take part. With several micro-batches in flight that deadlocks:
rank 0 blocks broadcasting micro-batch j+1 while the last rank blocks sending micro-batch j's
tokens to rank 0. Here a send only starts (``isend``) and returns; its buffers are kept until
a later ``wait`` (gloo reports a send complete only on ``wait``), oldest first, so memory
stays bounded.
"""

from __future__ import annotations

from collections import deque
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from sarathi_pp.comm.codec import CodecError, decode, encode
from sarathi_pp.comm.p2p import StageCommError, StageTimeoutError

MAX_MESSAGE_BYTES = 64 * 2**20  # Note [message size]


class ObjectChannel:
    """Sends and receives control messages (``codec``'s values) over ``group``."""

    def __init__(
        self,
        group: Any,
        timeout_s: float,
        max_pending_sends: int = 64,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        if max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be >= 1, got {max_message_bytes}")
        self.group = group
        self.timeout_s = timeout_s
        self.max_pending_sends = max_pending_sends
        self.max_message_bytes = max_message_bytes
        self._pending: deque[tuple[Any, Any, torch.Tensor, torch.Tensor]] = deque()

    def send(self, obj: Any, dst: int) -> None:
        """Start sending ``obj`` to rank ``dst``; returns at once. ``ValueError`` (a
        ``CodecError`` among them) when ``obj`` cannot travel or is over the size limit."""
        data = encode(obj)
        if len(data) > self.max_message_bytes:
            raise ValueError(
                f"a message to rank {dst} would be {len(data)} bytes, over the limit of "
                f"{self.max_message_bytes} bytes (MAX_MESSAGE_BYTES)"
            )
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        w1 = dist.isend(size, dst, group=self.group)
        w2 = dist.isend(payload, dst, group=self.group)
        self._pending.append((w1, w2, size, payload))  # tensors alive until sent
        while len(self._pending) > self.max_pending_sends:
            self._wait_oldest()

    def recv(self, src: int, what: str = "a message") -> Any:
        """The next message from rank ``src``; ``StageCommError`` naming ``src`` when it
        fails, is too long or is not a message."""
        where = f"{what} from rank {src}"
        size = torch.empty(1, dtype=torch.int64)
        self._wait(dist.irecv(size, src, group=self.group), where)
        num_bytes = int(size.item())
        if not 1 <= num_bytes <= self.max_message_bytes:
            raise StageCommError(
                f"{where}: the length header says {num_bytes} bytes, outside [1, "
                f"{self.max_message_bytes}] (MAX_MESSAGE_BYTES); refused (is rank {src} a "
                "sarathi-pp rank of this run?)"
            )
        payload = torch.empty(num_bytes, dtype=torch.uint8)
        self._wait(dist.irecv(payload, src, group=self.group), where)
        try:
            return decode(payload.numpy().tobytes())
        except CodecError as e:
            raise StageCommError(f"{where}: malformed message: {e}") from e

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
