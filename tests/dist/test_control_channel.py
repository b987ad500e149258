"""torchrun's control channel (``ObjectChannel``) and the stages' rendezvous over real gloo
groups, one OS process per rank (``run_world`` of ``test_transport``).

- Messages travel as plain data and come back equal; a length header over the limit, or
  bytes that are not a message, fail with a ``StageCommError`` naming the sending rank.
- With the rendezvous on loopback, nothing this process group opens listens anywhere but
  loopback: rank 0's TCP store is on exactly the rendezvous address, gloo on ``lo``.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from test_transport import run_world, values

from sarathi_pp.comm.dist_setup import (
    bind_gloo_to_loopback,
    is_loopback,
    loopback_interface,
    rendezvous_listener,
)
from sarathi_pp.comm.objects import MAX_MESSAGE_BYTES, ObjectChannel
from sarathi_pp.comm.p2p import StageCommError
from sarathi_pp.microbatch import MicroBatch, MicroBatchResult, ScheduledChunk, StageEvent
from sarathi_pp.sampling_params import SamplingParams
from sarathi_pp.stage_memory import StageMemory

TIMEOUT_S = 10.0
EVENT = StageEvent(1, 4, "hybrid", 3, 1, 0.25, 0.5, 0.75, 1.0, 1.25)
MESSAGES = [
    MicroBatch(
        4,
        (
            ScheduledChunk(1, 0, (5, 6, 7), True, (0,), SamplingParams(max_tokens=3, seed=9)),
            ScheduledChunk(2, 11, (8,), False, (1,), SamplingParams(temperature=0), 4),
        ),
    ),
    StageMemory(1, 10, 20, 30),
    (128, 16),
    ("ok", 1, 4, (MicroBatchResult({1: 42, 2: 7}, {3: "non-finite logits"}), EVENT)),
    ("error", 1, 5, "RuntimeError: boom"),
    None,
]


def _channel() -> ObjectChannel:
    import torch.distributed as dist

    return ObjectChannel(dist.new_group(backend="gloo"), TIMEOUT_S)


def _raw_send(header: int, payload: bytes | None) -> None:
    """What a peer that is not a sarathi-pp rank (or a corrupted stream) might send."""
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")
    dist.send(torch.tensor([header], dtype=torch.int64), 0, group=group)
    if payload is not None:
        dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0, group=group)


def _receive_one(what: str) -> str:
    try:
        got = _channel().recv(1, what)
    except StageCommError as e:
        return f"StageCommError: {e}"
    return f"received {got!r}"


# --- worlds (module-level, so the forkserver children can import them) ---------------------
def _round_trip(rank: int, world_size: int, finished: Any) -> Any:
    channel = _channel()
    if rank == 1:
        for m in MESSAGES:
            channel.send(m, 0)
        channel.flush()
        return None
    return [channel.recv(1, "a message") for _ in MESSAGES]


def _oversized_header(rank: int, world_size: int, finished: Any) -> Any:
    if rank == 1:
        _raw_send(2**40, None)  # a terabyte: refused before anything is allocated
        return None
    return _receive_one("the next micro-batch")


def _negative_header(rank: int, world_size: int, finished: Any) -> Any:
    if rank == 1:
        _raw_send(-5, None)
        return None
    return _receive_one("the next micro-batch")


def _garbage(rank: int, world_size: int, finished: Any) -> Any:
    import pickle

    payload = pickle.dumps(("ok", 1, 4, None))  # pickle is refused like any other garbage
    if rank == 1:
        _raw_send(len(payload), payload)
        return None
    return _receive_one("micro-batch 4's tokens")


def _listening(rank: int, world_size: int, finished: Any) -> Any:
    return {"ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "listening": listening_sockets()}


# --- helpers ---------------------------------------------------------------------------------
def listening_sockets() -> list[tuple[str, int]]:
    """(address, port) of every TCP socket this process listens on (Linux ``/proc``)."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = cols[1].split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, size, 4))
            out.append((str(ipaddress.ip_address(raw)), int(hex_port, 16)))
    return out


# --- tests -----------------------------------------------------------------------------------
def test_messages_travel_as_plain_data_and_come_back_equal():
    got = values(run_world(_round_trip, 2))[0]
    assert got == MESSAGES


@pytest.mark.parametrize(
    ("world", "says"),
    [
        (
            _oversized_header,
            f"the length header says {2**40} bytes, outside [1, {MAX_MESSAGE_BYTES}]",
        ),
        (_negative_header, "the length header says -5 bytes"),
        (_garbage, "malformed message: not msgpack"),
    ],
)
def test_a_bad_message_is_a_clear_error_naming_the_rank(world, says):
    got = values(run_world(world, 2))[0]
    assert got.startswith("StageCommError: "), got
    assert "from rank 1" in got and says in got, got


def test_a_message_over_the_limit_is_refused_by_the_sender():
    channel = ObjectChannel(group=None, timeout_s=1.0, max_message_bytes=64)
    with pytest.raises(ValueError, match="over the limit of 64 bytes"):
        channel.send(MicroBatch(0, (ScheduledChunk(0, 0, tuple(range(100)), True, ()),)), 1)
    with pytest.raises(ValueError, match="cannot travel"):  # not a message at all
        channel.send({"a": 1}, 1)


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux /proc")
@pytest.mark.skipif(
    bool(os.environ.get("GLOO_SOCKET_IFNAME")), reason="the user's GLOO_SOCKET_IFNAME wins"
)
def test_a_loopback_rendezvous_listens_on_loopback_only():
    out = values(run_world(_listening, 2))
    lo = loopback_interface()
    for rank, seen in out.items():
        assert seen["ifname"] == lo, (rank, seen)
        assert seen["listening"], (rank, seen)  # gloo listens; rank 0 also hosts the store
        assert all(is_loopback(addr) for addr, _ in seen["listening"]), (rank, seen)
    assert len(out[0]["listening"]) > len(out[1]["listening"])  # the store is rank 0's


def test_the_users_gloo_interface_wins(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert bind_gloo_to_loopback() is None
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert bind_gloo_to_loopback() == loopback_interface()
    assert os.environ["GLOO_SOCKET_IFNAME"] == loopback_interface()


@pytest.mark.parametrize(
    ("addr", "expected"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("10.0.0.5", False),
        ("0.0.0.0", False),
        ("node-3", False),
        ("", False),
    ],
)
def test_is_loopback(addr, expected):
    assert is_loopback(addr) is expected


def test_the_rendezvous_listener_is_bound_to_exactly_its_address():
    with rendezvous_listener("127.0.0.1") as sock:
        addr, port = sock.getsockname()[:2]
        assert addr == "127.0.0.1" and port > 0
        with socket.create_connection((addr, port), timeout=2):
            pass  # it accepts connections before anyone calls accept()
    with pytest.raises(RuntimeError, match="cannot host the stages' rendezvous on 192.0.2.99"):
        rendezvous_listener("192.0.2.99")  # TEST-NET-1: no machine owns it
