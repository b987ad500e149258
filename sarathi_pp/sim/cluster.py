"""Simulated deployments: ``R`` replicas of one pipeline, each the real ``LLMEngine`` (its
scheduler and block manager) on a ``SimExecutor`` and a virtual clock of its own.

Serving follows the benchmark's online loop (``bench/runner.py``): a request joins its
replica when its arrival comes; a replica inside ``step()`` (waiting for its oldest
micro-batch) takes arrivals only when the step returns, as the live engine does, and an
idle replica waits for the next arrival. Replicas share nothing but the router:
``round_robin`` (request k to replica k mod R) or ``least_loaded`` (the replica with the
fewest unfinished requests when the request arrives, the lowest index on a tie; a
replica's count is as of its last step, which may end a little after the arrival).

With one replica, a scheduler's run dir is the engine's own. With several, each replica
writes its run dir as ``<run dir>/replica-<i>/`` (``sarathi-pp report`` reads each) and
the run dir itself gets the merged ``requests.csv`` and a ``summary.json`` whose
``requests`` pool every request, ``stages`` list every replica's stages in turn and
``overall`` sums them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sarathi_pp.bench.runner import request_params
from sarathi_pp.bench.workload import BenchRequest
from sarathi_pp.config import EngineConfig
from sarathi_pp.engine import LLMEngine
from sarathi_pp.outputs import RequestOutput
from sarathi_pp.records.run_dir import RunDir
from sarathi_pp.report.bubbles import BUBBLE_CLASSES
from sarathi_pp.report.log import load_log
from sarathi_pp.report.request_bubbles import request_bubble_times
from sarathi_pp.report.request_metrics import distribution, load_requests, request_summary
from sarathi_pp.sim.clock import SimClock

ROUTINGS = ("round_robin", "least_loaded")
REPLICA_PREFIX = "replica-"

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
        for k, r in enumerate(sorted(requests, key=lambda r: r.arrival_s)):
            t = start + r.arrival_s
            for i in range(len(self.engines)):
                self._advance(i, t)
            e = self.engines[self._route(k)]
            e.add_request(
                r.request_id, None, request_params(r),
                prompt_token_ids=list(r.prompt_token_ids), arrival_time=t,
            )  # fmt: skip
        for i in range(len(self.engines)):
            self._advance(i, math.inf)
        return [self._done[r.request_id] for r in requests]

    def _route(self, k: int) -> int:
        if self.routing == "round_robin":
            return k % len(self.engines)
        loads = [len(e.scheduler.waiting) + len(e.scheduler.running) for e in self.engines]
        return loads.index(min(loads))

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
        dirs = [run_dir / f"{REPLICA_PREFIX}{i}" for i in range(len(self.engines))]
        for e, d in zip(self.engines, dirs, strict=True):
            e.start_run(d, overwrite=True)
        outputs = self.serve(requests)
        summaries = [e.write_run_records() for e in self.engines]
        return self._merge(run_dir, dirs, outputs, summaries)

    def _merge(
        self,
        run_dir: Path,
        dirs: list[Path],
        outputs: list[RequestOutput],
        summaries: list[dict[str, Any] | None],
    ) -> dict[str, Any]:
        run = RunDir(run_dir)
        run.write_requests(outputs)
        rows = load_requests(run.requests)
        times: list[float] = []
        for d in dirs:
            got = request_bubble_times(
                load_log(RunDir(d).events), load_requests(RunDir(d).requests)
            )
            times += got or []
        parts = [s for s in summaries if s is not None]
        summary = {
            "schema_version": 1,
            "num_stages": parts[0]["num_stages"],
            "scheduler": parts[0]["scheduler"],
            "replicas": len(self.engines),
            "routing": self.routing,
            "replica_dirs": [d.name for d in dirs],
            "stages": [s for p in parts for s in p["stages"]],
            "overall": merge_overall([p["overall"] for p in parts]),
            "requests": {**request_summary(rows), "bubble_time_s": distribution(times)},
            "chunk_size": parts[0].get("chunk_size"),
        }
        run.summary.write_text(json.dumps(summary, indent=2) + "\n")
        return summary


def merge_overall(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Several pipelines' ``overall`` entries as one: times and counts summed."""
    keys = ("busy_s", "idle_s", "window_s", "fill_s", "drain_s", "fill_drain_s", "num_microbatches")
    out: dict[str, Any] = {k: sum(e[k] for e in entries) for k in keys}
    out["bubbles_s"] = {c: sum(e["bubbles_s"][c] for e in entries) for c in BUBBLE_CLASSES}
    out["bubble_fraction"] = out["idle_s"] / out["window_s"] if out["window_s"] > 0 else 0.0
    kinds = {k for e in entries for k in e["microbatches_by_kind"]}
    out["microbatches_by_kind"] = {
        k: sum(e["microbatches_by_kind"].get(k, 0) for e in entries) for k in sorted(kinds)
    }
    return out
