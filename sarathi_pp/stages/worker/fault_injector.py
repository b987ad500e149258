"""Acts on ``parallel.inject_fault`` (testing only; ``sarathi_pp/fault_injection.py`` has the format)
before a stage runs each micro-batch."""

from __future__ import annotations

import logging
import os
import time

from sarathi_pp.fault_injection import Fault, InjectedFault, parse_faults
from sarathi_pp.microbatch import MicroBatch

logger = logging.getLogger(__name__)


class FaultInjector:
    def __init__(self, spec: str | None, stage_idx: int) -> None:
        self.faults: tuple[Fault, ...] = parse_faults(spec) if spec else ()
        self.stage_idx = stage_idx
        self.step = 0  # micro-batches this stage has run

    def before(self, microbatch: MicroBatch) -> None:
        self.step += 1
        if not self.faults:
            return
        seq_ids = [c.seq_id for c in microbatch.chunks]
        for f in self.faults:
            if not f.applies(self.stage_idx, self.step, seq_ids):
                continue
            logger.warning("injected fault %s on micro-batch %s", f, microbatch.microbatch_id)
            if f.action == "stall":
                time.sleep(f.seconds)
            elif f.action == "exit":
                os._exit(70)  # a lost stage: no cleanup, as a crash
            else:
                raise InjectedFault(f"injected fault on stage {self.stage_idx}: {f}")
