"""A simulated GPU: the figures of ``configs/hardware/*.yaml``, checked.

Every figure is per GPU. Rates and bandwidths are peaks from the datasheets; the
``*_efficiency`` fractions turn them into what a real kernel achieves (the roofline's
ceilings are ``matmul_tflops x matmul_efficiency`` and ``memory_bandwidth_gbs x
memory_efficiency``). ``nvlink_*`` is the intra-node link the tensor-parallel all-reduces
use; ``network_*`` the inter-node link of the pipeline sends. A bad file is a
``ValueError`` naming the file and the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

GiB = 1 << 30
HARDWARE_DIR = Path("configs/hardware")  # where a bare name (``a100-80gb``) is looked up


@dataclass(frozen=True)
class Hardware:
    name: str
    matmul_tflops: float
    """Dense BF16/FP16 tensor-core peak, 10^12 FLOP/s."""
    matmul_efficiency: float
    """Achievable fraction of ``matmul_tflops``, in (0, 1]."""
    memory_gib: float
    """Device memory, GiB (what ``gpu_memory_utilization`` is a fraction of)."""
    memory_bandwidth_gbs: float
    """Device memory bandwidth, 10^9 B/s."""
    memory_efficiency: float
    """Achievable fraction of ``memory_bandwidth_gbs``, in (0, 1]."""
    nvlink_bandwidth_gbs: float
    """Intra-node GPU-to-GPU bandwidth per direction, 10^9 B/s (tensor parallelism)."""
    nvlink_latency_us: float
    """Latency of one small all-reduce over the intra-node link, microseconds."""
    network_bandwidth_gbs: float
    """Inter-node bandwidth per GPU (its NIC), 10^9 B/s (pipeline sends)."""
    network_latency_us: float
    """Latency of one inter-node send, microseconds."""
    matmul_tile: int = 128
    """Rows of a matmul tile: a GEMM over N rows costs the FLOPs of N rounded up to it."""
    sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name in ("name", "sources"):
                continue
            if f.name == "matmul_tile":
                t = self.matmul_tile
                if isinstance(t, bool) or not isinstance(t, int) or t < 1:
                    raise ValueError(
                        f"hardware {self.name!r}: matmul_tile must be an integer >= 1, got {t!r}"
                    )
                continue
            v = getattr(self, f.name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            minimum_ok = ok and (v >= 0 if f.name.endswith("latency_us") else v > 0)
            if not minimum_ok:
                bound = ">= 0" if f.name.endswith("latency_us") else "> 0"
                raise ValueError(
                    f"hardware {self.name!r}: {f.name} must be a number {bound}, got {v!r}"
                )
            if f.name.endswith("efficiency") and v > 1:
                raise ValueError(f"hardware {self.name!r}: {f.name} must be in (0, 1], got {v!r}")

    # --- the ceilings, in SI units ------------------------------------------------------
    @property
    def flops_per_s(self) -> float:
        return self.matmul_tflops * 1e12 * self.matmul_efficiency

    @property
    def bytes_per_s(self) -> float:
        return self.memory_bandwidth_gbs * 1e9 * self.memory_efficiency

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GiB)

    @property
    def nvlink_bytes_per_s(self) -> float:
        return self.nvlink_bandwidth_gbs * 1e9

    @property
    def network_bytes_per_s(self) -> float:
        return self.network_bandwidth_gbs * 1e9


_REQUIRED = tuple(
    f.name for f in fields(Hardware) if f.name not in ("name", "sources", "matmul_tile")
)


def hardware_from_dict(d: Any, source: str) -> Hardware:
    if not isinstance(d, dict):
        raise ValueError(f"{source}: a hardware file must hold a mapping, got {type(d).__name__}")
    allowed = {f.name for f in fields(Hardware)}
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ValueError(
            f"{source}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}"
        )
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise ValueError(f"{source}: missing key(s) {', '.join(missing)}")
    sources = d.get("sources") or ()
    if not isinstance(sources, (list, tuple)):
        raise ValueError(f"{source}: sources must be a list of strings")
    try:
        return Hardware(
            **{
                **d,
                "name": str(d.get("name", Path(source).stem)),
                "sources": tuple(map(str, sources)),
            }
        )
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def load_hardware(path: str | Path) -> Hardware:
    """``configs/hardware/NAME.yaml`` (or a bare name found there)."""
    p = Path(path)
    if not p.is_file() and not p.suffix:
        p = HARDWARE_DIR / f"{path}.yaml"
    if not p.is_file():
        known = ", ".join(sorted(f.stem for f in HARDWARE_DIR.glob("*.yaml")))
        raise FileNotFoundError(
            f"hardware file {str(path)!r} does not exist (nor {HARDWARE_DIR}/{path}.yaml; "
            f"known there: {known or 'none'})"
        )
    try:
        d = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"hardware file {str(p)!r} is not valid YAML: {e}") from e
    return hardware_from_dict(d, str(p))
