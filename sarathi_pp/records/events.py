"""The run's event log, ``events.jsonl``: what the bubble report is rebuilt from.

One JSON object per line; the first line is the header. Times are seconds on one clock for
every process of the run (``time.monotonic()``: system-wide on one machine; a stage on
another node has its offset measured and removed), relative to the header's ``t0``.

Schema version 4 (``SCHEMA_VERSION``; a version 1, 2 or 3 log, which lacks what is marked
"since 2", "since 3" or "since 4", still reads), by ``type``:

``header``  ``schema_version``, ``num_stages``, ``t0`` (absolute monotonic seconds),
            ``config`` (the resolved config as a mapping).
``stage``   one per stage per micro-batch: ``stage``, ``mb`` (micro-batch id), ``kind``
            (``prefill``/``decode``/``hybrid``), ``num_prefill_tokens``,
            ``num_decode_tokens``, ``wait_start`` (the stage became free for this
            micro-batch: it finished the previous one), ``input_ready`` (stage 0: the micro-batch
            reached the stage; stage s > 0: the hidden states arrived), ``compute_start``,
            ``compute_end``, ``send_end`` (the output was handed to the transport; the last
            stage: the sampled tokens were ready to return).
``issue``   the scheduler issued a micro-batch: ``mb``, ``t`` (scheduling began), ``kind``,
            ``num_prefill_tokens``, ``num_decode_tokens``; since 2, optional: ``submit``
            (the micro-batch was built and handed to the executor: from there to stage 0's
            ``input_ready`` is dispatch); since 3, optional: ``ring`` (scheduled ahead: the
            newest micro-batch whose sampled tokens its decodes take over the token ring;
            stage 0's ``input_ready`` is then when they arrived).
``idle``    the scheduler had nothing to issue: ``start``, ``end``, ``reason``
            (``no_work``: no request had arrived; ``dependency``: every schedulable
            sequence waited for its sampled token, no KV block was free, or the in-flight
            limit was reached).
``done``    the driver received a micro-batch's sampled tokens: ``mb``, ``t``; since 2,
            optional: ``wait`` (the driver began waiting for them: before, it was busy) and
            ``full`` (true: the in-flight limit in force, ``num_decode_microbatches_in_flight``
            while only decodes run, held back a micro-batch the scheduler had work for;
            false: the scheduler had nothing to issue, every sequence that could
            run being in flight or no KV block free, the limit reached or not; in logs
            written before commit dd5583a, true whenever the limit was reached:
            Note [done.full]). See ``report/runtime_split.py``.
``chunk_size`` the token budget in force from ``t`` on (``t``, ``chunk_size``): written
            by the engine before the first micro-batch of a scheduler that chunks
            (sarathi, simple_chunking) and again whenever the budget changes
            (``chunk_size: auto``, ``set_scheduler``). Optional: a log without these
            records (another policy, an older run) is still valid.
``requests_t0`` the origin of ``requests.csv``'s instants (the run's first arrival), ``t``:
            written when the first request joins, so per-request figures can be put on
            the log's clock (``requests.bubble_time_s``). Optional (an older log).
``microbatch`` since 3, the compact form of one ``done`` record and the micro-batch's
            ``stage`` records (the same fields, one line instead of ``num_stages + 1``):
            ``mb``, ``t``, optional ``wait`` and ``full`` (as ``done``), ``kind``,
            ``num_prefill_tokens``, ``num_decode_tokens``, and ``stages``: one list per
            stage, in stage order, of ``[wait_start, input_ready, compute_start,
            compute_end, send_end]``. Written from the ``compact_after``-th completed
            micro-batch on (``run.compact_events``: ``auto`` from the 2,000th, so a short
            run's log reads line by line and a simulated run of 600,000 micro-batches x 8
            stages writes 600,000 lines, not 5.4 million).
``attention`` since 4 (optional: an older log has none), a stage's attention backend:
            ``stage``, ``backend`` (the one that runs), ``fallbacks`` (every fallback so
            far, each a reason; empty when none). Written before the micro-batch records
            of the first micro-batch the stage ran and again whenever a new fallback came;
            the last one per stage stands (``summary.json``'s ``attention``).
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import IO, Any

from sarathi_pp.microbatch import StageEvent

SCHEMA_VERSION = 4
READABLE_SCHEMA_VERSIONS = (1, 2, 3, 4)  # an older log lacks the optional fields
EVENT_TYPES = (
    "header", "stage", "issue", "idle", "done", "chunk_size", "requests_t0", "microbatch",
    "attention",
)  # fmt: skip
# ``run.compact_events: auto``: completed micro-batches from this one on are compact records
# (the same number of micro-batches the report's pictures draw at most).
COMPACT_EVENTS_AFTER = 2000


class EventLog:
    """A run's events: held in ``records`` until ``stream_to`` attaches a file, then appended
    to it as they happen (flushed at least every ``FLUSH_EVERY_S``), so a long run holds no
    growing list and a crash loses at most the last second of records."""

    FLUSH_EVERY_S = 1.0

    def __init__(
        self,
        num_stages: int,
        t0: float,
        config: dict[str, Any],
        compact_after: int | None = None,
    ) -> None:
        """``compact_after``: completed micro-batches from this count on are written as one
        ``microbatch`` record each (None: never)."""
        self.t0 = t0
        self.num_stages = num_stages
        self.compact_after = compact_after
        self._num_completed = 0
        self.records: list[dict[str, Any]] = []
        self._sink: IO[str] | None = None
        self._flushed_at = 0.0
        self._add(
            {
                "type": "header",
                "schema_version": SCHEMA_VERSION,
                "num_stages": num_stages,
                "t0": t0,
                "config": config,
            }
        )
        self._idle_since: tuple[float, str] | None = None
        self._chunk_size: int | None = None  # the last chunk_size recorded

    @property
    def open_idle(self) -> tuple[float, str] | None:
        """The idle span going on (absolute start, reason): a record once it ends."""
        return self._idle_since

    def stream_to(self, sink: IO[str]) -> None:
        """Write the records held so far to ``sink`` and every later one as it comes."""
        self._sink = sink
        for r in self.records:
            sink.write(json.dumps(r) + "\n")
        self.records = []
        self.flush()

    def detach(self) -> IO[str] | None:
        """Stop streaming (later records are held again); the sink, for the caller to close."""
        sink, self._sink = self._sink, None
        return sink

    def flush(self) -> None:
        if self._sink is not None:
            self._sink.flush()
            self._flushed_at = time.monotonic()

    def _add(self, record: dict[str, Any]) -> None:
        if self._sink is None:
            self.records.append(record)
            return
        self._sink.write(json.dumps(record) + "\n")
        if time.monotonic() - self._flushed_at >= self.FLUSH_EVERY_S:
            self.flush()

    def attention(self, stage: int, backend: str, fallbacks: tuple[str, ...]) -> None:
        self._add(
            {"type": "attention", "stage": stage, "backend": backend, "fallbacks": list(fallbacks)}
        )

    def stage(self, e: StageEvent) -> None:
        t0 = self.t0  # by hand, not asdict + shifted: one record per stage per micro-batch
        self._add(
            {
                "type": "stage", "stage": e.stage, "mb": e.mb, "kind": e.kind,
                "num_prefill_tokens": e.num_prefill_tokens,
                "num_decode_tokens": e.num_decode_tokens, "wait_start": e.wait_start - t0,
                "input_ready": e.input_ready - t0, "compute_start": e.compute_start - t0,
                "compute_end": e.compute_end - t0, "send_end": e.send_end - t0,
            }
        )  # fmt: skip

    def issue(
        self,
        mb: int,
        t: float,
        kind: str,
        num_prefill: int,
        num_decode: int,
        submit: float | None = None,
        ring: int | None = None,
    ) -> None:
        """``ring``: the newest micro-batch whose sampled tokens this one (scheduled ahead)
        takes as decode inputs over the token ring."""
        self.end_idle(t)
        record = {
            "type": "issue",
            "mb": mb,
            "t": t - self.t0,
            "kind": kind,
            "num_prefill_tokens": num_prefill,
            "num_decode_tokens": num_decode,
        }
        if submit is not None:
            record["submit"] = submit - self.t0
        if ring is not None:
            record["ring"] = ring
        self._add(record)

    def idle(self, t: float, reason: str) -> None:
        """The scheduler has nothing to issue from ``t`` on (until the next ``issue``)."""
        if self._idle_since is not None and self._idle_since[1] != reason:
            self.end_idle(t)
        if self._idle_since is None:
            self._idle_since = (t, reason)

    def end_idle(self, t: float) -> None:
        if self._idle_since is not None:
            start, reason = self._idle_since
            if t > start:
                self._add(
                    {"type": "idle", "start": start - self.t0, "end": t - self.t0, "reason": reason}
                )
            self._idle_since = None

    def done(self, mb: int, t: float, wait: float | None = None, full: bool | None = None) -> None:
        self._add(self._done_record("done", mb, t, wait, full))

    def _done_record(
        self, kind: str, mb: int, t: float, wait: float | None, full: bool | None
    ) -> dict[str, Any]:
        """A ``done`` record's fields (also the start of a compact ``microbatch`` one)."""
        record: dict[str, Any] = {"type": kind, "mb": mb, "t": t - self.t0}
        if wait is not None:
            record["wait"] = wait - self.t0
            record["full"] = bool(full)
        return record

    # --- the engine loop's two moments, in one place for every consumer (the run dir's
    # recorder and the server's bubble window): a new field reaches both or neither ---------
    def issued(self, microbatch: Any, now: float, submit: float | None = None) -> None:
        """``microbatch`` (a ``MicroBatch``; duck-typed: this module sits below it) was
        scheduled from ``now`` and handed to the executor at ``submit``."""
        mb = microbatch
        sources = mb.ring_sources
        self.issue(
            mb.microbatch_id, now, mb.kind, mb.num_prefill_tokens, mb.num_decode_tokens, submit,
            sources[-1] if sources else None,
        )  # fmt: skip

    def completed(
        self,
        microbatch: Any,
        result: Any,
        now: float,
        wait: float | None = None,
        full: bool | None = None,
    ) -> None:
        """``microbatch``'s tokens are here at ``now`` (a ``MicroBatchResult`` with every stage's
        event); ``wait``: the driver began waiting for them; ``full``: the in-flight limit
        held back a micro-batch the scheduler had work for."""
        events = result.events
        for e in events:
            if e.attention is not None:
                self.attention(e.stage, e.attention.backend, e.attention.fallbacks)
        k, self._num_completed = self._num_completed, self._num_completed + 1
        if (
            self.compact_after is not None
            and k >= self.compact_after
            and len(events) == self.num_stages
            and all(e.stage == s for s, e in enumerate(events))
        ):
            self._microbatch(microbatch, events, now, wait, full)
            return
        self.done(microbatch.microbatch_id, now, wait, full)
        for e in events:
            self.stage(e)

    def _microbatch(
        self, mb: Any, events: Any, now: float, wait: float | None, full: bool | None
    ) -> None:
        t0 = self.t0
        record = self._done_record("microbatch", mb.microbatch_id, now, wait, full)
        e0 = events[0]
        record["kind"] = e0.kind
        record["num_prefill_tokens"] = e0.num_prefill_tokens
        record["num_decode_tokens"] = e0.num_decode_tokens
        record["stages"] = [
            [e.wait_start - t0, e.input_ready - t0, e.compute_start - t0, e.compute_end - t0,
             e.send_end - t0]
            for e in events
        ]  # fmt: skip
        self._add(record)

    def chunk_size(self, t: float, chunk_size: int) -> None:
        """The scheduler's token budget is ``chunk_size`` from ``t`` on; recorded the first
        time and when it differs from the last record (so callable before every micro-batch)."""
        if chunk_size != self._chunk_size:
            self._chunk_size = chunk_size
            self._add({"type": "chunk_size", "t": t - self.t0, "chunk_size": chunk_size})

    def requests_t0(self, t: float) -> None:
        """``requests.csv``'s instants are relative to ``t`` (the first arrival)."""
        self._add({"type": "requests_t0", "t": t - self.t0})

    def write(self, path: str | Path) -> None:
        """Write the records held (a log that never streamed) to ``path``."""
        with open(path, "w") as f:
            for r in self.records:
                f.write(json.dumps(r) + "\n")


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """Read ``events.jsonl``; ``ValueError`` naming the file and line if it is not valid.
    A last line cut short (no newline after it, not valid JSON: the writer was killed in
    the middle of it) is left out with a warning: the records before it stand."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no event log {str(p)!r}")
    text = p.read_text()
    lines = text.splitlines()
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) and not text.endswith("\n"):
                warnings.warn(f"{p}:{i}: left out a last line cut short ({e})", stacklevel=2)
                break
            raise ValueError(f"{p}:{i}: not valid JSON: {e}") from e
        if not isinstance(r, dict) or r.get("type") not in EVENT_TYPES:
            raise ValueError(f"{p}:{i}: not an event record: {line[:80]!r}")
        records.append(r)
    if not records or records[0]["type"] != "header":
        raise ValueError(f"{p}: the first line must be the header")
    if records[0].get("schema_version") not in READABLE_SCHEMA_VERSIONS:
        raise ValueError(
            f"{p}: schema version {records[0].get('schema_version')!r}, this reader knows "
            f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))}"
        )
    return records
