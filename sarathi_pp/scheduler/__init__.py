"""Micro-batch schedulers: pure Python, they decide WHICH tokens run next (no torch)."""

from sarathi_pp.scheduler.base import Scheduler
from sarathi_pp.scheduler.registry import create_scheduler, scheduler_names

__all__ = ["Scheduler", "create_scheduler", "scheduler_names"]
