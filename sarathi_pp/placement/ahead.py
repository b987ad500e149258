"""Whether the driver schedules ahead (``parallel.schedule_ahead``: one micro-batch more in
flight, its decodes fed by the token ring), decided from the placement it runs on. Pure
Python, no torch: the executors, the planner and the simulator resolve ``auto`` here."""

from __future__ import annotations

from dataclasses import dataclass

from sarathi_pp.config import EngineConfig
from sarathi_pp.placement.resolve import Placement, Resources


@dataclass(frozen=True)
class ScheduleAhead:
    """``parallel.schedule_ahead`` resolved: ``on``, and why (``source``, for reports)."""

    on: bool
    source: str = "parallel.schedule_ahead"

    def __bool__(self) -> bool:
        return self.on


OFF = ScheduleAhead(False)


def resolve_schedule_ahead(
    config: EngineConfig, placement: Placement, resources: Resources
) -> ScheduleAhead:
    """``schedule_ahead: auto``: on for the ``ray`` executor with 2+ stages when the driver
    has a core of its own (stages on GPUs, or CPU stages whose threads leave a core free).
    Scheduling ahead moves the driver's work beside the stages' compute: where the stages'
    threads take every core it competes with them and slows them down (the design page
    "The control plane", "What to choose": scheduling ahead)."""
    p = config.parallel
    if p.schedule_ahead != "auto":
        return ScheduleAhead(bool(p.schedule_ahead))
    if p.pipeline_parallel_size == 1:
        return ScheduleAhead(False, "auto: one stage")
    if p.executor_name != "ray":
        return ScheduleAhead(False, f"auto: the {p.executor_name} executor has no token ring")
    if p.microbatches_in_flight < p.pipeline_parallel_size:
        return ScheduleAhead(False, "auto: fewer micro-batches in flight than stages")
    device = placement.device
    if device != "cpu":
        return ScheduleAhead(
            True, f"auto: the stages are on {device} devices, the driver on a CPU core"
        )
    used = p.pipeline_parallel_size * (placement.num_threads or 1)
    cores = resources.num_cpu_cores
    if used < cores:
        return ScheduleAhead(True, f"auto: the stages' threads take {used} of {cores} cores")
    return ScheduleAhead(
        False,
        f"auto: the stages' threads take every core ({used} of {cores}): "
        "the driver's work would compete with them",
    )
