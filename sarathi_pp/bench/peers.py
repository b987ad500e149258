"""The benchmark's peers by name (``sarathi-pp bench --peer NAME``): another engine served
the same requests, its outputs and timings set beside ours. As the executors are, each is
reached through this registry by name and imported only when chosen, so the benchmark
suite (which the simulator also runs) imports no torch until a peer runs."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

# name -> "module:function": function(model_dir, requests, *, dtype, num_threads, progress,
# and those of num_stages, log_dir it accepts) -> PeerResult (``bench/peer_hf.py`` has the
# contract's reference).
_PEERS = {
    "hf": "sarathi_pp.bench.peer_hf:run_hf_peer",
    "vllm": "sarathi_pp.bench.peer_vllm:run_vllm_peer",
}
# name -> "module:function": function() raising FileNotFoundError / ValueError when the
# peer cannot run here (checked before any model loads).
_CHECKS = {"vllm": "sarathi_pp.bench.peer_vllm:check_peer"}
PEERS = tuple(_PEERS)


def peer_runner(name: str) -> Callable[..., Any]:
    """The function that serves a workload with peer ``name``; ``ValueError`` listing the
    valid names otherwise."""
    if name not in _PEERS:
        raise ValueError(f"unknown peer {name!r}; valid: {', '.join(_PEERS)}")
    return _load(_PEERS[name])


def check_peer(name: str) -> None:
    """Raise (``FileNotFoundError``, ``ValueError``) if peer ``name`` cannot run here."""
    peer_runner(name)  # a known name
    if name in _CHECKS:
        _load(_CHECKS[name])()


def parse_peers(text: str) -> tuple[str, ...]:
    """``"hf,vllm"`` -> ``("hf", "vllm")``; ``ValueError`` for an unknown or repeated name."""
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    if not names:
        raise ValueError(f"--peer: no peer in {text!r}; valid: {', '.join(_PEERS)}")
    for name in names:
        if name not in _PEERS:
            raise ValueError(f"unknown peer {name!r}; valid: {', '.join(_PEERS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--peer: a peer is listed twice: {text}")
    return names


def _load(target: str) -> Callable[..., Any]:
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)
