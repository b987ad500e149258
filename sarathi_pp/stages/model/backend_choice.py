"""Which attention backend a stage runs, and every fallback it takes, with its reason.

``choose_backend`` turns ``model.attention_backend`` into the backend that can run on this
stage (device, dtype, KV block size, installed packages); ``auto`` is ``select_backend``'s
choice. A backend asked for by name that cannot run here falls back to ``auto``'s choice,
and a backend that fails on a micro-batch falls back per call (gather + SDPA): either way
``AttentionRecord.fallback`` logs a WARNING once per new reason and keeps the reason, which
reaches the run dir with the stage's next ``StageEvent`` (``summary.json``'s
``attention``). With ``model.strict_attention_backend`` a fallback raises
``AttentionFallbackError`` instead (Note [no silent fallback]).

Note [no silent fallback]: a benchmark that names a backend must measure that backend. A
fallback that only logs once is invisible in a report: the first GPU run of flex_paged would
have measured gather + SDPA under the name flex_paged. So the backend that ran is a figure of
the run, beside its timings, and strict mode turns any fallback into an error.
"""

from __future__ import annotations

import logging

import torch

from sarathi_pp.microbatch import AttentionReport
from sarathi_pp.stages.kernels.cpu.paged_attention import load_kernel, load_prefill
from sarathi_pp.stages.model.flex_paged import flex_available, flex_block_size_ok

log = logging.getLogger(__name__)

FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)


class AttentionFallbackError(RuntimeError):
    """An attention fallback under ``model.strict_attention_backend``."""


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(device: torch.device, block_size: int, dtype: torch.dtype | None = None) -> str:
    """``auto``: on CPU ``cpu_paged`` for float32 when its kernel builds, else ``torch``. On
    CUDA ``flash_attn`` when importable and the dtype (float16/bfloat16, never float32) and
    block size (a multiple of 256) suit its paged kernels, else ``flex_paged`` when
    FlexAttention takes the block size (a multiple of 16), else ``torch``."""
    if device.type == "cpu":
        if dtype in (None, torch.float32) and load_kernel() is not None:
            return "cpu_paged"
        return "torch"
    if device.type != "cuda":
        return "torch"
    if unsupported("flash_attn", device, dtype, block_size) is None:
        return "flash_attn"
    if unsupported("flex_paged", device, dtype, block_size) is None:
        return "flex_paged"
    return "torch"


def unsupported(
    backend: str, device: torch.device, dtype: torch.dtype | None, block_size: int
) -> str | None:
    """Why ``backend`` cannot run on ``device`` with ``dtype`` and KV blocks of
    ``block_size`` tokens, or ``None`` when it can."""
    if backend == "torch":
        return None
    if backend == "cpu_paged":
        if device.type != "cpu":
            return f"its kernels run on CPU, not {device.type}"
        if dtype not in (None, torch.float32):
            return f"its kernels take float32, not {str(dtype).removeprefix('torch.')}"
        if load_kernel() is None:
            return "its C kernel did not build here (see the log)"
        return None
    if backend == "flex_paged":
        if not flex_available():
            return (
                f"torch {torch.__version__} has no FlexAttention whose "
                "BlockMask.from_kv_blocks takes compute_q_blocks and seq_lengths"
            )
        if device.type == "cuda" and not flex_block_size_ok(block_size):
            return f"its Triton kernels take KV blocks of a multiple of 16 tokens, not {block_size}"
        if device.type not in ("cpu", "cuda"):
            return f"not on {device.type}"
        return None
    if backend == "flash_attn":
        if device.type != "cuda":
            return f"it runs on CUDA, not {device.type}"
        if dtype not in FLASH_ATTN_DTYPES:
            return f"it takes float16/bfloat16, not {str(dtype).removeprefix('torch.')}"
        if block_size % 256:
            return f"its paged kernels take KV blocks of a multiple of 256 tokens, not {block_size}"
        if not flash_attn_available():
            return "flash-attn is not installed"
        return None
    raise ValueError(f"unknown attention backend {backend!r}")


class AttentionRecord:
    """One stage's attention: the backend that runs and every fallback it took (in order,
    each reason once). ``strict``: a fallback raises instead."""

    def __init__(self, stage_idx: int, backend: str, strict: bool = False) -> None:
        self.stage_idx = stage_idx
        self.backend = backend
        self.strict = strict
        self.fallbacks: list[str] = []
        self._reported = False  # the current state went out with a StageEvent

    def fallback(self, reason: str, strict: bool = True) -> None:
        """``self.backend`` fell back, for ``reason``: raise under strict mode, else log a
        WARNING the first time this reason comes and keep it for the run dir. ``strict``
        false: never raises (a fallback of the stage's that is not attention's: CUDA
        graphs, ``stages/worker/cuda_graphs.py``)."""
        if self.strict and strict:
            raise AttentionFallbackError(
                f"stage {self.stage_idx}: attention backend {self.backend}: {reason} "
                "(model.strict_attention_backend is set)"
            )
        if reason in self.fallbacks:
            return
        self.fallbacks.append(reason)
        self._reported = False
        log.warning("stage %d: attention %s fell back: %s", self.stage_idx, self.backend, reason)

    def report(self) -> AttentionReport:
        return AttentionReport(self.backend, tuple(self.fallbacks))

    def take_report(self) -> AttentionReport | None:
        """The report when it changed since the last taken (the first time: always), else
        ``None``: what the stage's next ``StageEvent`` carries."""
        if self._reported:
            return None
        self._reported = True
        return self.report()


def choose_backend(
    requested: str,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    record: AttentionRecord,
) -> str:
    """The backend this stage runs for ``model.attention_backend`` = ``requested``; sets
    ``record.backend`` and records (or, strict, raises on) a fallback."""
    auto = select_backend(device, block_size, dtype)
    backend = auto if requested == "auto" else requested
    why = unsupported(backend, device, dtype, block_size)
    record.backend = backend
    if why is not None:
        record.fallback(f"{backend} cannot run here: {why}; running {auto}")
        backend = record.backend = auto
    if backend == "cpu_paged" and load_prefill() is None:
        record.fallback(
            "prefill chunks run gather + SDPA: the paged prefill kernel needs AVX-512 or AVX2 + FMA"
        )
    return backend
