"""The benchmark's peers by name (``sarathi-pp bench --peer NAME``): another engine served
the same requests, its outputs and timings set beside ours. As the executors are, each is
reached through this registry by name and imported only when chosen, so the benchmark
suite (which the simulator also runs) imports no torch until a peer runs."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

# name -> "module:function": function(model_dir, requests, *, dtype, num_threads, progress)
# -> PeerResult (``bench/peer_hf.py`` has the contract's reference).
_PEERS = {"hf": "sarathi_pp.bench.peer_hf:run_hf_peer"}
PEERS = tuple(_PEERS)


def peer_runner(name: str) -> Callable[..., Any]:
    """The function that serves a workload with peer ``name``; ``ValueError`` listing the
    valid names otherwise."""
    if name not in _PEERS:
        raise ValueError(f"unknown peer {name!r}; valid: {', '.join(_PEERS)}")
    module, _, function = _PEERS[name].partition(":")
    return getattr(importlib.import_module(module), function)
