"""Process-group set-up for the pipeline stages: one place for addresses, ports and backends.

One process per stage, rank = ``stage_idx``, world size = number of stages. The rendezvous
is a TCP store hosted by rank 0 at an address and port chosen at run time (``node_ip`` and
``free_port``, or ``rendezvous_listener``, on the stage-0 process); nothing here is
hard-coded.

Note [what listens where]: rank 0's TCP store listens on exactly the rendezvous address
(torch's own store would listen on every interface: we hand it a socket bound to that
address, ``master_listen_fd``). Gloo listens on the address of ``GLOO_SOCKET_IFNAME``'s
interface, or else of this machine's hostname; when the rendezvous is on loopback (every
stage on this machine) and the user has not set ``GLOO_SOCKET_IFNAME``,
``bind_gloo_to_loopback`` sets it to the loopback interface. NCCL's own bootstrap sockets
follow ``NCCL_SOCKET_IFNAME``, which is left to the user.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
_LOOPBACK = "127.0.0.1"
_IFF_LOOPBACK = 0x8  # <linux/if.h>: the flag of a loopback interface
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


def is_loopback(addr: str) -> bool:
    """Whether ``addr`` is this machine's loopback: ``localhost``, 127.0.0.0/8 or ``::1``."""
    if addr.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(addr.strip("[]")).is_loopback
    except ValueError:
        return False


def loopback_interface() -> str:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS)."""
    for _, name in socket.if_nameindex():
        with contextlib.suppress(OSError, ValueError):
            if int(Path(f"/sys/class/net/{name}/flags").read_text(), 16) & _IFF_LOOPBACK:
                return name
    return "lo0" if sys.platform == "darwin" else "lo"


def bind_gloo_to_loopback() -> str | None:
    """Make gloo groups created from now on in this process listen on loopback only: sets
    ``GLOO_SOCKET_IFNAME`` to the loopback interface unless the user set it. Only right
    when every rank is on this machine. Returns the interface set, ``None`` if left alone."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    name = loopback_interface()
    os.environ["GLOO_SOCKET_IFNAME"] = name
    return name


def rendezvous_listener(addr: str, port: int = 0) -> socket.socket:
    """A listening TCP socket on exactly ``addr`` (port 0: one the kernel picks), for rank 0
    to host the TCP store on (``init_stage_group(listener=...)``). Holding it from the
    moment the address is handed out leaves no window for another process to take the port."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[
            0
        ]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise RuntimeError(f"cannot host the stages' rendezvous on {addr}:{port}: {e}") from e
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own store does
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise RuntimeError(
            f"cannot host the stages' rendezvous on {addr}:{port}: {e} (stage 0 must own "
            "that address)"
        ) from e
    return sock


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
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str,
    timeout_s: float,
    listener: socket.socket | None = None,
) -> None:
    """Join the stages' default process group (every stage calls this at once).

    Rank 0 hosts the TCP store on ``listener`` (``rendezvous_listener``; this call takes it
    over) or else on a socket it binds to ``master_addr:master_port``: on that address only
    (Note [what listens where]). A loopback ``master_addr`` also binds gloo to loopback.
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
    if listener is not None and rank != 0:
        raise ValueError(f"only rank 0 hosts the rendezvous; rank {rank} was given a listener")
    if is_loopback(master_addr):
        bind_gloo_to_loopback()
    timeout = timedelta(seconds=timeout_s)
    store = _rendezvous_store(rank, world_size, master_addr, master_port, timeout, listener)
    dist.init_process_group(
        backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
    )


def _rendezvous_store(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    timeout: timedelta,
    listener: socket.socket | None,
) -> dist.TCPStore:
    """Rank 0: the TCP store's server on ``listener``; the others: a client of it."""
    if rank != 0:
        return dist.TCPStore(master_addr, master_port, world_size, False, timeout)
    sock = listener or rendezvous_listener(master_addr, master_port)
    with sock:  # the store gets its own descriptor of the socket; ours is closed after
        return dist.TCPStore(
            master_addr,
            int(sock.getsockname()[1]),
            world_size,
            True,
            timeout,
            master_listen_fd=os.dup(sock.fileno()),
        )


def destroy_stage_group() -> None:
    """Leave the default process group; a no-op when there is none (safe to call twice)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
