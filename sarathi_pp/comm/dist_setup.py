"""Process-group set-up for the pipeline stages: one place for addresses, ports and backends.

One process per stage, rank = ``stage_idx``, world size = number of stages. The rendezvous
is a TCP store hosted by rank 0 at an address and port chosen at run time (``node_ip`` and
``free_port`` on the stage-0 process); nothing here is hard-coded.
"""

from __future__ import annotations

import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
_LOOPBACK = "127.0.0.1"
# A UDP "connect" sends no packet; it only asks the kernel which local address routes
# towards this private destination (which need not exist).
_ROUTE_PROBE = ("10.254.254.254", 1)


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it back, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def node_ip() -> str:
    """An address of this node that other nodes can reach; 127.0.0.1 as the last resort."""
    ray = sys.modules.get("ray")  # only ask Ray if the process already uses it
    if ray is not None:
        try:
            if ray.is_initialized():
                return str(ray.util.get_node_ip_address())
        except Exception:  # noqa: BLE001 - fall through to the socket tricks
            pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(_ROUTE_PROBE)
            ip = s.getsockname()[0]
            if ip and not ip.startswith("0."):
                return str(ip)
    except OSError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return _LOOPBACK


def pick_backend(device: str) -> str:
    """``nccl`` when the stages own CUDA devices, else ``gloo``."""
    if torch.device(device).type == "cuda":
        if not dist.is_nccl_available():
            raise ValueError(
                f"device {device!r} needs the NCCL backend, which this torch build lacks"
            )
        return "nccl"
    return "gloo"


def init_stage_group(
    rank: int, world_size: int, master_addr: str, master_port: int, backend: str, timeout_s: float
) -> None:
    """Join the stages' default process group (every stage calls this at once).

    ``timeout_s`` bounds the rendezvous and is the group's default collective timeout. On
    NCCL, call ``torch.cuda.set_device`` first. No ``device_id`` is bound on purpose: an
    eagerly bound NCCL communicator would also carry the point-to-point traffic, putting the
    send to stage s+1 and the receive from stage s-1 on one stream (see p2p.py).
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if not 1 <= master_port <= 65535:
        raise ValueError(f"master_port must be in [1, 65535], got {master_port}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if dist.is_initialized():
        raise RuntimeError(
            f"stage {rank}: a default process group already exists "
            f"(rank {dist.get_rank()} of {dist.get_world_size()}); call destroy_stage_group() first"
        )
    host = f"[{master_addr}]" if ":" in master_addr else master_addr  # IPv6 literal
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{host}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def destroy_stage_group() -> None:
    """Leave the default process group; a no-op when there is none (safe to call twice)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
