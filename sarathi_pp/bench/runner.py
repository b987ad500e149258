"""Serve a workload through a live ``LLMEngine`` with its arrival times.

The online loop: a request is added to the engine when its arrival time comes (not
before: the engine would not schedule it early anyway, but its prompt must not count as
known work), with ``arrival_time`` set to the nominal arrival so that a request arriving
while the engine is busy in ``step()`` has that wait in its TTFT and scheduling delay, as
a client would see it. Between arrivals the loop sleeps instead of spinning.

Each scheduler gets its own run dir on the same live stages: ``LLMEngine.set_scheduler``
switches the policy without restarting the stages and ``LLMEngine.start_run`` points the
event log at a fresh run dir.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sarathi_pp.bench.workload import BenchRequest
from sarathi_pp.engine import LLMEngine
from sarathi_pp.outputs import RequestOutput
from sarathi_pp.sampling_params import SamplingParams

# Longest sleep while waiting for the next arrival: the loop stays responsive to Ctrl-C.
_MAX_SLEEP_S = 0.05


def request_params(r: BenchRequest) -> SamplingParams:
    """Greedy, exactly ``r.output_tokens`` tokens: the workload fixes the output length."""
    return SamplingParams(max_tokens=r.output_tokens, temperature=0.0, ignore_eos=True)


def serve(
    engine: LLMEngine,
    requests: list[BenchRequest],
    progress: Callable[[int], None] | None = None,
) -> list[RequestOutput]:
    """Run ``requests`` to completion, each added at ``start + arrival_s``; the outputs
    in the order of ``requests``. ``progress(n)`` is called with the number finished."""
    if engine.has_unfinished_requests():
        raise RuntimeError("serve needs an idle engine (requests are unfinished)")
    order = sorted(requests, key=lambda r: r.arrival_s)
    start = engine.now()
    done: dict[str, RequestOutput] = {}
    next_idx = 0
    while len(done) < len(order):
        now = engine.now()
        while next_idx < len(order) and start + order[next_idx].arrival_s <= now:
            r = order[next_idx]
            engine.add_request(
                r.request_id,
                None,
                request_params(r),
                prompt_token_ids=list(r.prompt_token_ids),
                arrival_time=start + r.arrival_s,
            )
            next_idx += 1
        for out in engine.step():
            if out.finished and out.request_id not in done:
                done[out.request_id] = out
                if progress is not None:
                    progress(len(done))
        if engine.num_inflight == 0 and next_idx < len(order):
            # Nothing running: wait for the next arrival (in short naps).
            wait = start + order[next_idx].arrival_s - engine.now()
            if wait > 0 and not engine.has_unfinished_requests():
                time.sleep(min(wait, _MAX_SLEEP_S))
    return [done[r.request_id] for r in requests]


def serve_run(
    engine: LLMEngine,
    requests: list[BenchRequest],
    run_dir: Path,
    progress: Callable[[int], None] | None = None,
    outputs: list[RequestOutput] | None = None,
) -> dict[str, Any]:
    """``serve`` with the run's records (config, events, requests.csv, report) in
    ``run_dir`` (an empty or new folder); the run's summary (``summary.json``). ``outputs``,
    when given, is extended with the requests' outputs."""
    engine.start_run(run_dir, overwrite=True)
    served = serve(engine, requests, progress)
    if outputs is not None:
        outputs.extend(served)
    summary = engine.write_run_records()
    assert summary is not None  # start_run opened the records
    return summary
