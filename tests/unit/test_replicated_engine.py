"""``ReplicatedEngine`` without Ray: replicas on the simulator's executor (``sim_runs``'s
scripted stage times), so the router's use of the real engines (requests by pending tokens,
one sequence-id counter) and a dead replica's hand-off run in milliseconds. The same on Ray
with real stages: ``tests/dist/test_data_parallel.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sim_runs

from sarathi_pp.config import make_config
from sarathi_pp.engine import EngineDeadError, ReplicatedEngine, llm_engine
from sarathi_pp.engine.input_processor import RequestInput
from sarathi_pp.executors import StageError
from sarathi_pp.placement import Placement
from sarathi_pp.report import write_report
from sarathi_pp.sampling_params import SamplingParams
from sarathi_pp.sim.clock import SimClock
from sarathi_pp.sim.cost_model import ScriptedCostModel
from sarathi_pp.sim.executor import SimExecutor
from sarathi_pp.sim.hardware import hardware_from_dict
from sarathi_pp.sim.setup import SimSetup

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)


def replicated(model_dir: Path, failing: dict[int, int] | None = None, **config: Any):
    """Two simulated replicas; ``failing``: replica -> the wait after which its stage is
    lost for good (a ``StageError``: no restart)."""
    cfg = make_config(model=str(model_dir), data_parallel_size=2, schedule_ahead=False, **config)
    resources = SimSetup(hardware=hardware_from_dict(sim_runs.TOY_GPU, "toy")).resources(1)
    built: list[SimExecutor] = []

    def factory(c: Any, checkpoint: Any) -> SimExecutor:
        def cost(placement: Placement) -> ScriptedCostModel:
            return ScriptedCostModel(placement.num_stages, sim_runs.constant_s(0.001), 0.0, 0.0)

        ex = SimExecutor(c, checkpoint, resources, cost, SimClock(), None)
        idx, waits = len(built), [0]
        if failing and idx in failing:
            wait = ex.wait_oldest

            def failing_wait():
                waits[0] += 1
                if waits[0] > failing[idx]:
                    raise StageError(0, "the test's lost stage")
                return wait()

            ex.wait_oldest = failing_wait  # type: ignore[method-assign]
        built.append(ex)
        return ex

    return ReplicatedEngine(cfg, factory)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return sim_runs.write_model_dir(tmp_path / "tiny")


def run_all(engine: ReplicatedEngine) -> dict[str, Any]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_requests_go_to_the_replica_with_fewest_pending_tokens(model_dir):
    engine = replicated(model_dir)
    engine.add_request("long", None, PARAMS, prompt_token_ids=[7] * 200)
    engine.add_request("short", None, PARAMS, prompt_token_ids=[8] * 20)
    engine.add_request("third", None, PARAMS, prompt_token_ids=[9] * 20)
    assert engine._where == {"long": 0, "short": 1, "third": 1}  # 206 > 26, 206 > 52
    seq_ids = {s.request_id: s.seq_id for e in engine.engines for s in e.scheduler.waiting}
    assert seq_ids == {"long": 0, "short": 1, "third": 2}  # one counter: arrival order
    with pytest.raises(ValueError, match="'short' is already in use"):
        engine.add_request("short", None, PARAMS, prompt_token_ids=[1, 2])
    done = run_all(engine)
    assert sorted(done) == ["long", "short", "third"] and engine._where == {}
    assert all(len(o.outputs[0].token_ids) == 6 for o in done.values())
    # One call of several: each request's load counts for the next ones of the call.
    given = [("a", 200), ("b", 20), ("c", 20), ("d", 170)]
    engine.add_requests(
        [RequestInput(rid, PARAMS, {"prompt_token_ids": [7] * n}) for rid, n in given]
    )
    assert engine._where == {"a": 0, "b": 1, "c": 1, "d": 1}  # 206 | 26, 52, 228 > 206
    run_all(engine)
    engine.shutdown()


def test_a_dead_replica_hands_its_requests_over_and_the_last_one_ends_the_engine(
    model_dir, tmp_path, monkeypatch
):
    engine = replicated(model_dir, failing={1: 2})
    for i in range(6):
        engine.add_request(str(i), None, PARAMS, prompt_token_ids=[5 + i] * (10 + 5 * i))
    assert set(engine._where.values()) == {0, 1}
    done = run_all(engine)
    assert sorted(done, key=int) == [str(i) for i in range(6)]
    assert all(o.outputs[0].finish_reason == "length" for o in done.values())
    assert all(len(o.outputs[0].token_ids) == 6 for o in done.values())
    assert engine.replicas_lost == [1] and engine.num_requests_moved > 0
    assert engine.num_live == 1 and engine.is_alive()
    # A run dir started after the loss has the live replica's records only. (No timeline
    # plot: the simulated stages' times are on their own clocks, not the engines'.)
    monkeypatch.setattr(llm_engine, "write_report", lambda d: write_report(d, plot=False))
    engine.start_run(tmp_path / "after")
    engine.add_request("late", None, PARAMS, prompt_token_ids=[4] * 12)
    assert engine._where == {"late": 0}
    run_all(engine)
    total = engine.write_run_records()
    assert total is not None and total["replica_dirs"] == ["replica-0"]
    assert [s["replica"] for s in total["stages"]] == [0] and total["replicas_lost"] == [1]
    assert total["requests"]["num_requests"] == 1
    engine.shutdown()

    lone = replicated(model_dir, failing={0: 0, 1: 0})
    lone.add_request("a", None, PARAMS, prompt_token_ids=[5] * 10)
    lone.add_request("b", None, PARAMS, prompt_token_ids=[6] * 10)
    with pytest.raises(EngineDeadError, match="every replica is lost"):
        run_all(lone)
    assert not lone.is_alive()
    lone.shutdown()
