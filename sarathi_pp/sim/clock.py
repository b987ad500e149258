"""The simulation's virtual time: the engine reads it (``LLMEngine(clock=...)``), the
simulated executor moves it forward. Never backwards."""

from __future__ import annotations


class SimClock:
    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def __call__(self) -> float:
        return self._now

    def now(self) -> float:
        return self._now

    def advance_to(self, t: float) -> None:
        """Move to ``t`` if it is later than now."""
        if t > self._now:
            self._now = t

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"time cannot go backwards: advance({seconds})")
        self._now += seconds

    def __repr__(self) -> str:
        return f"SimClock({self._now:.6f})"
