"""StageTransport over real gloo process groups, one OS process per stage.

Each test starts a small world (2-3 processes) on 127.0.0.1 with a fresh ``free_port()``.
Processes come from a ``forkserver`` that imports torch once: a fresh ``spawn`` pays the
torch import (~5 s on 2 cores) for every process, a fork of the server ~0.1 s. Every
process reports ``(rank, "ok", value)`` or ``(rank, "error", text)`` through a queue and
the parent asserts on that; the parent waits at most ``WORLD_DEADLINE_S`` and kills what
is left, so no test can hang.
"""

from __future__ import annotations

import functools
import ipaddress
import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

from sarathi_pp.comm.dist_setup import (
    destroy_stage_group,
    free_port,
    init_stage_group,
    node_ip,
    pick_backend,
)
from sarathi_pp.comm.p2p import (
    INITIAL_CAPACITY,
    PACKED_HEADER_BYTES,
    HeaderChecks,
    StageCommError,
    StageMismatchError,
    StageTimeoutError,
    StageTransport,
)

WORLD_DEADLINE_S = 25.0  # whole world, start to last result
GROUP_TIMEOUT_S = 15.0  # rendezvous and default collective timeout
RECV_TIMEOUT_S = 2.0  # the transport's timeout in the timeout tests
HIDDEN_SIZE = 8


def _ctx() -> Any:
    ctx = mp.get_context("forkserver")
    # Only takes effect when the server starts; a no-op afterwards.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "sarathi_pp.comm.p2p", __name__])
    return ctx


def _entry(
    fn: Callable, rank: int, world_size: int, port: int, results: Any, finished: Any
) -> None:
    torch.set_num_threads(1)
    try:
        init_stage_group(rank, world_size, "127.0.0.1", port, "gloo", GROUP_TIMEOUT_S)
        out = (rank, "ok", fn(rank, world_size, finished))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out = (rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    results.put(out)
    finished.release()  # one release per rank that is done (see ``_wait_for_others``)
    destroy_stage_group()


def run_world(fn: Callable, world_size: int) -> dict[int, tuple[str, Any]]:
    """Run ``fn(rank, world_size, finished)`` on every rank; {rank: (status, value)}."""
    ctx = _ctx()
    results, finished = ctx.Queue(), ctx.Semaphore(0)
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, results, finished), daemon=True)
        for r in range(world_size)
    ]
    out: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + WORLD_DEADLINE_S
    try:
        for p in procs:
            p.start()
        while len(out) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, value = results.get(timeout=min(remaining, 0.5))
                out[rank] = (status, value)
            except queue.Empty:
                if all(p.exitcode is not None for p in procs):  # all gone, no more results
                    break
        for p in procs:
            p.join(timeout=max(0.0, min(3.0, deadline - time.monotonic())))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    missing = sorted(set(range(world_size)) - set(out))
    assert not missing, f"ranks {missing} reported nothing within {WORLD_DEADLINE_S}s: {out}"
    return out


def values(out: dict[int, tuple[str, Any]]) -> dict[int, Any]:
    errors = {r: v for r, (s, v) in out.items() if s != "ok"}
    assert not errors, "\n".join(f"rank {r}: {v}" for r, v in errors.items())
    return {r: v for r, (_, v) in out.items()}


def hidden(microbatch_id: int, num_tokens: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(microbatch_id)
    return torch.randn(num_tokens, HIDDEN_SIZE, generator=g).to(dtype)


# Micro-batches of different sizes (chunked prefills, decodes, hybrids), one zero-row edge.
SIZES = {0: 5, 1: 1, 2: 7, 3: 3, 4: 0, 5: 2}


# --- worlds (module-level, so the forkserver children can import them) ---------------------
def _many_in_flight(rank: int, world_size: int, finished: Any, receive_ahead: bool) -> Any:
    import torch.distributed as dist

    # A window of at least the micro-batches in flight: no send waits (Note [send completion]).
    t = StageTransport(
        rank, world_size, "cpu", timeout_s=10, max_pending_sends=len(SIZES),
        receive_ahead=receive_ahead,
    )  # fmt: skip
    if rank == 0:
        for mb, n in SIZES.items():
            t.send(mb, hidden(mb, n))
        pending = t.num_pending_sends
        dist.barrier()  # every send was issued before the receiver posts its first recv
        t.flush()
        return pending
    dist.barrier()
    got = []
    for mb, n in SIZES.items():
        x = t.recv(mb, n, HIDDEN_SIZE, torch.float32)
        got.append((mb, tuple(x.shape), torch.equal(x, hidden(mb, n))))
    return got


def _backpressure(rank: int, world_size: int, finished: Any) -> Any:
    t = StageTransport(rank, world_size, "cpu", timeout_s=10, max_pending_sends=2)
    if rank == 0:
        seen = []
        for mb in range(6):
            t.send(mb, hidden(mb, 3))
            seen.append(t.num_pending_sends)
        t.flush()
        return seen, t.num_pending_sends
    return [
        torch.equal(t.recv(mb, 3, HIDDEN_SIZE, torch.float32), hidden(mb, 3)) for mb in range(6)
    ]


def _mismatches(rank: int, world_size: int, finished: Any, receive_ahead: bool) -> Any:
    t = StageTransport(rank, world_size, "cpu", timeout_s=10, receive_ahead=receive_ahead)
    if rank == 0:
        t.send(0, hidden(0, 4))  # receiver expects micro-batch 1
        t.send(1, hidden(1, 5))  # receiver expects 4 tokens
        t.send(2, hidden(2, 4, torch.bfloat16))  # receiver expects float32
        t.send(3, hidden(3, 4))  # all as expected: the channel is still aligned
        t.flush()  # completes only because the receiver drained the bad payloads
        return None
    errors = []
    for mb in (1, 1, 2):
        with pytest.raises(StageMismatchError) as info:
            t.recv(mb, 4, HIDDEN_SIZE, torch.float32)
        errors.append(str(info.value))
    ok = torch.equal(t.recv(3, 4, HIDDEN_SIZE, torch.float32), hidden(3, 4))
    return errors, ok


class _Later:
    """An event that completes after the first look (a copy still running when its
    receive returns, done by the next one)."""

    def __init__(self) -> None:
        self.looked = False

    def record(self) -> None:
        pass

    def query(self) -> bool:
        done, self.looked = self.looked, True
        return done

    def synchronize(self) -> None:
        self.looked = True


def _deferred_header(rank: int, world_size: int, finished: Any) -> Any:
    """Note [header without a device sync]: the header+payload path with the header checked
    once copied: the payload is taken in the receiver's shape, and the mismatch raises at the
    next receive."""
    checks = HeaderChecks(rank, _Later)
    t = StageTransport(
        rank, world_size, "cpu", timeout_s=10, receive_ahead=False, header_checks=checks
    )
    if rank == 0:
        t.send(0, hidden(0, 4))  # the receiver expects micro-batch 1 (same shape)
        t.send(2, hidden(2, 4))
        t.flush()
        return None
    got = t.recv(1, 4, HIDDEN_SIZE, torch.float32)  # taken: checked later
    taken = torch.equal(got, hidden(0, 4))
    with pytest.raises(StageMismatchError) as info:
        t.recv(2, 4, HIDDEN_SIZE, torch.float32)
    t.flush()  # micro-batch 2's header matched: nothing more raises
    return taken, str(info.value), len(checks.pending)


# Payloads past the first receive posted ahead (Note [receive ahead]): rows of HIDDEN_SIZE
# float32, so BIG rows are INITIAL_CAPACITY + 256 KiB and BIGGER rows more again.
BIG = (INITIAL_CAPACITY + (1 << 18)) // (4 * HIDDEN_SIZE)
BIGGER = BIG + 10_000


def _oversized(rank: int, world_size: int, finished: Any) -> Any:
    t = StageTransport(rank, world_size, "cpu", timeout_s=10)
    sent = [(0, BIG), (1, BIG), (2, BIGGER), (3, 3), (4, BIGGER)]
    if rank == 0:
        for mb, n in sent:
            t.send(mb, hidden(mb, n))
        t.flush()
        return t.receive_ahead, t._send_capacity
    got = []
    for mb, n in sent[:2]:  # too big for the first buffer posted ahead; then it fits
        x = t.recv(mb, n, HIDDEN_SIZE, torch.float32)
        got.append(torch.equal(x, hidden(mb, n)))
    with pytest.raises(StageMismatchError) as info:  # bigger again: drained, not packed
        t.recv(2, BIG, HIDDEN_SIZE, torch.float32)
    for mb, n in sent[3:]:  # the channel is still aligned; BIGGER now fits
        x = t.recv(mb, n, HIDDEN_SIZE, torch.float32)
        got.append(torch.equal(x, hidden(mb, n)))
    x.add_(1)  # the hidden states are the stage's to change (a view of the received buffer)
    return t.receive_ahead, t._recv_capacity, got, str(info.value)


def _idle_past_timeout(rank: int, world_size: int, finished: Any) -> Any:
    # The receive posted ahead for micro-batch 1 sits longer than the timeout before the
    # stage waits on it (a server with no requests): the timeout counts from the wait.
    t = StageTransport(rank, world_size, "cpu", timeout_s=RECV_TIMEOUT_S)
    if rank == 0:
        t.send(0, hidden(0, 4))
        time.sleep(RECV_TIMEOUT_S + 1.0)
        t.send(1, hidden(1, 4))
        t.flush()
        return None
    first = torch.equal(t.recv(0, 4, HIDDEN_SIZE, torch.float32), hidden(0, 4))
    time.sleep(RECV_TIMEOUT_S + 0.5)
    return first, torch.equal(t.recv(1, 4, HIDDEN_SIZE, torch.float32), hidden(1, 4))


def _wait_for_others(finished: Any, world_size: int) -> None:
    """Stay alive until every other rank is done: a peer that exits makes waits on it fail
    at once ("connection closed") instead of timing out."""
    for _ in range(world_size - 1):
        finished.acquire(timeout=GROUP_TIMEOUT_S)


def _timeouts(rank: int, world_size: int, finished: Any) -> Any:
    # 0 sends micro-batch 3 that 1 never receives; 2 waits for micro-batch 7 that 1 never sends.
    t = StageTransport(rank, world_size, "cpu", timeout_s=RECV_TIMEOUT_S)
    start = time.monotonic()
    try:
        if rank == 0:
            t.send(3, hidden(3, 4))
            t.flush()
        elif rank == 2:
            t.recv(7, 4, HIDDEN_SIZE, torch.float32)
        else:
            _wait_for_others(finished, world_size)
            return None
    except StageTimeoutError as e:
        return (
            isinstance(e, RuntimeError),
            isinstance(e, TimeoutError),
            str(e),
            time.monotonic() - start,
        )
    return False, False, "no error", time.monotonic() - start


def _dead_sender(rank: int, world_size: int, finished: Any) -> Any:
    t = StageTransport(rank, world_size, "cpu", timeout_s=10)
    if rank == 0:
        return None  # exits (and closes its connections) without sending
    start = time.monotonic()
    try:
        t.recv(0, 4, HIDDEN_SIZE, torch.float32)
    except StageCommError as e:
        return isinstance(e, StageTimeoutError), str(e), time.monotonic() - start
    return False, "no error", time.monotonic() - start


def _relay(rank: int, world_size: int, finished: Any) -> Any:
    t = StageTransport(rank, world_size, "cpu", timeout_s=10)
    dtype = torch.bfloat16
    for mb, n in SIZES.items():
        if rank == 0:
            t.send(mb, hidden(mb, n, dtype))
            continue
        x = t.recv(mb, n, HIDDEN_SIZE, dtype)
        if rank < world_size - 1:
            t.send(mb, x + 1)  # stand-in for the stage's layers
        else:
            assert torch.equal(x, hidden(mb, n, dtype) + 1), f"micro-batch {mb} differs"
    t.flush()
    return rank


# --- tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("receive_ahead", [True, False], ids=["packed", "header+payload"])
def test_many_microbatches_in_flight_arrive_intact_and_in_order(receive_ahead):
    out = values(run_world(functools.partial(_many_in_flight, receive_ahead=receive_ahead), 2))
    assert out[0] == len(SIZES)  # gloo never reports completion before a wait
    assert out[1] == [(mb, (n, HIDDEN_SIZE), True) for mb, n in SIZES.items()]


def test_sends_beyond_max_pending_wait_for_the_oldest():
    out = values(run_world(_backpressure, 2))
    seen, after_flush = out[0]
    assert max(seen) == 2 and after_flush == 0
    assert out[1] == [True] * 6


@pytest.mark.parametrize("receive_ahead", [True, False], ids=["packed", "header+payload"])
def test_mismatched_id_shape_dtype_raise_naming_stage_and_values(receive_ahead):
    world = functools.partial(_mismatches, receive_ahead=receive_ahead)
    errors, ok = values(run_world(world, 2))[1]
    wrong_id, wrong_shape, wrong_dtype = errors
    assert wrong_id.startswith("stage 1: expected micro-batch 1 hidden [4, 8] float32 from stage 0")
    assert "received micro-batch 0 hidden [4, 8] float32 (differs in microbatch_id)" in wrong_id
    assert "received micro-batch 1 hidden [5, 8] float32 (differs in num_tokens)" in wrong_shape
    assert "expected micro-batch 2 hidden [4, 8] float32" in wrong_dtype
    assert "received micro-batch 2 hidden [4, 8] bfloat16 (differs in dtype)" in wrong_dtype
    assert all("could not be drained" not in e for e in errors)
    assert ok  # the bad payloads were drained: the next micro-batch is intact


def test_a_header_checked_after_the_receive_still_raises_naming_both_microbatches():
    taken, error, pending = values(run_world(_deferred_header, 2))[1]
    assert taken and pending == 0
    assert error.startswith("stage 1: expected micro-batch 1 hidden [4, 8] float32 from stage 0")
    assert "received micro-batch 0 hidden [4, 8] float32 (checked after the receive" in error


def test_payloads_past_the_receive_posted_ahead_follow_apart_and_grow_it_on_both_ends():
    out = values(run_world(_oversized, 2))
    (ahead0, send_capacity), (ahead1, recv_capacity, got, error) = out[0], out[1]
    assert ahead0 and ahead1  # CPU tensors: received ahead by default
    assert got == [True] * 4
    assert f"received micro-batch 2 hidden [{BIGGER}, {HIDDEN_SIZE}] float32" in error
    assert "differs in num_tokens" in error and "could not be drained" not in error
    # Both ends grew the capacity from the same messages: the largest one.
    assert send_capacity == recv_capacity == PACKED_HEADER_BYTES + BIGGER * HIDDEN_SIZE * 4


def test_a_receive_posted_ahead_longer_than_the_timeout_still_completes():
    assert values(run_world(_idle_past_timeout, 2))[1] == (True, True)


def test_recv_and_send_without_peer_time_out_naming_stage_and_microbatch():
    out = values(run_world(_timeouts, 3))
    is_runtime, is_timeout, msg, elapsed = out[2]
    assert is_runtime and is_timeout, out[2]
    assert (
        msg.startswith("stage 2: timed out after") and "receive micro-batch 7 from stage 1" in msg
    )
    assert RECV_TIMEOUT_S - 0.1 <= elapsed < RECV_TIMEOUT_S + 3
    _, is_timeout, msg, elapsed = out[0]
    assert is_timeout and msg.startswith("stage 0: timed out after"), out[0]
    assert "for stage 1 to receive micro-batch 3" in msg
    assert RECV_TIMEOUT_S - 0.1 <= elapsed < RECV_TIMEOUT_S + 3


def test_recv_from_a_dead_stage_fails_fast_naming_stage_and_microbatch():
    is_timeout, msg, elapsed = values(run_world(_dead_sender, 2))[1]
    assert not is_timeout and elapsed < 5, (msg, elapsed)  # not the 10 s timeout
    assert msg.startswith("stage 1: ") and "micro-batch 0 from stage 0" in msg, msg


def test_three_stage_relay():
    assert values(run_world(_relay, 3)) == {0: 0, 1: 1, 2: 2}


# A stage raised on micro-batch 9 (sequences 3 and 4; 4 is the bad one): the ones behind it,
# 10 and 11, ran on and are drained (their tokens may be wrong: they read K/V 9 left
# unwritten), 9's sequences are retried one at a time, then 10 and 11 run again (ray.py
# ``_isolate``). Stage 0 posts one receive per run, the last stage sends one message per run,
# in the same order; (id, seq_ids, what the last stage sampled in that run).
RUNS = [
    (9, [3, 4], {}),  # failed: nothing sampled
    (10, [1], {1: 666}),  # drained
    (11, [2], {2: 777}),  # drained
    (9, [3], {3: 30}),  # retried alone
    (9, [4], {}),  # retried alone: fails again
    (10, [1], {1: 100}),  # issued again
    (11, [2], {2: 200}),  # issued again
]


def _ring_reruns(rank: int, world_size: int, finished) -> Any:
    from sarathi_pp.comm.ring import TokenRing

    ring = TokenRing(rank, world_size, timeout_s=RECV_TIMEOUT_S, group=None, max_pending=16)
    for mb, seq_ids, sampled in RUNS:
        if rank == 0:
            ring.expect(mb, seq_ids)
        else:
            ring.send(mb, seq_ids, sampled)
    if rank == 0:  # a micro-batch scheduled ahead of 10, then ones of 9 and 11 (copies:
        # the ring keeps adding to its own)
        return [
            {j: dict(got) for j, got in ring.tokens(sources).items()}
            for sources in [(10,), (9,), (11,)]
        ]
    ring.flush(timeout_s=RECV_TIMEOUT_S)
    return None


def test_the_token_ring_gives_each_micro_batch_its_latest_run():
    """Note [the latest run wins] (comm/ring.py): a micro-batch that ran again after an
    isolation gives its decodes the tokens of its last run, not of the drained one (the
    ring stopped at the first newer id in posting order, and a decode scheduled ahead of
    10 read 666); a sequence its last run did not sample has none."""
    assert values(run_world(_ring_reruns, 2))[0] == [{10: {1: 100}}, {9: {3: 30}}, {11: {2: 200}}]


# --- single process: argument checks ------------------------------------------------------
def test_first_and_last_stage_have_no_peer_in_that_direction():
    t = StageTransport(0, 1, "cpu", timeout_s=1)  # one stage needs no process group
    with pytest.raises(RuntimeError, match="stage 0 is the last of 1 stages"):
        t.send(0, torch.zeros(1, HIDDEN_SIZE))
    with pytest.raises(RuntimeError, match="stage 0 is the first stage"):
        t.recv(0, 1, HIDDEN_SIZE, torch.float32)
    t.flush()  # nothing pending


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"stage_idx 2 is not in \[0, num_stages=2\)"):
        StageTransport(2, 2, "cpu", timeout_s=1)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        StageTransport(0, 1, "cpu", timeout_s=0)
    with pytest.raises(RuntimeError, match="call init_stage_group first"):
        StageTransport(0, 2, "cpu", timeout_s=1)
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        init_stage_group(0, 2, "127.0.0.1", free_port(), "mpi", 1)
    with pytest.raises(ValueError, match=r"rank 3 is not in \[0, world_size=2\)"):
        init_stage_group(3, 2, "127.0.0.1", free_port(), "gloo", 1)
    destroy_stage_group()  # nothing to destroy: a no-op
    destroy_stage_group()


def test_setup_helpers():
    assert 1024 <= free_port() <= 65535
    ipaddress.ip_address(node_ip())  # a parseable address
    assert pick_backend("cpu") == "gloo"
    if torch.distributed.is_nccl_available():
        assert pick_backend("cuda:1") == "nccl"
    else:
        with pytest.raises(ValueError, match="needs the NCCL backend"):
            pick_backend("cuda:1")
