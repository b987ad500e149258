"""``sarathi-pp simulate``'s runs: the serving benchmark (``bench.suite.Bench``: one run
dir per scheduler, ``comparison.json``, the CDF plots, the capacity search) with the
engine replaced by a ``SimCluster``, so the records and the table are the benchmark's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sarathi_pp.bench.suite import Bench
from sarathi_pp.bench.workload import BenchRequest
from sarathi_pp.sim.setup import SimSetup, build_cluster


class SimBench(Bench):
    def __init__(self, config: Any, workload: Any, options: Any, setup: SimSetup, **kw: Any):
        if options.peers:
            raise ValueError("a simulation has no peer: drop --peer")
        super().__init__(config, workload, options, **kw)
        self.setup = setup

    def start(self) -> None:
        self.engine = build_cluster(self.config, self.setup)
        try:
            self.requests = self._requests(self.engine, self.workload)
        except BaseException:
            self.engine.shutdown()
            raise

    def _serve(
        self, engine: Any, requests: list[BenchRequest], run_dir: Path, desc: str
    ) -> dict[str, Any]:
        with self._progress(desc, len(requests)):
            return engine.serve_run(requests, run_dir)
