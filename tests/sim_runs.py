"""Simulated runs for the report's tests: the real engine loop, scheduler and block manager
on ``sarathi_pp.sim``'s executor and virtual clock, the stages' times stated by the test
(``ScriptedCostModel``) and the runtime's own time around them (``Overheads``). A run dir
written so holds the records a real run writes (``events.jsonl``, ``requests.csv``,
``config.yaml``, the report files).

A micro-batch's shape is the scheduler's: the first of a request carries its prompt (or
a chunk of it), so a test states requests (prompt and output lengths, arrivals) and gets
micro-batches; ``max_tokens=1`` makes a request a single prefill.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sarathi_pp.bench.workload import BenchRequest
from sarathi_pp.config import make_config
from sarathi_pp.microbatch import MicroBatch
from sarathi_pp.placement import Placement
from sarathi_pp.records.events import read_events
from sarathi_pp.sim.clock import SimClock
from sarathi_pp.sim.cluster import SimCluster
from sarathi_pp.sim.cost_model import ScriptedCostModel
from sarathi_pp.sim.executor import Overheads, SimExecutor
from sarathi_pp.sim.hardware import hardware_from_dict
from sarathi_pp.sim.setup import SimSetup

# A small Llama shape (only config.json: the simulator loads no weights).
TINY_SPEC = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "eos_token_id": 2,
}
# Only its memory matters here (the KV cache's size): the times are the test's.
TOY_GPU = {
    "name": "toy",
    "matmul_tflops": 100.0,
    "matmul_efficiency": 0.5,
    "memory_gib": 1.0,
    "memory_bandwidth_gbs": 1000.0,
    "memory_efficiency": 0.5,
    "nvlink_bandwidth_gbs": 100.0,
    "nvlink_latency_us": 10.0,
    "network_bandwidth_gbs": 10.0,
    "network_latency_us": 20.0,
}

ComputeS = Callable[[int, MicroBatch], float]


def write_model_dir(d: Path, spec: dict[str, Any] | None = None) -> Path:
    """A model folder of only ``config.json`` (``spec``, default ``TINY_SPEC``)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(spec or TINY_SPEC))
    return d


def requests(
    prompts: Sequence[int], outputs: Sequence[int] | int, arrivals: Sequence[float] | None = None
) -> list[BenchRequest]:
    """Requests ``"0"``, ``"1"``, ... of these prompt lengths and output lengths (one for
    all, or one each), arriving at ``arrivals`` (default: all at 0)."""
    n = len(prompts)
    outs = [outputs] * n if isinstance(outputs, int) else list(outputs)
    at = [0.0] * n if arrivals is None else list(arrivals)
    assert len(outs) == len(at) == n
    return [
        BenchRequest(str(i), at[i], tuple(5 + (i + k) % 100 for k in range(p)), outs[i])
        for i, p in enumerate(prompts)
    ]


def mixed_requests(
    num_requests: int, seed: int = 0, rate: float = 40.0, pause: tuple[int, float] | None = None
) -> list[BenchRequest]:
    """A mixed load: prompts of 32 to 512 tokens, 2 to 24 output tokens, Poisson arrivals
    at ``rate`` per second; ``pause=(k, s)``: request ``k`` and later ones ``s`` seconds
    later still (the engine runs out of work: ``no_work``, then fills the pipeline again)."""
    rng = random.Random(seed)
    prompts, outputs, arrivals, t = [], [], [], 0.0
    for i in range(num_requests):
        if pause is not None and i == pause[0]:
            t += pause[1]
        prompts.append(rng.randint(32, 512))
        outputs.append(rng.randint(2, 24))
        arrivals.append(t)
        t += rng.expovariate(rate)
    return requests(prompts, outputs, arrivals)


def mixed_compute_s(stage_idx: int, mb: MicroBatch) -> float:
    """A made-up cost: per-token prefill cost plus a fixed decode-step floor."""
    return 0.002 + 4e-5 * mb.num_prefill_tokens + 1e-4 * mb.num_decode_tokens + 5e-4 * stage_idx


def constant_s(seconds: float) -> ComputeS:
    def compute_s(stage_idx: int, mb: MicroBatch) -> float:
        return seconds

    return compute_s


def cluster(
    model_dir: Path,
    compute_s: ComputeS,
    num_stages: int = 2,
    send_s: float = 0.0,
    return_s: float = 0.0,
    overheads: Overheads | None = None,
    **config: Any,
) -> SimCluster:
    """One simulated pipeline of ``num_stages`` whose stages take ``compute_s`` (a send
    ``send_s``, the tokens' return ``return_s``); ``config``: engine settings
    (``make_config``'s keywords). Scheduling ahead is off unless asked for: the driver
    schedules each micro-batch after the tokens it needs are back."""
    config.setdefault("schedule_ahead", False)
    cfg = make_config(model=str(model_dir), pipeline_parallel_size=num_stages, **config)
    resources = SimSetup(hardware=hardware_from_dict(TOY_GPU, "toy")).resources(num_stages)

    def make_executor(c: Any, checkpoint: Any, clock: SimClock) -> SimExecutor:
        def cost(placement: Placement) -> ScriptedCostModel:
            return ScriptedCostModel(placement.num_stages, compute_s, send_s, return_s)

        return SimExecutor(c, checkpoint, resources, cost, clock, overheads)

    return SimCluster(cfg, make_executor)


def run(
    run_dir: Path,
    model_dir: Path,
    reqs: list[BenchRequest],
    compute_s: ComputeS,
    num_stages: int = 2,
    report: bool = False,
    **kw: Any,
) -> Path:
    """Serve ``reqs`` on ``cluster(model_dir, compute_s, num_stages, **kw)`` recording into
    ``run_dir``; ``report``: the report files written too, as at the end of a real run
    (else the records only, as a run that was shut down leaves them)."""
    c = cluster(model_dir, compute_s, num_stages, **kw)
    try:
        if report:
            c.serve_run(reqs, run_dir)
        else:
            c.engines[0].start_run(run_dir)
            c.serve(reqs)
    finally:
        c.shutdown()  # closes the records
    return run_dir


def events(run_dir: Path) -> list[dict[str, Any]]:
    return read_events(run_dir / "events.jsonl")


SINCE_2 = {"issue": ("submit", "ring"), "done": ("wait", "full")}


def older_schema(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``records`` as a schema 1 log has them (an engine before the driver's records): no
    ``issue.submit``/``ring``, no ``done.wait``/``full``. Line by line (no compact
    ``microbatch`` records: a short run has none)."""
    out = [{**records[0], "schema_version": 1}]
    for r in records[1:]:
        assert r["type"] != "microbatch", "a schema 1 log has no compact records"
        out.append({k: v for k, v in r.items() if k not in SINCE_2.get(r["type"], ())})
    return out
