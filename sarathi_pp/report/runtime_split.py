"""The runtime's share of stage 0's wait, cut into measured parts.

``bubbles.py`` paints stage 0's wait for micro-batch ``k`` from the scheduler's ``idle``
records (``dependency``: work exists but nothing could be issued) and ``schedule``
elsewhere (from the ``issue`` record to the micro-batch's start on stage 0). This module
says where, inside those two classes, the time went, from the driver's records
(``events.py``, schema 2: ``issue.submit``, ``done.wait`` and ``done.full``). For micro-batch
``j`` whose tokens the driver waited for: ``w`` the wait's start, ``x`` the last stage's
``send_end(j)`` (the tokens were ready there), ``y`` the ``done`` record (the driver has
them):

``dependency`` becomes

- ``token_return``: ``[max(x, w), y]``: the tokens travel from the last stage to the driver.
- ``in_flight``: ``[w, min(x, y)]`` when ``full``: the in-flight limit held back a
  micro-batch the scheduler had work for while ``j`` was still in the pipeline (the data
  plane's latency and the stages' imbalance; more micro-batches in flight would fill it).
- ``load``: the same span when not ``full``: the scheduler had nothing to issue, every
  sequence that could run being in flight already (too few sequences to fill the
  micro-batches in flight) or no KV block free, whether the limit was reached or not
  (``Scheduler.has_ready_work``): the load's own share. At the end of a run's prefills,
  say, every sequence is in the last hybrids in flight and stage 0 waits for the slower
  last stage to finish them: more micro-batches in flight would not fill that wait. (With
  ``num_decode_microbatches_in_flight`` below the limit, the first decodes back from those
  hybrids are held until the next one is: ``full``, so ``in_flight``, though stage 0 would
  wait for the last stage all the same.)
- ``driver``: the rest, when the driver was not waiting: processing the outputs of the
  micro-batch before, the loop around ``step()``, a scheduling attempt that found nothing.

First, stage 0's wait for ``k`` over ``[submit(k), input_ready(k)]`` is ``dispatch`` (the
micro-batch handed to the executor until stage 0 has it), whichever of the two classes it
had: the driver, having submitted ``k``, may already wait for tokens (``dependency``) while
``k`` travels. When ``k`` was scheduled ahead (its ``issue`` names ``ring = j``: its decodes
take ``j``'s tokens over the token ring), stage 0 then waits for those tokens from
``input_ready(k)`` (``k`` is there) to ``compute_start(k)``: that span is cut at
``x = send_end(j)`` on the last stage, ``in_flight`` before (``j`` still in the pipeline),
``ring`` after (the tokens' way from the last stage to stage 0). The rest of ``schedule`` stays ``schedule``: building the micro-batch
(``[t(k), submit(k)]``) and stage 0's own start (``input_ready -> compute_start``).

An older log (no ``wait``) still gets ``token_return`` (from the previous ``done`` on: the
driver is assumed to wait right after it); the rest of ``dependency`` stays
``dependency``. Without ``submit`` there is no ``dispatch``. Either way the parts cut the
two classes and nothing else: ``load + in_flight + token_return + driver + dispatch +
schedule + dependency`` equals the unsplit ``dependency + schedule`` (``LEGACY_CLASS``: the
class each part comes from; ``dispatch`` from either, ``in_flight`` from ``schedule`` too
for a micro-batch scheduled ahead).
"""

from __future__ import annotations

from sarathi_pp.report.log import RunLog

DEPENDENCY = "dependency"
SCHEDULE = "schedule"
LEGACY_CLASS = {
    "load": DEPENDENCY,
    "in_flight": DEPENDENCY,  # or SCHEDULE: a wait for the ring's tokens (see the module)
    "token_return": DEPENDENCY,
    "driver": DEPENDENCY,
    "dispatch": SCHEDULE,  # or DEPENDENCY: see the module
    "ring": SCHEDULE,  # stage 0 waiting for the ring's tokens, micro-batch in hand
}

Span = tuple[float, float, str]  # [start, end] spent ``label``


def dependency_spans(log: RunLog) -> list[Span]:
    """Sorted, disjoint spans of the driver waiting for tokens, by part (see the module)."""
    last = log.by_mb(log.num_stages - 1)
    waits = {w.mb: w for w in log.waits}
    out: list[Span] = []
    prev_done = float("-inf")
    for mb, y in log.dones:
        e, w = last.get(mb), waits.get(mb)
        x = e.send_end if e is not None else y  # an empty micro-batch never ran
        start = w.start if w is not None else max(prev_done, min(x, y))
        prev_done = y
        if w is not None and min(x, y) > start:
            out.append((start, min(x, y), "in_flight" if w.full else "load"))
        if y > max(x, start):
            out.append((max(x, start), y, "token_return"))
    out.sort()
    return out


def dependency_rest(log: RunLog) -> str:
    """The class of ``dependency`` time outside every wait: ``driver`` when the log records
    the waits, else (an older log) ``dependency``."""
    return "driver" if log.waits else DEPENDENCY


def dispatch_spans(log: RunLog) -> dict[int, list[Span]]:
    """Per micro-batch: ``[submit, input_ready on stage 0]`` as ``dispatch`` (with a
    ``submit`` time), and for one scheduled ahead its wait for the ring's tokens
    ``[input_ready, compute_start]`` as ``in_flight`` then ``ring`` (see the module);
    sorted, disjoint, non-empty."""
    first, last = log.by_mb(0), log.by_mb(log.num_stages - 1)
    out: dict[int, list[Span]] = {}
    for i in log.issues:
        e = first.get(i.mb)
        if e is None:
            continue
        spans: list[Span] = []
        if i.submit is not None and e.input_ready > i.submit:
            spans.append((i.submit, e.input_ready, "dispatch"))
        source = last.get(i.ring) if i.ring is not None else None
        if source is not None:
            a, b = e.input_ready, e.compute_start
            x = min(max(source.send_end, a), b)
            spans += [s for s in ((a, x, "in_flight"), (x, b, "ring")) if s[1] > s[0]]
        if spans:
            out[i.mb] = spans
    return out
