"""What a micro-batch costs on each pipeline stage: one interface, three models.

``CostModel.costs(microbatch)`` -> ``MicrobatchCost``: each stage's compute seconds, each
stage's send to the next one, and the return of the sampled tokens to the driver.

- ``AnalyticCostModel``: the roofline of ``analytic.py`` on a ``Hardware`` (tensor
  parallelism inside each stage, pipeline sends over the inter-node network or NVLink);
- ``ProfiledCostModel`` (``profiled.py``): a ``sarathi-pp profile`` CSV of this machine;
- ``ScriptedCostModel``: times given by a function of the stage and the micro-batch (the
  tests: a pipeline whose timings are known, a stall on one micro-batch, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from sarathi_pp.microbatch import MicroBatch
from sarathi_pp.model_spec import ModelSpec
from sarathi_pp.sim.analytic import (
    LayerShape,
    Rows,
    attn_decode,
    attn_prefill,
    embed_ops,
    head_ops,
    layer_ops,
    op_seconds,
)
from sarathi_pp.sim.hardware import Hardware

PP_LINKS = ("network", "nvlink")


@dataclass(frozen=True, slots=True)
class MicrobatchCost:
    compute_s: tuple[float, ...]  # per stage
    send_s: tuple[float, ...]  # per stage: to the next stage (the last: 0)
    return_s: float  # the last stage's sampled tokens to the driver


class CostModel(Protocol):
    num_stages: int

    def costs(self, microbatch: MicroBatch) -> MicrobatchCost: ...
    def describe(self) -> str: ...


class AnalyticCostModel:
    """``layer_ranges``: the placement's ``[start, end)`` per stage; ``tp`` GPUs per stage;
    ``pp_link``: what carries the pipeline sends (``network``: stages on different nodes)."""

    def __init__(
        self,
        spec: ModelSpec,
        hardware: Hardware,
        layer_ranges: tuple[tuple[int, int], ...],
        tp: int = 1,
        dtype: str = "bfloat16",
        pp_link: str = "network",
    ) -> None:
        if pp_link not in PP_LINKS:
            raise ValueError(f"pp_link must be one of {PP_LINKS}, got {pp_link!r}")
        self.spec, self.hw, self.tp, self.pp_link = spec, hardware, tp, pp_link
        self.shape = LayerShape.of(spec, tp, dtype)
        self.num_layers = tuple(end - start for start, end in layer_ranges)
        self.num_stages = len(layer_ranges)
        self._by_rows: dict[int, float] = {}

    def describe(self) -> str:
        return (
            f"analytic roofline on {self.hw.name} (TP{self.tp} x PP{self.num_stages}, "
            f"{self.shape.dtype_bytes}-byte dtype, tile {self.hw.matmul_tile}, "
            f"pipeline link {self.pp_link})"
        )

    def layer_seconds(self, rows: Rows) -> float:
        """One layer's time: the operators that depend only on the row count (GEMMs, norms,
        all-reduces) are cached by it; attention depends on every context."""
        n = rows.num_rows
        fixed = self._by_rows.get(n)
        if fixed is None:
            flat = Rows(((0, n),), (), 0)  # attention aside, only the row count matters
            ops = layer_ops(self.shape, flat, self.hw.matmul_tile, self.tp, self.hw)
            fixed = sum(op_seconds(op, self.hw) for op in ops if not op.name.startswith("attn"))
            self._by_rows[n] = fixed
        attn = (attn_prefill(self.shape, rows), attn_decode(self.shape, rows))
        return fixed + sum(op_seconds(op, self.hw) for op in attn)

    def costs(self, microbatch: MicroBatch) -> MicrobatchCost:
        rows = Rows.of(microbatch)
        layer = self.layer_seconds(rows)
        compute = [n * layer for n in self.num_layers]
        compute[0] += sum(op_seconds(op, self.hw) for op in embed_ops(self.shape, rows))
        head = head_ops(self.shape, rows, self.hw.matmul_tile, self.tp, self.hw)
        compute[-1] += sum(op_seconds(op, self.hw) for op in head)
        send = self.send_seconds(rows.num_rows)
        sends = tuple(send if s < self.num_stages - 1 else 0.0 for s in range(self.num_stages))
        ret = self.link_latency() if self.num_stages > 1 else 0.0
        return MicrobatchCost(tuple(compute), sends, ret)

    def link_latency(self) -> float:
        hw = self.hw
        us = hw.network_latency_us if self.pp_link == "network" else hw.nvlink_latency_us
        return us * 1e-6

    def send_seconds(self, num_rows: int) -> float:
        """Hidden states ``[num_rows, hidden]`` to the next stage, each of the ``tp`` GPUs
        sending its share over its own link."""
        nbytes = num_rows * self.shape.hidden * self.shape.dtype_bytes / self.tp
        bw = (
            self.hw.network_bytes_per_s if self.pp_link == "network" else self.hw.nvlink_bytes_per_s
        )
        return nbytes / bw + self.link_latency()


class ScriptedCostModel:
    """Each stage's compute of a micro-batch is ``compute_s(stage_idx, microbatch)``
    (the micro-batch's id, kind, tokens and chunks are there to choose by); every send to
    the next stage takes ``send_s`` and the sampled tokens' return ``return_s``. For
    pipelines whose timings a test states (1 s per compute, 10x on micro-batch 5, ...)
    rather than derives from a model and a GPU."""

    def __init__(
        self,
        num_stages: int,
        compute_s: Callable[[int, MicroBatch], float],
        send_s: float = 0.0,
        return_s: float = 0.0,
    ) -> None:
        for name, v in (("send_s", send_s), ("return_s", return_s)):
            if not (isinstance(v, (int, float)) and v >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")
        self.num_stages = num_stages
        self.compute_s, self.send_s, self.return_s = compute_s, send_s, return_s

    def costs(self, microbatch: MicroBatch) -> MicrobatchCost:
        compute = tuple(float(self.compute_s(s, microbatch)) for s in range(self.num_stages))
        if any(not c >= 0 for c in compute):
            raise ValueError(f"micro-batch {microbatch.microbatch_id}: compute {compute} < 0")
        last = self.num_stages - 1
        sends = tuple(self.send_s if s < last else 0.0 for s in range(self.num_stages))
        return MicrobatchCost(compute, sends, self.return_s)

    def describe(self) -> str:
        name = getattr(self.compute_s, "__name__", repr(self.compute_s))
        return f"scripted ({name}; send {self.send_s} s, return {self.return_s} s)"
