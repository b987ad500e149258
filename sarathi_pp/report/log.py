"""``events.jsonl`` parsed into typed, checked values for the bubble analysis.

``read_events`` (``sarathi_pp.records.events``) checks the lines are records; this module checks
what the analysis relies on, and names the file in every error: each stage record has its
fields, a known kind and ordered times (``compute_start <= compute_end <= send_end``); a
stage's computes do not overlap; every stage ran the same micro-batches; idle reasons are
known.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from sarathi_pp.microbatch import StageEvent
from sarathi_pp.records.events import read_events

KINDS = ("prefill", "decode", "hybrid")
IDLE_REASONS = ("no_work", "dependency", "recovery")
_STAGE_FIELDS = (
    "stage",
    "mb",
    "kind",
    "num_prefill_tokens",
    "num_decode_tokens",
    "wait_start",
    "input_ready",
    "compute_start",
    "compute_end",
    "send_end",
)
_TIME_FIELDS = ("wait_start", "input_ready", "compute_start", "compute_end", "send_end")
_NUMBER_TYPES = {int, float}  # JSON's numbers (a bool's type is bool)


@dataclass(frozen=True, slots=True)
class Idle:
    """The scheduler had nothing to issue in ``[start, end)`` because of ``reason``."""

    start: float
    end: float
    reason: str


@dataclass(frozen=True, slots=True)
class Issue:
    mb: int
    t: float  # scheduling began
    kind: str
    num_prefill_tokens: int
    num_decode_tokens: int
    submit: float | None = None  # handed to the executor (None: an older log)
    ring: int | None = None  # scheduled ahead: the newest micro-batch it takes tokens of


@dataclass(frozen=True, slots=True)
class Wait:
    """The driver waited for micro-batch ``mb``'s tokens over ``[start, end]`` (``end``: the
    ``done`` record); ``full``: the in-flight limit held the next micro-batch back (else the
    scheduler had nothing to issue)."""

    mb: int
    start: float
    end: float
    full: bool


@dataclass(frozen=True)
class RunLog:
    """One run's events; times in seconds relative to the header's ``t0``."""

    source: str  # the file, for error messages
    num_stages: int
    config: dict[str, Any]
    stages: tuple[tuple[StageEvent, ...], ...]  # [stage_idx] -> in compute order
    idles: tuple[Idle, ...]  # by start
    issues: tuple[Issue, ...]  # by t
    dones: tuple[tuple[int, float], ...]  # (mb, t) by t
    chunk_sizes: tuple[tuple[float, int], ...]  # (t, chunk_size) by t
    requests_t0: float | None = None  # requests.csv's origin on this clock (None: unknown)
    waits: tuple[Wait, ...] = ()  # by start; empty for an older log (no ``wait`` in ``done``)
    # stage -> (backend, fallbacks): the last ``attention`` record of each stage; empty for an
    # older log
    attention: dict[int, tuple[str, tuple[str, ...]]] = field(default_factory=dict)

    def by_mb(self, stage_idx: int) -> dict[int, StageEvent]:
        return {e.mb: e for e in self.stages[stage_idx]}

    @property
    def num_microbatches(self) -> int:
        return len(self.stages[0])


def load_log(path: str | Path) -> RunLog:
    """Read and check ``events.jsonl``; ``FileNotFoundError``/``ValueError`` naming it."""
    return parse_log(read_events(path), str(path), copy=False)


def parse_log(records: list[dict[str, Any]], source: str, copy: bool = True) -> RunLog:
    """Check and type ``records`` (as ``read_events`` returns them) from ``source``;
    ``copy=False``: the records are the caller's to lose (their line numbers are added)."""
    header = records[0]
    num_stages = header.get("num_stages")
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"{source}: header num_stages must be an int >= 1, got {num_stages!r}")
    by_type: dict[str, list[dict[str, Any]]] = {}
    for i, r in enumerate(records[1:], 2):
        if copy:
            r = {**r}
        r["_line"] = i
        by_type.setdefault(r["type"], []).append(r)
    compact = [_compact(r, num_stages, source) for r in by_type.get("microbatch", [])]
    by_type.setdefault("done", []).extend(done for done, _ in compact)
    stages = _stage_events(
        by_type.get("stage", []), num_stages, source, [events for _, events in compact]
    )
    return RunLog(
        source=source,
        num_stages=num_stages,
        config=header.get("config") or {},
        stages=stages,
        idles=tuple(
            sorted((_idle(r, source) for r in by_type.get("idle", [])), key=lambda x: x.start)
        ),
        issues=tuple(
            sorted((_issue(r, source) for r in by_type.get("issue", [])), key=lambda x: x.t)
        ),
        dones=tuple(
            sorted(
                ((_int(r, "mb", source), _num(r, "t", source)) for r in by_type.get("done", [])),
                key=lambda x: x[1],
            )
        ),
        chunk_sizes=tuple(
            sorted(
                (_num(r, "t", source), _int(r, "chunk_size", source))
                for r in by_type.get("chunk_size", [])
            )
        ),
        requests_t0=next((_num(r, "t", source) for r in by_type.get("requests_t0", [])), None),
        waits=tuple(
            sorted(
                (_wait(r, source) for r in by_type.get("done", []) if "wait" in r),
                key=lambda w: w.start,
            )
        ),
        attention=dict(_attention(r, num_stages, source) for r in by_type.get("attention", [])),
    )


def _attention(
    r: dict[str, Any], num_stages: int, source: str
) -> tuple[int, tuple[str, tuple[str, ...]]]:
    stage, backend, fallbacks = r.get("stage"), r.get("backend"), r.get("fallbacks")
    ok = (
        isinstance(stage, int)
        and 0 <= stage < num_stages
        and isinstance(backend, str)
        and isinstance(fallbacks, list)
        and all(isinstance(f, str) for f in fallbacks)
    )
    if not ok or not isinstance(stage, int) or not isinstance(backend, str):
        raise ValueError(
            f"{_where(r, source)}: an attention record needs stage (0..{num_stages - 1}), "
            f"backend (a str) and fallbacks (a list of str), got {stage!r}, {backend!r}, "
            f"{fallbacks!r}"
        )
    return stage, (backend, tuple(fallbacks or ()))


def _where(r: dict[str, Any], source: str) -> str:
    return f"{source}:{r.get('_line', '?')}"


def _num(r: dict[str, Any], key: str, source: str) -> float:
    v = r.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(
            f"{_where(r, source)}: {r['type']} record field {key!r} must be a "
            f"finite number, got {v!r}"
        )
    return float(v)


def _int(r: dict[str, Any], key: str, source: str) -> int:
    v = r.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(
            f"{_where(r, source)}: {r['type']} record field {key!r} must be an int, got {v!r}"
        )
    return v


def _kind(r: dict[str, Any], source: str) -> str:
    if r.get("kind") not in KINDS:
        raise ValueError(f"{_where(r, source)}: kind must be one of {KINDS}, got {r.get('kind')!r}")
    return r["kind"]


def _idle(r: dict[str, Any], source: str) -> Idle:
    start, end = _num(r, "start", source), _num(r, "end", source)
    if r.get("reason") not in IDLE_REASONS:
        raise ValueError(
            f"{_where(r, source)}: idle reason must be one of {IDLE_REASONS}, "
            f"got {r.get('reason')!r}"
        )
    if end < start:
        raise ValueError(
            f"{_where(r, source)}: idle record ends ({end}) before it starts ({start})"
        )
    return Idle(start, end, r["reason"])


def _issue(r: dict[str, Any], source: str) -> Issue:
    return Issue(
        _int(r, "mb", source),
        _num(r, "t", source),
        _kind(r, source),
        _int(r, "num_prefill_tokens", source),
        _int(r, "num_decode_tokens", source),
        _num(r, "submit", source) if "submit" in r else None,
        _int(r, "ring", source) if "ring" in r else None,
    )


def _wait(r: dict[str, Any], source: str) -> Wait:
    start, end = _num(r, "wait", source), _num(r, "t", source)
    if end < start:
        raise ValueError(
            f"{_where(r, source)}: done record's wait ({start}) is after its t ({end})"
        )
    if not isinstance(r.get("full"), bool):
        raise ValueError(
            f"{_where(r, source)}: done record field 'full' must be a bool, got {r.get('full')!r}"
        )
    return Wait(_int(r, "mb", source), start, end, r["full"])


def _stage_event(r: dict[str, Any], num_stages: int, source: str) -> StageEvent:
    missing = [k for k in _STAGE_FIELDS if k not in r]
    if missing:
        raise ValueError(f"{_where(r, source)}: stage record lacks {', '.join(missing)}")
    stage_idx = _int(r, "stage", source)
    if not 0 <= stage_idx < num_stages:
        raise ValueError(
            f"{_where(r, source)}: stage {stage_idx} is out of range for num_stages={num_stages}"
        )
    times = {k: _num(r, k, source) for k in _TIME_FIELDS}
    if not times["compute_start"] <= times["compute_end"] <= times["send_end"]:
        raise ValueError(
            f"{_where(r, source)}: stage {stage_idx} micro-batch {r['mb']}: times "
            "must satisfy compute_start <= compute_end <= send_end"
        )
    return StageEvent(
        stage=stage_idx,
        mb=_int(r, "mb", source),
        kind=_kind(r, source),
        num_prefill_tokens=_int(r, "num_prefill_tokens", source),
        num_decode_tokens=_int(r, "num_decode_tokens", source),
        wait_start=times["wait_start"],
        input_ready=times["input_ready"],
        compute_start=times["compute_start"],
        compute_end=times["compute_end"],
        send_end=times["send_end"],
    )


def _compact(
    r: dict[str, Any], num_stages: int, source: str
) -> tuple[dict[str, Any], list[StageEvent]]:
    """A ``microbatch`` record as its ``done`` record and its stage events."""
    mb, kind = _int(r, "mb", source), _kind(r, source)
    p, d = _int(r, "num_prefill_tokens", source), _int(r, "num_decode_tokens", source)
    times = r.get("stages")
    if not isinstance(times, list) or len(times) != num_stages:
        raise ValueError(
            f"{_where(r, source)}: microbatch record field 'stages' must list "
            f"{num_stages} stages' times, got {str(times)[:60]!r}"
        )
    events = []
    for s, t in enumerate(times):  # by hand, not with _num: millions of times in a long run
        if not (
            type(t) is list
            and len(t) == 5
            and set(map(type, t)) <= _NUMBER_TYPES
            and math.isfinite(sum(t))
        ):
            raise ValueError(
                f"{_where(r, source)}: microbatch {mb} stage {s}: times must be 5 finite "
                f"numbers ({', '.join(_TIME_FIELDS)}), got {t!r}"
            )
        if not t[2] <= t[3] <= t[4]:
            raise ValueError(
                f"{_where(r, source)}: stage {s} micro-batch {mb}: times "
                "must satisfy compute_start <= compute_end <= send_end"
            )
        wait_start, input_ready, compute_start, compute_end, send_end = map(float, t)
        events.append(
            StageEvent(
                s, mb, kind, p, d, wait_start, input_ready, compute_start, compute_end, send_end
            )
        )
    done: dict[str, Any] = {k: r[k] for k in ("type", "mb", "t", "wait", "full", "_line") if k in r}
    return done, events


def _stage_events(
    rs: list[dict[str, Any]],
    num_stages: int,
    source: str,
    compact: list[list[StageEvent]] | None = None,
) -> tuple[tuple[StageEvent, ...], ...]:
    """Stage records (``rs``) and compact micro-batches' events, checked, per stage."""
    if not rs and not compact:
        raise ValueError(f"{source}: no stage records: the run computed no micro-batch")
    per_stage: list[list[StageEvent]] = [[] for _ in range(num_stages)]
    for r in rs:
        e = _stage_event(r, num_stages, source)
        per_stage[e.stage].append(e)
    for events in compact or ():
        for s, e in enumerate(events):
            per_stage[s].append(e)
    for s, events in enumerate(per_stage):
        events.sort(key=lambda e: (e.compute_start, e.compute_end))
        for a, b in pairwise(events):
            if b.compute_start < a.compute_end:
                raise ValueError(
                    f"{source}: stage {s} starts micro-batch {b.mb} at "
                    f"{b.compute_start} before micro-batch {a.mb} ends at {a.compute_end}"
                )
        mbs = [e.mb for e in events]
        if len(set(mbs)) != len(mbs):
            raise ValueError(f"{source}: stage {s} has more than one record of a micro-batch")
    per_stage = _same_mbs(per_stage, source)
    return tuple(tuple(e) for e in per_stage)


def _same_mbs(per_stage: list[list[StageEvent]], source: str) -> list[list[StageEvent]]:
    """``per_stage`` when every stage has a record of every micro-batch. Micro-batches only
    some stages recorded *after* every complete one are the end of a run cut short (the
    writer killed in the middle of a micro-batch's records, whose last line
    ``read_events`` left out): left out with a warning. Any other gap is an error."""
    seen = [{e.mb for e in events} for events in per_stage]
    common = set.intersection(*seen)
    partial = set.union(*seen) - common
    if not partial:
        return per_stage
    if not common or min(partial) < max(common):
        s = next(s for s, mbs in enumerate(seen) if mbs != seen[0])
        diff = sorted(seen[0] ^ seen[s])[:5]
        raise ValueError(
            f"{source}: stages 0 and {s} ran different micro-batches "
            f"(e.g. {diff}): every stage needs a record of every micro-batch"
        )
    warnings.warn(
        f"{source}: left out micro-batch(es) {sorted(partial)[:5]} at the end of the log, "
        "recorded by only some stages (the run was cut short)",
        stacklevel=3,
    )
    return [[e for e in events if e.mb in common] for events in per_stage]
