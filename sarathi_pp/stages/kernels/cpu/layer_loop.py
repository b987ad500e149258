"""``layer_loop.c``: a stage's decoder layers over one micro-batch as one C call, through the
other kernels' addresses (``model/layer_loop.py`` builds its arguments and calls it; Note
[the layer loop] there). The ctypes structures below mirror the C ones field for field.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from typing import TYPE_CHECKING

from sarathi_pp.stages.kernels.cpu.build import KERNEL_DIR, KernelUnavailable, build

if TYPE_CHECKING:
    from _ctypes import CFuncPtr

log = logging.getLogger(__name__)

_SOURCE = KERNEL_DIR / "layer_loop.c"


def ws_floats(hidden: int, inter: int, q_dim: int, kv_dim: int) -> int:
    """Scratch floats per row (the C loop's h, qkv, q, attention out, o, gate_up, act, down)."""
    return hidden + (q_dim + 2 * kv_dim) + 2 * q_dim + hidden + 3 * inter + hidden


P = ctypes.c_void_p


class Kernels(ctypes.Structure):
    _fields_ = [(n, P) for n in ("gemm", "rms", "rot", "silu", "decode", "prefill")]


class Layer(ctypes.Structure):
    _fields_ = [(n, P) for n in ("ln1", "ln2", "qkv", "qkv_bias", "o", "gate_up", "down", "k", "v")]


class Dims(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int64), ("inter", ctypes.c_int64), ("heads", ctypes.c_int),
        ("kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int), ("block_size", ctypes.c_int),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("cos", P), ("sin", P),
        ("max_positions", ctypes.c_int64),
    ]  # fmt: skip


class Batch(ctypes.Structure):
    _fields_ = [
        ("rows", ctypes.c_int64), ("positions", P), ("slots", P), ("num_prefills", ctypes.c_int64),
        ("prefill_row", P), ("prefill_len", P), ("prefill_start", P), ("prefill_blocks", P),
        ("num_decodes", ctypes.c_int64), ("decode_tables", P), ("decode_stride", ctypes.c_int64),
        ("decode_lens", P),
    ]  # fmt: skip


@cache
def load_loop() -> CFuncPtr | None:
    """The compiled ``layer_loop_f32``, or None where nothing builds (logged once). It only
    calls other kernels, so it needs no OpenMP."""
    try:
        lib, _ = build("layer_loop", _SOURCE)
    except KernelUnavailable as e:
        log.warning("CPU layer loop unavailable, running layers op by op: %s", e)
        return None
    fn = lib.layer_loop_f32
    fn.argtypes = [P, P, ctypes.c_int, P, P, P, P, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn
