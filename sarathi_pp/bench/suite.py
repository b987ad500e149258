"""The serving benchmark: one workload through several schedulers (and a peer), one run
dir each, then ``comparison.json``, the CDF plots and the table.

``--run-dir DIR`` is a ``run_dir.BenchDir`` (its docstring has the layout): a run dir per
scheduler (``sarathi-pp report`` reads it), the peer's requests and summary,
``comparison.json`` (see ``bench.compare``) and the CDF plots.

All schedulers run on the same live stages (``LLMEngine.set_scheduler``), so comparing
policies costs one model load. The peer runs after our stages are shut down, with the
same number of threads our stages used together and the dtype they resolved.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sarathi_pp.bench.capacity import Slo, search_capacity
from sarathi_pp.bench.compare import (
    build_comparison,
    engine_run_entry,
    format_table,
    peer_run_entry,
    token_agreement,
)
from sarathi_pp.bench.peers import PEERS, peer_runner
from sarathi_pp.bench.runner import serve_run
from sarathi_pp.bench.workload import BenchRequest, Workload
from sarathi_pp.config import EngineConfig
from sarathi_pp.placement import Placement
from sarathi_pp.records.run_dir import BenchDir, RunDir
from sarathi_pp.report.request_metrics import load_requests, request_summary

PEER_SUMMARY_VERSION = 1


@dataclass(frozen=True)
class BenchOptions:
    schedulers: tuple[str, ...]
    run_dir: Path
    peers: tuple[str, ...] = ()  # run after the schedulers, in order
    overwrite: bool = False
    capacity: bool = False
    slo: Slo | None = None
    start_rate: float | None = None
    max_probes: int = 8
    rel_tol: float = 0.1
    time_limit_s: float | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        from sarathi_pp.scheduler.registry import scheduler_names

        if not self.schedulers:
            raise ValueError("no schedulers given")
        for s in self.schedulers:
            if s not in scheduler_names():
                raise ValueError(f"unknown scheduler {s!r}; valid: {', '.join(scheduler_names())}")
        if len(set(self.schedulers)) != len(self.schedulers):
            raise ValueError(f"a scheduler is listed twice: {', '.join(self.schedulers)}")
        for peer in self.peers:
            if peer not in PEERS:
                raise ValueError(f"unknown peer {peer!r}; valid: {', '.join(PEERS)}")
        if len(set(self.peers)) != len(self.peers):
            raise ValueError(f"a peer is listed twice: {', '.join(self.peers)}")
        if self.capacity and self.slo is None:
            raise ValueError("the capacity search needs an SLO: give --slo-tbt-p99 SECONDS")
        if (
            isinstance(self.max_probes, bool)
            or not isinstance(self.max_probes, int)
            or self.max_probes < 1
        ):
            raise ValueError(f"--max-probes must be an integer >= 1, got {self.max_probes!r}")
        for flag, v in (("--start-rate", self.start_rate), ("--time-limit", self.time_limit_s)):
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{flag} must be a number > 0, got {v!r}")
        if self.capacity and self.peers:
            raise ValueError(
                "the capacity search runs our schedulers only: drop --peer, or run the peer "
                "without --capacity at a fixed rate (--rate)"
            )


def peer_threads(placement: Placement) -> int | None:
    """The threads our stages used together: the peer gets as many (like for like);
    ``None`` where the stages kept torch's default (one stage), so does the peer."""
    if placement.num_threads is None:
        return None
    return placement.num_stages * placement.num_threads


class PeerFailed(RuntimeError):
    """A peer could not run or finish; the records (ours, the peer's finished requests, the
    comparison) are written before this is raised."""


class Bench:
    """Runs the benchmark; ``run()`` returns the comparison (also written to disk) or,
    when a peer failed, raises ``PeerFailed`` after writing it."""

    def __init__(
        self,
        config: EngineConfig,
        workload: Workload,
        options: BenchOptions,
        bar: Callable[[str, int], Any] | None = None,
    ) -> None:
        self.config = config.replace(run_dir=None, scheduler=options.schedulers[0])
        self.workload = workload
        self.options = options
        self.bar = bar  # (description, total) -> a tqdm-like object (update, close)
        # Checked now, created (and with --overwrite cleared) once the requests are checked.
        self.bench_dir = BenchDir.check(options.run_dir, options.overwrite)
        self.dir = self.bench_dir.path
        self.engine: Any = None
        self.requests: list[BenchRequest] = []
        self.tokens: dict[str, list[int]] = {}  # the first scheduler's tokens, by request id
        self.peer_errors: list[str] = []

    def start(self) -> None:
        """Check the peers can run, load the stages and build and check every request: a
        missing peer venv or a bad workload raises here, before any request runs."""
        from sarathi_pp.bench.peers import check_peer
        from sarathi_pp.engine import create_engine

        for peer in self.options.peers:
            check_peer(peer)

        self.engine = create_engine(self.config)
        try:
            self.requests = self._requests(self.engine, self.workload)
        except BaseException:
            self.engine.shutdown()
            raise

    def run(self) -> dict[str, Any]:
        """Every scheduler, then the peer; writes and returns the comparison."""
        if self.engine is None:
            self.start()
        engine, requests = self.engine, self.requests
        try:
            self.bench_dir.create(self.options.overwrite)
            runs = [self._run_scheduler(engine, s, requests) for s in self.options.schedulers]
            model_dir, placement = engine.model_dir, engine.placement
        finally:
            engine.shutdown()
        for peer in self.options.peers:
            runs.append(self._run_peer(peer, model_dir, placement, requests))
        comparison = build_comparison(runs, self._workload_entry(), self.config.to_dict())
        self.bench_dir.comparison.write_text(json.dumps(comparison, indent=2) + "\n")
        self._plots(runs)
        if self.peer_errors:
            raise PeerFailed("; ".join(self.peer_errors))
        return comparison

    def table(self, comparison: dict[str, Any]) -> str:
        return format_table(comparison)

    # --- our schedulers ------------------------------------------------------------------
    def _requests(self, engine: Any, workload: Workload) -> list[BenchRequest]:
        """The workload's requests, every prompt checked against every scheduler before
        any work starts (a prompt vllm/orca cannot run unchunked is named here)."""
        requests = workload.requests(engine.spec.vocab_size, engine.max_model_len)
        for s in self.options.schedulers:
            engine.set_scheduler(policy=s)
            for r in requests:
                engine.validate_prompt(list(r.prompt_token_ids), f"{s}: request {r.request_id}")
        return requests

    def _run_scheduler(
        self, engine: Any, policy: str, requests: list[BenchRequest]
    ) -> dict[str, Any]:
        engine.set_scheduler(policy=policy)
        run_dir = self.bench_dir.run(policy)
        if self.options.capacity:
            return self._capacity(engine, policy, run_dir)
        if not self.options.peers or self.tokens:
            summary = self._serve(engine, requests, run_dir.path, policy)
            return engine_run_entry(policy, policy, summary)
        outputs: list[Any] = []  # the first scheduler's tokens: the peers' token agreement
        summary = self._serve(engine, requests, run_dir.path, policy, outputs)
        self.tokens = {o.request_id: list(o.outputs[0].token_ids) for o in outputs}
        return engine_run_entry(policy, policy, summary)

    def _serve(
        self,
        engine: Any,
        requests: list[BenchRequest],
        run_dir: Path,
        desc: str,
        outputs: list[Any] | None = None,
    ) -> dict[str, Any]:
        with self._progress(desc, len(requests)) as progress:
            return serve_run(engine, requests, run_dir, progress, outputs)

    @contextmanager
    def _progress(self, desc: str, total: int) -> Iterator[Callable[[int], None] | None]:
        """A ``progress(num_finished)`` callback drawing a bar (``None`` without one)."""
        if self.bar is None or not self.options.progress:
            yield None
            return
        bar = self.bar(desc, total)
        try:
            yield lambda n: bar.update(n - bar.n)
        finally:
            bar.close()

    def _capacity(self, engine: Any, policy: str, run_dir: RunDir) -> dict[str, Any]:
        run_dir.path.mkdir(parents=True, exist_ok=True)
        probe_dirs: dict[float, Path] = {}
        summaries: dict[float, dict[str, Any]] = {}

        def probe(rate: float) -> dict[str, Any]:
            d = run_dir.probe(rate)
            probe_dirs[rate] = d
            requests = self._requests_at(engine, rate)
            summaries[rate] = self._serve(engine, requests, d, f"{policy} @ {rate:.3g} req/s")
            return summaries[rate]["requests"]

        o = self.options
        result = search_capacity(
            probe,
            o.slo,  # type: ignore[arg-type]  # checked in BenchOptions
            o.start_rate or self.workload.rate or 1.0,
            max_probes=o.max_probes,
            rel_tol=o.rel_tol,
            time_limit_s=o.time_limit_s,
        )
        run_dir.capacity.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
        # The table shows the run at the capacity (or the lowest rate when not met).
        shown = result.capacity if result.capacity is not None else min(probe_dirs)
        d = probe_dirs[shown]
        entry = engine_run_entry(policy, str(d.relative_to(self.dir)), summaries[shown])
        entry["capacity"] = result.to_dict()
        entry["note"] = f"{result.describe()}; figures at {shown:.3g} req/s"
        return entry

    def _requests_at(self, engine: Any, rate: float) -> list[BenchRequest]:
        return self.workload.with_rate(rate).requests(engine.spec.vocab_size, engine.max_model_len)

    # --- the peer ------------------------------------------------------------------------
    def _run_peer(
        self, peer: str, model_dir: Any, placement: Placement, requests: list[BenchRequest]
    ) -> dict[str, Any]:
        run_peer = peer_runner(peer)
        name = BenchDir.peer_name(peer)
        run_dir = self.bench_dir.run(name)
        run_dir.path.mkdir(exist_ok=True)
        extra = {
            "num_stages": placement.num_stages,
            "log_dir": run_dir.path,
            "enable_prefix_caching": self.config.cache.enable_prefix_caching,  # like for like
        }
        accepted = inspect.signature(run_peer).parameters
        with self._progress(name, len(requests)) as progress:
            result = run_peer(
                model_dir,
                requests,
                dtype=placement.dtype,
                num_threads=peer_threads(placement),
                progress=progress,
                **{k: v for k, v in extra.items() if k in accepted},
            )
        run_dir.write_requests(result.outputs)
        agreement = token_agreement(
            self.tokens, {o.request_id: list(o.outputs[0].token_ids) for o in result.outputs}
        )
        summary = {
            "schema_version": PEER_SUMMARY_VERSION,
            "peer": peer,
            "mode": result.mode,
            "latency_comparable": result.latency_comparable,
            "note": result.note,
            "error": result.error,
            "token_agreement": agreement,
            "requests": request_summary(load_requests(run_dir.requests)),
        }
        run_dir.summary.write_text(json.dumps(summary, indent=2) + "\n")
        if result.error is not None:
            self.peer_errors.append(f"{name}: {result.error}")
        entry = peer_run_entry(
            name, name, summary["requests"], result.latency_comparable, result.note
        )
        entry["token_agreement"] = agreement
        return entry

    # --- outputs -------------------------------------------------------------------------
    def _workload_entry(self) -> dict[str, Any]:
        w = self.workload
        return {
            "name": w.name,
            "description": w.describe(),
            "pd_ratio": w.pd_ratio(),
            "rate": w.rate,
            "num_requests": w.num_requests,
        }

    def _plots(self, runs: list[dict[str, Any]]) -> None:
        from sarathi_pp.bench.plots import draw_cdfs

        rows = {r["name"]: load_requests(self.bench_dir.run(r["run_dir"]).requests) for r in runs}
        draw_cdfs(rows, self.dir, title=self.workload.describe())
