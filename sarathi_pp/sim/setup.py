"""What a simulation runs on: the cost model (analytic on a ``Hardware``, or a profile
CSV of this machine), tensor parallelism, replicas, the runtime's overheads; and the
``SimCluster`` built from it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sarathi_pp.config import EngineConfig
from sarathi_pp.placement import Placement, Resources
from sarathi_pp.sim.clock import SimClock
from sarathi_pp.sim.cluster import ROUTINGS, SimCluster
from sarathi_pp.sim.cost_model import PP_LINKS, AnalyticCostModel, CostModel
from sarathi_pp.sim.executor import Overheads, SimExecutor
from sarathi_pp.sim.hardware import Hardware, load_hardware


@dataclass(frozen=True)
class SimSetup:
    hardware: Hardware | None = None  # analytic model on this GPU ...
    profile: Path | None = None  # ... or the profiled model from this CSV
    tp: int = 1  # GPUs per stage (tensor parallel), analytic only
    replicas: int = 1
    routing: str = "round_robin"
    pp_link: str = "network"  # what carries the pipeline sends, analytic only
    overheads: Overheads = field(default_factory=Overheads)

    def __post_init__(self) -> None:
        if (self.hardware is None) == (self.profile is None):
            raise ValueError("give exactly one cost model: --hardware FILE or --profile CSV")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"--tp must be an integer >= 1, got {self.tp!r}")
        if self.profile is not None and self.tp != 1:
            raise ValueError("--tp applies to the analytic model only (a profile is one stage's)")
        if self.routing not in ROUTINGS:
            raise ValueError(f"unknown routing {self.routing!r}; valid: {', '.join(ROUTINGS)}")
        if self.pp_link not in PP_LINKS:
            raise ValueError(f"unknown pp link {self.pp_link!r}; valid: {', '.join(PP_LINKS)}")

    @classmethod
    def analytic(cls, hardware: str | Path, **kw: Any) -> SimSetup:
        return cls(hardware=load_hardware(hardware), **kw)

    def resources(self, num_stages: int) -> Resources:
        if self.hardware is not None:
            hw = self.hardware
            return Resources(
                num_cpu_cores=1, num_cuda_devices=num_stages, cuda_memory_bytes=hw.memory_bytes,
                cuda_bf16=True, description=f"the simulated {hw.name}",
            )  # fmt: skip
        return Resources(num_cpu_cores=len(os.sched_getaffinity(0)), description="this machine")

    def cost_model(self, spec: Any, placement: Placement) -> CostModel:
        if self.hardware is not None:
            return AnalyticCostModel(
                spec, self.hardware, placement.layer_ranges, self.tp, placement.dtype, self.pp_link
            )
        from sarathi_pp.sim.profiled import ProfiledCostModel

        assert self.profile is not None
        return ProfiledCostModel.from_csv(self.profile, placement.layer_ranges)

    def describe(self) -> str:
        where = self.hardware.name if self.hardware is not None else f"profile {self.profile}"
        r = f", {self.replicas} replicas ({self.routing})" if self.replicas > 1 else ""
        return f"simulated: {where}, TP{self.tp}{r}"


def build_cluster(config: EngineConfig, setup: SimSetup) -> SimCluster:
    """``setup.replicas`` simulated engines of ``config`` (run dirs are given per run)."""
    config = config.replace(run_dir=None, overwrite=False)
    resources = setup.resources(config.parallel.pipeline_parallel_size)

    def make_executor(cfg: EngineConfig, checkpoint: Any, clock: SimClock) -> SimExecutor:
        def cost(placement: Placement) -> CostModel:
            return setup.cost_model(checkpoint.spec, placement)

        return SimExecutor(cfg, checkpoint, resources, cost, clock, setup.overheads, setup.tp)

    return SimCluster(config, make_executor, setup.replicas, setup.routing)
