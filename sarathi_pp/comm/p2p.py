"""Point-to-point transport of a micro-batch's hidden states between neighbouring stages.

Wire format, stage s -> s+1, matched in posting order (every stage runs its micro-batches
in issue order, so both ends post them in the same order). The header is int64
``[microbatch_id, num_tokens, hidden_size, dtype_code]``; the receiver checks it against what
its own micro-batch says before it takes the payload (hidden ``[num_tokens, hidden_size]``).

- CPU tensors (gloo), received ahead (Note [receive ahead]): one message per micro-batch,
  uint8 ``[header + oversized flag, padded to PACKED_HEADER_BYTES | payload]``; when the
  payload does not fit the receive posted ahead (``oversized``), the message holds the
  header alone and the payload follows as a second message of its exact size.
- CUDA tensors (NCCL, whose receives must match the send's size): two messages, the
  header, then the payload (not sent when it has no elements).

Note [receive ahead]: a gloo send completes only once the receiver has posted a matching
receive (gloo's TCP pair exchanges a "ready to receive" notice first), so a receive posted
when the stage gets to it costs a round trip per message through the sender's transport
thread, on a sender that is busy computing its next micro-batch by then: stage 1 started a
micro-batch well after it was free although stage 0 had sent it long before (the figures: the
lab notebook's "Figures moved out of the code", Note [receive ahead]). So on gloo the receiver
keeps the next micro-batch's receive posted while it computes: into a buffer of ``capacity``
bytes, which gloo fills with any message up to that size (a larger one would abort the
process: ``op.preamble.length <= op.nbytes``). Both ends compute the same capacity from the
same messages: ``INITIAL_CAPACITY``, then the largest message so far (``_grown``); a payload
the receiver's buffer cannot hold goes as a second, exact-size message. The hidden states
handed to the stage are a view into that buffer. Whatever arrives is taken whole, so a
mismatched header leaves the channel aligned.

Note [send completion]: sends are ``dist.isend``; the stage goes on computing while they
drain. A send's tensors must stay alive until it completes, so each one is kept with its
``Work`` handle. On NCCL, ``Work.is_completed()`` tells when a send finished and completed
ones are dropped at the next ``send``. On gloo it stays False until ``wait()`` is called
(verified on torch 2.13), so the handles are kept until more than ``max_pending_sends`` are
outstanding and then the oldest is waited for. Stage s+1 has received micro-batch j before
stage s computes j + (number in flight), so with ``max_pending_sends`` >= micro-batches in
flight that wait returns at once; if stage s+1 does lag further behind, it is backpressure,
never a deadlock (the last stage sends nothing, so no wait cycle can form).

Note [timeouts]: every wait is ``Work.wait(timeout=...)``. On gloo a receive with no
matching send raises RuntimeError("... Timed out waiting 2000ms for recv operation to
complete") after the timeout, and gloo then closes the connection to that peer: any later
operation with it fails ("Application timeout caused pair closure"). A timeout is therefore
fatal for the pipeline, and a short ``wait`` must never be used to poll. On NCCL a wait with
a timeout blocks the CPU until completion or the timeout (not testable without 2 GPUs).

Note [header without a device sync]: on CUDA both ends keep the host off the device's
stream. The sender's header goes from pinned host memory with a non-blocking copy
(``torch.tensor(list, device="cuda")`` would wait for the stream, i.e. for the micro-batch
just computed). The receiver takes the payload in the shape its own micro-batch says and
checks the header later (``HeaderChecks``): the header is copied to pinned host memory
behind the receive, an event marks the copy, and the check runs once the event has
completed, at a later ``recv`` or at ``flush``: a mismatch still raises
``StageMismatchError`` naming both micro-batches, one or more micro-batches late, and the
channel is then unusable (NCCL cannot drain a payload of another size). On CPU (gloo)
the header is read at once and a mismatch drained, as before.

Not thread-safe: one stage calls ``send``/``recv`` from one thread, in micro-batch order.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

HEADER_LEN = 4  # microbatch_id, num_tokens, hidden_size, dtype_code
# The packed message's header room (Note [receive ahead]): the header, the oversized flag,
# padding, so the payload stays 64-byte aligned for the kernels.
PACKED_HEADER_BYTES = 64
INITIAL_CAPACITY = 1 << 20  # bytes of the first receive posted ahead (then: the largest so far)
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float64: 3,
}
_CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class StageCommError(RuntimeError):
    """A stage's send or receive failed; the message names the stage and the micro-batch."""


class StageTimeoutError(StageCommError, TimeoutError):
    """A send or receive waited longer than the transport's ``timeout_s``."""


class StageMismatchError(StageCommError):
    """What arrived (micro-batch id, shape or dtype) is not what the receiver's micro-batch says."""


@dataclass(slots=True)
class _PendingSend:
    microbatch_id: int
    works: tuple[Any, ...]  # dist.Work of the header, then of the payload
    tensors: tuple[torch.Tensor, ...]  # alive until the works complete (Note [send completion])


def wait_work(work: Any, stage_idx: int, peer: int, action: str, timeout_s: float) -> None:
    """``work.wait`` with a timeout (Note [timeouts]): ``StageTimeoutError`` when it timed
    out, ``StageCommError`` when it failed otherwise, naming the stage, what it was waiting
    ``action`` (e.g. "to receive micro-batch 3 from stage 0") and the ``peer`` to blame.
    The hidden states' transport and the token ring (``ring.py``) wait through it."""
    start = time.monotonic()
    try:
        ok = work.wait(timeout=timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - gloo: RuntimeError, NCCL: DistBackendError
        elapsed = time.monotonic() - start
        if isinstance(e, TimeoutError) or "timed out" in str(e).lower() or elapsed >= timeout_s:
            raise StageTimeoutError(
                _timeout_message(stage_idx, action, peer, elapsed, timeout_s)
            ) from e
        raise StageCommError(f"stage {stage_idx}: failed waiting {action}: {e}") from e
    if ok is False:  # some backends report a timeout by returning False
        raise StageTimeoutError(
            _timeout_message(stage_idx, action, peer, time.monotonic() - start, timeout_s)
        )


def _timeout_message(
    stage_idx: int, action: str, peer: int, elapsed: float, timeout_s: float
) -> str:
    return (
        f"stage {stage_idx}: timed out after {elapsed:.1f}s (timeout {timeout_s:g}s) "
        f"waiting {action}; stage {peer} is stuck, has failed, or runs its micro-batches in a "
        f"different order"
    )


def _grown(capacity: int, message_bytes: int) -> int:
    """The receive-ahead capacity after a message of ``message_bytes`` (the payload's bytes
    plus the packed header): both ends apply it to the same messages (Note [receive ahead])."""
    return max(capacity, message_bytes)


def _payload_bytes(header: list[int]) -> int | None:
    """The payload's bytes the header announces; ``None`` when the header is not usable."""
    _, num_tokens, hidden_size, code = header
    dtype = _CODE_DTYPES.get(code)
    if dtype is None or num_tokens < 0 or hidden_size < 0:
        return None
    return num_tokens * hidden_size * dtype.itemsize


def _packed_head(message: torch.Tensor) -> torch.Tensor:
    """The int64 view of a packed message's header and oversized flag (Note [receive ahead])."""
    return message[: (HEADER_LEN + 1) * 8].view(torch.int64)


def _dtype_name(code: int) -> str:
    dtype = _CODE_DTYPES.get(code)
    return f"<unknown dtype code {code}>" if dtype is None else str(dtype).removeprefix("torch.")


def _describe(header: list[int]) -> str:
    microbatch_id, num_tokens, hidden_size, code = header
    return f"micro-batch {microbatch_id} hidden [{num_tokens}, {hidden_size}] {_dtype_name(code)}"


class HeaderChecks:
    """Received headers checked once their copy to the host has completed (Note [header
    without a device sync]): ``add`` queues a device header with what the receiver expected;
    ``poll`` checks those whose event completed (``block``: all of them, waiting), raising
    ``StageMismatchError`` for the first that differs. ``event``: makes a recorded event
    (``torch.cuda.Event``'s ``record``/``query``/``synchronize``)."""

    def __init__(self, stage_idx: int, event: Callable[[], Any]) -> None:
        self.stage_idx = stage_idx
        self.event = event
        self.pending: deque[tuple[list[int], torch.Tensor, Any]] = deque()

    def add(self, expected: list[int], header: torch.Tensor) -> None:
        host = torch.empty(HEADER_LEN, dtype=torch.int64, pin_memory=header.is_cuda)
        host.copy_(header, non_blocking=True)
        event = self.event()
        event.record()
        self.pending.append((expected, host, event))

    def poll(self, block: bool = False) -> None:
        while self.pending:
            expected, host, event = self.pending[0]
            if block:
                event.synchronize()
            elif not event.query():
                return
            self.pending.popleft()
            received = [int(v) for v in host.tolist()]  # host memory: no device sync
            if received != expected:
                s = self.stage_idx
                raise StageMismatchError(
                    f"stage {s}: expected {_describe(expected)} from stage {s - 1}, received "
                    f"{_describe(received)} (checked after the receive: Note [header without "
                    "a device sync]); the stages' send/recv order or micro-batches disagree; "
                    "the channel is unusable"
                )


class StageTransport:
    """Sends hidden states to stage ``stage_idx + 1`` and receives them from ``stage_idx - 1``.

    ``group`` is the stages' process group (default: the default group); the stage's rank
    in it must be ``stage_idx``. Tensors (the header included, as NCCL needs) live on
    ``device``. ``receive_ahead`` (default: on for CPU tensors, i.e. gloo): one packed
    message per micro-batch, its receive posted while the stage computes the one before
    (Note [receive ahead]); both ends must agree on it.
    """

    def __init__(
        self,
        stage_idx: int,
        num_stages: int,
        device: str | torch.device,
        timeout_s: float,
        group: Any = None,
        max_pending_sends: int | None = None,
        receive_ahead: bool | None = None,
        header_checks: HeaderChecks | None = None,
    ) -> None:
        if num_stages < 1 or not 0 <= stage_idx < num_stages:
            raise ValueError(f"stage_idx {stage_idx} is not in [0, num_stages={num_stages})")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.stage_idx = stage_idx
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.timeout_s = float(timeout_s)
        self.group = group
        # Note [receive ahead]: gloo (CPU tensors) only; NCCL receives must match in size.
        self.receive_ahead = self.device.type == "cpu" if receive_ahead is None else receive_ahead
        self._send_capacity = self._recv_capacity = INITIAL_CAPACITY
        self._ahead: tuple[Any, torch.Tensor] | None = None  # the next message's receive
        # Note [header without a device sync]: deferred on CUDA; None: checked at once
        if header_checks is None and self.device.type == "cuda" and not self.receive_ahead:
            header_checks = HeaderChecks(stage_idx, torch.cuda.Event)
        self.header_checks = header_checks
        self.max_pending_sends = max_pending_sends or max(4, 2 * num_stages)
        if self.max_pending_sends < 1:
            raise ValueError(f"max_pending_sends must be >= 1, got {self.max_pending_sends}")
        self._pending: deque[_PendingSend] = deque()
        if num_stages > 1:
            self._check_group()
        self._prev_rank = self._global_rank(stage_idx - 1) if stage_idx > 0 else None
        self._next_rank = self._global_rank(stage_idx + 1) if stage_idx < num_stages - 1 else None

    def __repr__(self) -> str:
        return (
            f"StageTransport(stage {self.stage_idx}/{self.num_stages}, {self.device}, "
            f"timeout_s={self.timeout_s:g}, pending_sends={len(self._pending)})"
        )

    @property
    def num_pending_sends(self) -> int:
        return len(self._pending)

    # --- sending -----------------------------------------------------------------------------
    def send(self, microbatch_id: int, hidden: torch.Tensor) -> None:
        """Start sending ``hidden`` [num_tokens, hidden_size] to the next stage; returns at
        once. ``hidden`` must not be modified in place until the send completes."""
        s = self.stage_idx
        if self._next_rank is None:
            raise RuntimeError(
                f"stage {s} is the last of {self.num_stages} stages: it sends nothing"
            )
        if hidden.dim() != 2:
            raise ValueError(
                f"stage {s}: micro-batch {microbatch_id}: hidden must be [num_tokens, hidden_size], "
                f"got shape {tuple(hidden.shape)}"
            )
        code = self._dtype_code(hidden.dtype)
        if not self._on_device(hidden):
            raise ValueError(
                f"stage {s}: micro-batch {microbatch_id}: hidden is on {hidden.device}, "
                f"the transport on {self.device}"
            )
        self._reap()
        payload = hidden.detach().contiguous()
        num_tokens, hidden_size = payload.shape
        header = [microbatch_id, num_tokens, hidden_size, code]
        if self.receive_ahead:
            messages = self._packed(header, payload)
        else:
            # Note [header without a device sync]: pinned, non-blocking (CPU: the tensor)
            staged = torch.tensor(header, dtype=torch.int64, pin_memory=self.device.type == "cuda")
            messages = [staged.to(self.device, non_blocking=True)]
            if payload.numel():
                messages.append(payload)
        try:
            works = [dist.isend(m, dst=self._next_rank, group=self.group) for m in messages]
        except Exception as e:  # noqa: BLE001 - e.g. the connection to the peer is gone
            raise StageCommError(
                f"stage {s}: sending micro-batch {microbatch_id} to stage {s + 1} failed: {e}"
            ) from e
        self._pending.append(_PendingSend(microbatch_id, tuple(works), tuple(messages)))
        while len(self._pending) > self.max_pending_sends:  # Note [send completion]
            note = f" ({len(self._pending)} sends outstanding, max_pending_sends={self.max_pending_sends})"
            self._complete(self._pending.popleft(), self.timeout_s, note)

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every outstanding send has completed (before shutdown), at most
        ``timeout_s`` in all (default: the transport's); raises ``StageTimeoutError`` after."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        if self.header_checks is not None:
            self.header_checks.poll(block=True)
        try:
            while self._pending:
                remaining = max(deadline - time.monotonic(), 1e-3)
                self._complete(self._pending[0], remaining)
                self._pending.popleft()
        except BaseException:
            self._pending.clear()  # the channel is broken (Note [timeouts]); don't wait again
            raise

    def _packed(self, header: list[int], payload: torch.Tensor) -> list[torch.Tensor]:
        """The message(s) of one micro-batch received ahead (Note [receive ahead]): the
        packed header and payload in one, or the header alone and the payload after it
        when the receiver's buffer cannot hold both."""
        nbytes = payload.numel() * payload.element_size()
        oversized = PACKED_HEADER_BYTES + nbytes > self._send_capacity
        self._send_capacity = _grown(self._send_capacity, PACKED_HEADER_BYTES + nbytes)
        message = torch.empty(PACKED_HEADER_BYTES + (0 if oversized else nbytes), dtype=torch.uint8)
        _packed_head(message).copy_(torch.tensor([*header, int(oversized)], dtype=torch.int64))
        if oversized:
            return [message, payload]
        if nbytes:
            message[PACKED_HEADER_BYTES:].view(payload.dtype).copy_(payload.reshape(-1))
        return [message]

    def _reap(self) -> None:
        """Drop completed sends from the front (only NCCL reports completion without a wait)."""
        while self._pending and all(w.is_completed() for w in self._pending[0].works):
            self._complete(self._pending.popleft(), self.timeout_s)  # surfaces a failed send

    def _complete(self, pending: _PendingSend, timeout_s: float, note: str = "") -> None:
        for work in pending.works:
            self._wait(work, pending.microbatch_id, "send", timeout_s, note)

    # --- receiving ---------------------------------------------------------------------------
    def recv(
        self, microbatch_id: int, num_tokens: int, hidden_size: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Receive micro-batch ``microbatch_id``'s hidden states [num_tokens, hidden_size]
        from the previous stage. Raises ``StageMismatchError`` when the sender's header
        disagrees with these expectations (from the receiver's micro-batch), ``StageTimeoutError``
        when nothing arrives within ``timeout_s``."""
        s = self.stage_idx
        if self._prev_rank is None:
            raise RuntimeError(f"stage {s} is the first stage: it receives nothing")
        expected = [microbatch_id, num_tokens, hidden_size, self._dtype_code(dtype)]
        if self.receive_ahead:
            return self._recv_ahead(expected, dtype)
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        self._wait(self._irecv(header, microbatch_id), microbatch_id, "recv", self.timeout_s)
        if self.header_checks is None:
            received = [int(v) for v in header.tolist()]
            if received != expected:
                self._mismatch(expected, received)
        hidden = torch.empty((num_tokens, hidden_size), dtype=dtype, device=self.device)
        if hidden.numel():
            self._wait(self._irecv(hidden, microbatch_id), microbatch_id, "recv", self.timeout_s)
        if self.header_checks is not None:  # after the payload: the sender's send completes
            self.header_checks.add(expected, header)
            self.header_checks.poll()  # the headers copied by now, this one's included
        return hidden

    def _recv_ahead(self, expected: list[int], dtype: torch.dtype) -> torch.Tensor:
        """``recv`` of a packed message, from the receive posted ahead (Note [receive
        ahead]); posts the next one before it returns, so that one arrives while the stage
        computes this one."""
        microbatch_id, num_tokens, hidden_size, _ = expected
        work, buffer = self._ahead or self._post_ahead(microbatch_id)
        self._ahead = None
        self._wait(work, microbatch_id, "recv", self.timeout_s)
        head = _packed_head(buffer).tolist()
        received, oversized = head[:HEADER_LEN], bool(head[HEADER_LEN])
        nbytes = _payload_bytes(received)
        if nbytes is not None:
            self._recv_capacity = _grown(self._recv_capacity, PACKED_HEADER_BYTES + nbytes)
        if received != expected:
            # A packed payload came whole with its header: only a separate one is drained.
            self._mismatch(expected, received, drain=oversized)
        if oversized:
            hidden = torch.empty((num_tokens, hidden_size), dtype=dtype, device=self.device)
            self._wait(self._irecv(hidden, microbatch_id), microbatch_id, "recv", self.timeout_s)
        else:
            payload = buffer[PACKED_HEADER_BYTES : PACKED_HEADER_BYTES + (nbytes or 0)]
            hidden = payload.view(dtype).view(num_tokens, hidden_size)
        self._ahead = self._post_ahead(microbatch_id, after=True)
        return hidden

    def _post_ahead(self, microbatch_id: int, after: bool = False) -> tuple[Any, torch.Tensor]:
        """Post the receive of the packed message of ``microbatch_id`` (``after``: of the
        one after it, whatever its id) into a buffer of the receive-ahead capacity."""
        buffer = torch.empty(self._recv_capacity, dtype=torch.uint8, device=self.device)
        return self._irecv(buffer, microbatch_id, after), buffer

    def _irecv(self, tensor: torch.Tensor, microbatch_id: int, after: bool = False) -> Any:
        try:
            return dist.irecv(tensor, src=self._prev_rank, group=self.group)
        except Exception as e:  # noqa: BLE001 - e.g. the connection to the peer is gone
            what = (
                f"the micro-batch after {microbatch_id}"
                if after
                else f"micro-batch {microbatch_id}"
            )
            raise StageCommError(
                f"stage {self.stage_idx}: receiving {what} from stage {self.stage_idx - 1} "
                f"failed: {e}"
            ) from e

    def _mismatch(self, expected: list[int], received: list[int], drain: bool = True) -> None:
        s = self.stage_idx
        fields = ("microbatch_id", "num_tokens", "hidden_size", "dtype")
        differ = [f for f, e, r in zip(fields, expected, received, strict=True) if e != r]
        drained = self._drain(received) if drain else True
        raise StageMismatchError(
            f"stage {s}: expected {_describe(expected)} from stage {s - 1}, received "
            f"{_describe(received)} (differs in {', '.join(differ)}); the stages' send/recv "
            f"order or micro-batches disagree"
            + ("" if drained else "; the payload could not be drained, the channel is unusable")
        )

    def _drain(self, header: list[int]) -> bool:
        """Take the payload the header announced, so the channel stays aligned and the
        sender's send completes. False when the header is not usable."""
        nbytes = _payload_bytes(header)
        if nbytes is None:
            return False
        if nbytes == 0:
            return True
        _, num_tokens, hidden_size, code = header
        sink = torch.empty((num_tokens, hidden_size), dtype=_CODE_DTYPES[code], device=self.device)
        try:
            self._wait(self._irecv(sink, header[0]), header[0], "recv", self.timeout_s)
        except StageCommError:
            return False
        return True

    # --- helpers -----------------------------------------------------------------------------
    def _wait(
        self, work: Any, microbatch_id: int, op: str, timeout_s: float, note: str = ""
    ) -> None:
        """``work.wait`` with a timeout, turning failures into errors that name the stage,
        the peer and the micro-batch (Note [timeouts])."""
        s = self.stage_idx
        peer = s + 1 if op == "send" else s - 1
        if op == "send":
            action = f"for stage {peer} to receive micro-batch {microbatch_id}{note}"
        else:
            action = f"to receive micro-batch {microbatch_id} from stage {peer}"
        wait_work(work, s, peer, action, timeout_s)

    def _dtype_code(self, dtype: torch.dtype) -> int:
        if dtype not in DTYPE_CODES:
            names = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)
            raise ValueError(
                f"stage {self.stage_idx}: cannot transport {dtype}; supported: {names}"
            )
        return DTYPE_CODES[dtype]

    def _on_device(self, t: torch.Tensor) -> bool:
        d = self.device
        return t.device.type == d.type and (d.index is None or t.device.index == d.index)

    def _check_group(self) -> None:
        s = self.stage_idx
        if not dist.is_initialized():
            raise RuntimeError(f"stage {s}: no process group; call init_stage_group first")
        rank, size = dist.get_rank(self.group), dist.get_world_size(self.group)
        if (rank, size) != (s, self.num_stages):
            raise ValueError(
                f"stage {s} of {self.num_stages}: the process group has this process as rank "
                f"{rank} of {size}; a stage's rank must be its stage_idx"
            )

    def _global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)
