"""The runtime classes' measured parts (report/runtime_split.py) on hand-made logs: exact
values; and on those and simulated runs (``tests/sim_runs.py``), read as written and as an
older log without the driver's records, the parts add up to the unsplit ``dependency``
and ``schedule``."""

from __future__ import annotations

import json

import pytest
import sim_runs
from test_bubbles import check_exact, header, only, st

from sarathi_pp.records.events import SCHEMA_VERSION, EventLog, read_events
from sarathi_pp.report.bubbles import (
    BUBBLE_CLASSES,
    RUNTIME_CLASSES,
    SHAPE_CLASSES,
    analyze,
)
from sarathi_pp.report.log import parse_log
from sarathi_pp.report.runtime_split import LEGACY_CLASS
from sarathi_pp.report.summary import families
from sarathi_pp.sim.executor import Overheads


def issue(mb: int, t: float, submit: float | None = None) -> dict:
    r = {"type": "issue", "mb": mb, "t": t, "kind": "decode"}
    r.update(num_prefill_tokens=0, num_decode_tokens=2)
    if submit is not None:
        r["submit"] = submit
    return r


def done(mb: int, t: float, wait: float | None = None, full: bool = True) -> dict:
    r = {"type": "done", "mb": mb, "t": t}
    if wait is not None:
        r.update(wait=wait, full=full)
    return r


def idle(start: float, end: float, reason: str = "dependency") -> dict:
    return {"type": "idle", "start": start, "end": end, "reason": reason}


def saturated_log(driver_records: bool = True) -> list[dict]:
    """PP=2, two micro-batches in flight, four decodes. The driver: issues 0 and 1, waits
    for 0 (limit) from 0.25, has its tokens at 2.5 (the last stage sent them at 2.3), issues
    2 at 2.7 (submitted 2.8, at stage 0 at 2.9), waits for 1 from 2.85, ...; after 3 it has
    nothing left to issue: the wait for 3 (from 5.1) is the load's own."""
    d = driver_records
    return [
        header(2),
        issue(0, 0.0, 0.1 if d else None),
        issue(1, 0.1, 0.2 if d else None),
        idle(0.2, 2.7),
        issue(2, 2.7, 2.8 if d else None),
        idle(2.8, 3.6),
        issue(3, 3.6, 3.7 if d else None),
        idle(3.7, 6.0),
        st(0, 0, "decode", 0.2, 1.2, ready=0.2),
        st(0, 1, "decode", 1.2, 2.2, ready=0.3),
        st(0, 2, "decode", 2.9, 3.9, ready=2.9),
        st(0, 3, "decode", 3.9, 4.9, ready=3.8),
        st(1, 0, "decode", 1.3, 2.3),
        st(1, 1, "decode", 2.3, 3.3),
        st(1, 2, "decode", 3.95, 4.95),
        st(1, 3, "decode", 4.95, 5.95),
        done(0, 2.5, 0.25 if d else None),
        done(1, 3.4, 2.85 if d else None),
        done(2, 5.0, 3.75 if d else None),
        done(3, 6.0, 5.1 if d else None, full=False),
    ]


def run(records: list[dict], split: bool = True):
    a = analyze(parse_log(records, "test/events.jsonl"), split)
    check_exact(a)
    return a


def test_saturated_pipeline_parts_exact():
    a = run(saturated_log())
    # stage 0 in the window [1.3, 4.9] waits for mb 2 over [2.2, 2.9]: the pipeline held mb 1
    # until 2.3, the tokens came back by 2.5, the driver issued at 2.7, submitted at 2.8
    # (the driver waits for mb 1 from 2.85 while mb 2 travels to stage 0: dispatch)
    only(
        a.stages[0].bubbles_s,
        in_flight=0.1, token_return=0.2, driver=0.2, schedule=0.1, dispatch=0.1,
    )  # fmt: skip
    tail = [(round(g.start, 6), g.label) for g in a.segments[0] if g.start >= 4.9]
    assert tail == [(4.9, "in_flight"), (4.95, "token_return"), (5.0, "driver"), (5.1, "load")]
    legacy = run(saturated_log(), split=False)
    only(legacy.stages[0].bubbles_s, dependency=0.6, schedule=0.1)  # [2.8, 2.9] dependency
    # stage 1 waits for mb 2 over [3.3, 3.9]: the last 0.6 s of stage 0's wait, passed down
    only(
        a.stages[1].bubbles_s,
        comm=0.05, token_return=0.2, driver=0.2, schedule=0.1, dispatch=0.1,
    )  # fmt: skip


def test_older_log_keeps_dependency_but_token_return_is_derived():
    a = run(saturated_log(driver_records=False))
    only(a.stages[0].bubbles_s, token_return=0.2, dependency=0.4, schedule=0.1)


def _check_parts_add_up(records: list[dict]) -> None:
    """Every stage: the parts with what is left of ``dependency`` and ``schedule`` add up
    to the unsplit two; the parts other than ``dispatch`` lie within ``dependency``; every
    other class is unchanged."""
    split, legacy = run(records), run(records, split=False)
    for b, old in zip(split.stages, legacy.stages, strict=True):
        new, was = b.bubbles_s, old.bubbles_s
        for c in BUBBLE_CLASSES:
            if c not in LEGACY_CLASS and c not in ("dependency", "schedule"):
                assert new[c] == pytest.approx(was[c], abs=1e-9), (b.stage_idx, c)
        parts = sum(new[c] for c in LEGACY_CLASS)
        both = was["dependency"] + was["schedule"]
        assert parts + new["dependency"] + new["schedule"] == pytest.approx(both, abs=1e-9)
        dep_parts = sum(new[c] for c, k in LEGACY_CLASS.items() if k == "dependency")
        assert dep_parts + new["dependency"] <= was["dependency"] + 1e-9
        assert new["schedule"] <= was["schedule"] + 1e-9
        assert b.fill_s == pytest.approx(old.fill_s) and b.drain_s == pytest.approx(old.drain_s)


@pytest.fixture(scope="module")
def mixed_run(sim_model_dir, tmp_path_factory):
    """The events of a simulated PP=3 run of a mixed load (by seed): the driver's own time
    and dispatch, sends, the tokens' return, arrival gaps."""
    runs: dict[int, list[dict]] = {}

    def get(seed: int) -> list[dict]:
        if seed not in runs:
            d = sim_runs.run(
                tmp_path_factory.mktemp("mixed") / "run", sim_model_dir,
                sim_runs.mixed_requests(24, seed), sim_runs.mixed_compute_s, num_stages=3,
                send_s=5e-4, return_s=1e-3, chunk_size=256,
                overheads=Overheads(driver_s=4e-4, dispatch_s=2e-4, handoff_s=2e-4),
            )  # fmt: skip
            runs[seed] = sim_runs.events(d)
        return runs[seed]

    return get


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("driver_records", [True, False])
def test_parts_add_up_to_dependency_and_schedule(mixed_run, seed, driver_records):
    records = mixed_run(seed)
    if not driver_records:
        records = sim_runs.older_schema(records)
    _check_parts_add_up(records)
    a = run(records)
    if driver_records:
        assert all(b.bubbles_s["dependency"] == 0 for b in a.stages)
        assert a.stages[0].bubbles_s["dispatch"] > 0
    else:  # nothing measured the driver's waits: dependency stays whole, but for the return
        assert a.stages[0].bubbles_s["dependency"] > 0
        assert a.stages[0].bubbles_s["dispatch"] == 0


def test_parts_add_up_on_the_hand_made_log():
    _check_parts_add_up(saturated_log())
    _check_parts_add_up(saturated_log(driver_records=False))


def test_families_partition_the_classes():
    assert set(SHAPE_CLASSES) | set(RUNTIME_CLASSES) | {"no_work"} == set(BUBBLE_CLASSES)
    assert not set(SHAPE_CLASSES) & set(RUNTIME_CLASSES)
    b = analyze(parse_log(saturated_log(), "x")).stages[1].bubbles_s
    f = families(b)
    assert f["shape"] + f["runtime"] + f["no_work"] == pytest.approx(sum(b.values()))


def test_event_log_writes_the_driver_fields_and_reads_both_versions(tmp_path):
    log = EventLog(2, 100.0, {})
    log.issue(0, 100.5, "decode", 0, 2, submit=100.75)
    log.issue(1, 101.0, "decode", 0, 2)
    log.done(0, 102.0, wait=101.5, full=False)
    log.done(1, 103.0)
    path = tmp_path / "events.jsonl"
    log.write(path)
    records = read_events(path)
    assert records[0]["schema_version"] == SCHEMA_VERSION
    assert records[1]["submit"] == 0.75 and "submit" not in records[2]
    assert records[3]["wait"] == 1.5 and records[3]["full"] is False and "wait" not in records[4]
    lines = path.read_text().splitlines()
    old = json.loads(lines[0]) | {"schema_version": 1}
    path.write_text("\n".join([json.dumps(old), *lines[1:]]))
    assert read_events(path)[0]["schema_version"] == 1
    path.write_text("\n".join([json.dumps(old | {"schema_version": 5}), *lines[1:]]))
    with pytest.raises(ValueError, match="schema version 5, this reader knows 1, 2, 3, 4"):
        read_events(path)


def test_bad_done_wait_is_a_clear_error():
    records = saturated_log()
    records[-1] = done(3, 6.0, 6.5)
    with pytest.raises(ValueError, match="wait"):
        parse_log(records, "test/events.jsonl")


def test_trace_shows_the_driver_waits_and_dispatch():
    from sarathi_pp.report.trace import scheduler_events

    log = parse_log(saturated_log(), "x")
    spans = {e["name"]: e for e in scheduler_events(log, 3) if e["ph"] == "X"}
    wait, dispatch = spans["wait mb 3"], spans["dispatch mb 2"]
    assert wait["tid"] == 1 and wait["args"] == {"mb": 3, "full": False}
    assert wait["ts"] == pytest.approx(5.1e6) and wait["dur"] == pytest.approx(0.9e6)
    assert dispatch["tid"] == 2 and dispatch["dur"] == pytest.approx(0.1e6)
    old = parse_log(saturated_log(driver_records=False), "x")
    assert not any(e["name"].startswith(("wait", "dispatch")) for e in scheduler_events(old, 3))
