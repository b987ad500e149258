"""Fault injection, for tests and the soak benchmark only: ``parallel.inject_fault``.

A fault is ``ACTION@KEY=VALUE,...`` (several joined by ``;``):

- ``raise@stage=S,seq=N``: stage S raises whenever a micro-batch holds sequence N (a
  poisoned request: only it must fail);
- ``raise@stage=S,step=K``: stage S raises on the K-th micro-batch it runs (from 1);
- ``stall@stage=S,step=K,seconds=T``: stage S sleeps T seconds before the K-th one;
- ``exit@stage=S,step=K``: the stage's process exits at once before the K-th micro-batch
  (a lost stage: Ray replaces it, ``parallel.max_stage_restarts``).

A ``step`` fault is one event of the stages first started: the stages that replace lost
ones run without it (``after_restart``), or an ``exit`` would take every replacement down
at its own K-th micro-batch and no recovery could ever be shown. A ``seq`` fault (a
poisoned request) stays: the request is as bad for the new stages.

Sequence ids number requests in the order they were added (``LLM.generate``: prompt order,
from 0, counting every earlier call). Pure Python: parsed when the config is built, acted on
by the stages (``stages/worker/pipeline_stage.py``, ``stages/worker/model_runner.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

ACTIONS = ("raise", "stall", "exit")
KEYS = {"stage": int, "seq": int, "step": int, "seconds": float}


class InjectedFault(RuntimeError):
    """What an injected ``raise`` raises."""


@dataclass(frozen=True)
class Fault:
    action: str
    stage: int
    seq: int | None = None
    step: int | None = None
    seconds: float = 0.0

    def applies(self, stage_idx: int, step: int, seq_ids: list[int]) -> bool:
        """Whether the fault fires on stage ``stage_idx``'s ``step``-th micro-batch."""
        if stage_idx != self.stage:
            return False
        if self.seq is not None:
            return self.seq in seq_ids
        return step == self.step


def parse_faults(text: str) -> tuple[Fault, ...]:
    """``ValueError`` naming the part that does not parse."""
    faults = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        action, sep, body = part.partition("@")
        if not sep or action not in ACTIONS:
            raise ValueError(
                f"inject_fault {part!r}: expected ACTION@KEY=VALUE,... with ACTION in {ACTIONS}"
            )
        values: dict = {}
        for item in filter(None, body.split(",")):
            key, eq, value = item.partition("=")
            if not eq or key not in KEYS:
                raise ValueError(
                    f"inject_fault {part!r}: unknown key in {item!r}; keys: {', '.join(KEYS)}"
                )
            try:
                values[key] = KEYS[key](value)
            except ValueError:
                raise ValueError(
                    f"inject_fault {part!r}: {key}={value!r} is not a number"
                ) from None
        if "stage" not in values or ("seq" in values) == ("step" in values):
            raise ValueError(f"inject_fault {part!r}: needs stage= and one of seq= or step=")
        if action != "raise" and "seq" in values:
            raise ValueError(f"inject_fault {part!r}: {action} takes step=, not seq=")
        faults.append(Fault(action, **values))
    return tuple(faults)


def after_restart(text: str | None) -> str | None:
    """``inject_fault`` for the stages that replace lost ones: its ``seq`` faults only."""
    if not text:
        return text
    kept = [p.strip() for p in text.split(";") if p.strip() and parse_faults(p)[0].seq is not None]
    return ";".join(kept) or None
