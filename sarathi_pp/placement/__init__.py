"""Where each stage runs and what it holds: the layer partition and the placement rule
(device, dtype, threads, memory budget, block size), and whether the driver schedules ahead
on it. Pure Python, no torch."""

from sarathi_pp.placement.ahead import ScheduleAhead, resolve_schedule_ahead
from sarathi_pp.placement.partition import format_partition, partition_layers
from sarathi_pp.placement.resolve import Placement, Resources, resolve_placement

__all__ = [
    "Placement",
    "Resources",
    "ScheduleAhead",
    "format_partition",
    "partition_layers",
    "resolve_placement",
    "resolve_schedule_ahead",
]
