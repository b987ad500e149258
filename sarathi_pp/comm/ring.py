"""The token ring: each micro-batch's sampled tokens from the last stage straight to stage 0.

With scheduling ahead (``parallel.schedule_ahead``) the driver hands stage 0 micro-batch
``k`` while the last stage is still sampling the tokens of an older ``j`` that ``k``'s
decodes take as input. Those tokens then go last stage -> stage 0 here, over a gloo group
of their own (CPU tensors: a few int64 per micro-batch; their own connections, so they
never queue behind hidden states), while the driver gets them as before and applies them
in parallel.

Wire format, one message per micro-batch that samples, last stage -> stage 0, matched in
posting order: int64 ``[microbatch_id, token for each sampling chunk in chunk order]``
(-1: the last stage could not sample it: its micro-batch failed there, or its logits were
not finite).

Stage 0 posts the receive for ``j`` when it runs ``j`` (``expect``), before it sends ``j``'s
hidden states on, so the last stage's send always finds it posted and completes. It waits
for a message only when a micro-batch needs it (``tokens``), or when more than
``max_pending`` are posted (the oldest was sent long ago: the driver keeps at most that
many micro-batches in flight), never as a poll (p2p.py, Note [timeouts]). A wait past the
timeout raises ``StageTimeoutError`` naming the last stage.

Not thread-safe: one stage calls it from one thread, in micro-batch order.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sarathi_pp.comm.p2p import StageCommError, StageMismatchError, wait_work

NO_TOKEN = -1  # a sampling chunk the last stage could not sample


@dataclass(slots=True)
class _Posted:
    microbatch_id: int
    seq_ids: tuple[int, ...]
    work: Any  # dist.Work of the receive
    buffer: torch.Tensor


class TokenRing:
    """Stage 0's and the last stage's ends of the ring (other stages hold none).

    ``group``: a gloo group of every stage, in which a stage's rank is its index. With one
    stage (first and last at once) the tokens stay in the process."""

    def __init__(
        self, stage_idx: int, num_stages: int, timeout_s: float, group: Any, max_pending: int
    ) -> None:
        self.stage_idx, self.num_stages = stage_idx, num_stages
        self.timeout_s = float(timeout_s)
        self.group = group
        self.max_pending = max(1, max_pending)
        self.last_rank = num_stages - 1
        self._local = num_stages == 1  # first and last at once: tokens stay in the process
        self._posted: deque[_Posted] = deque()  # stage 0: receives in posting order
        self._got: dict[int, dict[int, int]] = {}  # stage 0: received, by micro-batch
        self._sends: deque[tuple[int, Any, torch.Tensor]] = deque()  # last stage

    # --- stage 0 -------------------------------------------------------------------------------
    def expect(self, microbatch_id: int, seq_ids: list[int]) -> None:
        """Post the receive of ``microbatch_id``'s tokens (its sampling chunks ``seq_ids``)."""
        if not seq_ids or self._local:  # ``send`` keeps them in the process
            return
        buffer = torch.empty(1 + len(seq_ids), dtype=torch.int64)
        try:
            work = dist.irecv(buffer, src=self._global(self.last_rank), group=self.group)
        except Exception as e:  # noqa: BLE001 - the connection is gone
            raise StageCommError(
                f"stage 0: posting the token ring's receive of micro-batch {microbatch_id} "
                f"from stage {self.last_rank} failed: {e}"
            ) from e
        self._posted.append(_Posted(microbatch_id, tuple(seq_ids), work, buffer))
        while len(self._posted) > self.max_pending:
            self._take()

    def tokens(self, sources: tuple[int, ...]) -> dict[int, dict[int, int]]:
        """``seq_id -> token`` of each micro-batch in ``sources`` (sampled by the last
        stage; a chunk it could not sample is left out), waiting for those not here yet."""
        # Note [the latest run wins]: every receive up to the last one posted for a source is
        # taken, in posting order. A micro-batch can run more than once (after a stage
        # raised on one: its sequences retried one at a time, the ones behind it drained and
        # issued again, ray.py ``_isolate``), so its later runs' messages come after newer
        # micro-batches' first ones; stopping at the first newer id read a drained run's
        # tokens (which may be wrong: it read K/V the failed one left unwritten).
        last = max(
            (i for i, p in enumerate(self._posted) if p.microbatch_id in sources), default=-1
        )
        for _ in range(last + 1):
            self._take()
        missing = [j for j in sources if j not in self._got]
        if missing:
            raise StageCommError(
                f"stage 0: the token ring has no tokens of micro-batch(es) {missing}: stage 0 "
                f"did not run them before (the driver and the stages disagree on the order)"
            )
        out = {j: self._got[j] for j in sources}
        for j in [j for j in self._got if j < min(sources) - 4 * self.max_pending]:
            del self._got[j]  # bounded: older ones are never asked for again
        return out

    def _take(self) -> None:
        posted = self._posted.popleft()
        self._wait(posted.work, posted.microbatch_id, "receive")
        values = posted.buffer.tolist()
        if values[0] != posted.microbatch_id:
            raise StageMismatchError(
                f"stage 0: the token ring expected micro-batch {posted.microbatch_id}'s tokens "
                f"from stage {self.last_rank}, received micro-batch {values[0]}'s; the stages' "
                f"micro-batch order disagrees"
            )
        got = self._got.setdefault(posted.microbatch_id, {})  # a retry may repeat an id
        for seq_id, token in zip(posted.seq_ids, values[1:], strict=True):
            if token != NO_TOKEN:
                got[seq_id] = token
            else:  # not sampled in this run, the latest: an earlier run's token is stale
                got.pop(seq_id, None)

    # --- the last stage ------------------------------------------------------------------------
    def send(self, microbatch_id: int, seq_ids: list[int], sampled: dict[int, int]) -> None:
        """Send ``microbatch_id``'s tokens (``sampled``, by sequence) to stage 0; returns at
        once. A sequence missing from ``sampled`` goes as ``NO_TOKEN``."""
        if not seq_ids:
            return
        tokens = [microbatch_id] + [sampled.get(s, NO_TOKEN) for s in seq_ids]
        if self._local:
            got = self._got.setdefault(microbatch_id, {})
            got.update((s, t) for s, t in zip(seq_ids, tokens[1:], strict=True) if t != NO_TOKEN)
            return
        message = torch.tensor(tokens, dtype=torch.int64)
        try:
            work = dist.isend(message, dst=self._global(0), group=self.group)
        except Exception as e:  # noqa: BLE001
            raise StageCommError(
                f"stage {self.stage_idx}: sending micro-batch {microbatch_id}'s tokens to "
                f"stage 0 over the token ring failed: {e}"
            ) from e
        self._sends.append((microbatch_id, work, message))
        while len(self._sends) > self.max_pending:  # stage 0 posted it: completes at once
            mb, oldest, _ = self._sends.popleft()
            self._wait(oldest, mb, "send")

    def flush(self, timeout_s: float) -> None:
        """Complete the outstanding sends (before shutdown), at most ``timeout_s`` in all."""
        deadline = time.monotonic() + timeout_s
        try:
            while self._sends:
                mb, work, _ = self._sends[0]
                self._wait(work, mb, "send", max(deadline - time.monotonic(), 1e-3))
                self._sends.popleft()
        finally:
            self._sends.clear()

    # --- helpers -------------------------------------------------------------------------------
    def _wait(self, work: Any, microbatch_id: int, op: str, timeout_s: float | None = None) -> None:
        peer = self.last_rank if op == "receive" else 0
        action = f"for the token ring's {op} of micro-batch {microbatch_id}"
        wait_work(
            work, self.stage_idx, peer, action, self.timeout_s if timeout_s is None else timeout_s
        )

    def _global(self, group_rank: int) -> int:
        return (
            dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank
        )
