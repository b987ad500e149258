"""Simulated deployments: ``R`` replicas of one pipeline, each the real ``LLMEngine`` (its
scheduler and block manager) on a ``SimExecutor`` and a virtual clock of its own.

Serving follows the benchmark's online loop (``bench/runner.py``): a request joins its
replica when its arrival comes; a replica inside ``step()`` (waiting for its oldest
micro-batch) takes arrivals only when the step returns, as the live engine does, and an
idle replica waits for the next arrival. Replicas share nothing but the router, the
runtime's own (``sarathi_pp/routing.py``): ``round_robin`` or ``least_loaded`` (the fewest
pending tokens when the request arrives, with prefix affinity when
``cache.enable_prefix_caching`` is on; a replica's load is as of its last step, which may
end a little after the arrival).

With one replica, a scheduler's run dir is the engine's own. With several, the layout of
``report/replicas.py``: each replica's run dir ``<run dir>/replica-<i>/``, the total in the
run dir itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sarathi_pp.bench.runner import request_params
from sarathi_pp.bench.workload import BenchRequest
from sarathi_pp.config import EngineConfig
from sarathi_pp.engine import LLMEngine
from sarathi_pp.outputs import RequestOutput
from sarathi_pp.report.replicas import replica_dir, write_total
from sarathi_pp.routing import ROUTINGS, Router, pending_tokens
from sarathi_pp.sim.clock import SimClock

# (config, checkpoint, clock) -> an executor on that clock
ExecutorMaker = Callable[[EngineConfig, Any, SimClock], Any]


class SimCluster:
    def __init__(
        self,
        config: EngineConfig,
        make_executor: ExecutorMaker,
        replicas: int = 1,
        routing: str = "round_robin",
    ) -> None:
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}")
        if routing not in ROUTINGS:
            raise ValueError(f"unknown routing {routing!r}; valid: {', '.join(ROUTINGS)}")
        self.routing = routing
        self.clocks = [SimClock() for _ in range(replicas)]
        self.engines: list[LLMEngine] = []
        try:
            for clock in self.clocks:
                maker = lambda cfg, ckpt, c=clock: make_executor(cfg, ckpt, c)  # noqa: E731
                self.engines.append(LLMEngine(config, executor=maker, clock=clock))
        except BaseException:
            self.shutdown()
            raise
        self._done: dict[str, RequestOutput] = {}
        affinity = config.cache.enable_prefix_caching
        block_size = self.engines[0].block_size if affinity else None
        self.router = Router(replicas, routing, block_size)

    # --- what the benchmark asks of an engine ---------------------------------------------
    spec = property(lambda self: self.engines[0].spec)
    max_model_len = property(lambda self: self.engines[0].max_model_len)
    model_dir = property(lambda self: self.engines[0].model_dir)
    placement = property(lambda self: self.engines[0].placement)
    num_kv_blocks = property(lambda self: self.engines[0].num_kv_blocks)

    @property
    def executor(self) -> Any:
        return self.engines[0].executor

    def set_scheduler(self, **overrides: Any) -> None:
        for e in self.engines:
            e.set_scheduler(**overrides)

    def validate_prompt(self, token_ids: list[int], where: str = "prompt") -> None:
        self.engines[0].validate_prompt(token_ids, where)

    def shutdown(self) -> None:
        for e in self.engines:
            e.shutdown()

    # --- serving --------------------------------------------------------------------------
    def serve(self, requests: list[BenchRequest]) -> list[RequestOutput]:
        """Run ``requests`` to completion; outputs in the order of ``requests``."""
        start = max(c.now() for c in self.clocks)
        for c in self.clocks:
            c.advance_to(start)
        self._done = {}
        for r in sorted(requests, key=lambda r: r.arrival_s):
            t = start + r.arrival_s
            for i in range(len(self.engines)):
                self._advance(i, t)
            e = self.engines[self._route(r.prompt_token_ids)]
            e.add_request(
                r.request_id, None, request_params(r),
                prompt_token_ids=list(r.prompt_token_ids), arrival_time=t,
            )  # fmt: skip
        for i in range(len(self.engines)):
            self._advance(i, math.inf)
        return [self._done[r.request_id] for r in requests]

    def _route(self, token_ids: list[int]) -> int:
        if len(self.engines) == 1:
            return 0
        loads = [0] * len(self.engines)  # round_robin reads none
        if self.router.routing == "least_loaded":
            loads = [
                pending_tokens([*e.scheduler.waiting, *e.scheduler.running], e.max_model_len)
                for e in self.engines
            ]
        return self.router.route(token_ids, loads)

    def _advance(self, i: int, t: float) -> None:
        """Step replica ``i`` while its clock is before ``t`` and it has work; then idle
        until ``t``."""
        engine, clock = self.engines[i], self.clocks[i]
        while clock.now() < t and engine.has_unfinished_requests():
            before = clock.now()
            for out in engine.step():
                if out.finished:
                    self._done[out.request_id] = out
            if engine.num_inflight == 0 and clock.now() == before:
                if math.isinf(t):  # nothing can run and nothing will arrive
                    raise RuntimeError(f"replica {i}: unfinished requests but nothing to run")
                break
        if not math.isinf(t):
            clock.advance_to(t)

    def serve_run(self, requests: list[BenchRequest], run_dir: Path) -> dict[str, Any]:
        """``serve`` with the run's records in ``run_dir``; the run's summary."""
        if len(self.engines) == 1:
            self.engines[0].start_run(run_dir, overwrite=True)
            self.serve(requests)
            summary = self.engines[0].write_run_records()
            assert summary is not None
            return summary
        dirs = [replica_dir(run_dir, i) for i in range(len(self.engines))]
        for e, d in zip(self.engines, dirs, strict=True):
            e.start_run(d, overwrite=True)
        outputs = self.serve(requests)
        summaries = [e.write_run_records() for e in self.engines]
        return write_total(run_dir, dirs, outputs, summaries, routing=self.routing)
