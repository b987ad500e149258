"""``requests.bubble_time_s`` on hand-made logs: each request's idle stage time between its
first scheduled time and its finish, summed over stages / number of stages."""

from __future__ import annotations

import pytest

from sarathi_pp.report.log import parse_log
from sarathi_pp.report.request_bubbles import StageBusy, phase_bubble_times, request_bubble_times
from sarathi_pp.report.request_metrics import RequestRow, distribution
from sarathi_pp.report.summary import requests_entry
from sarathi_pp.report.text import prefill_split_text


def stage(s: int, mb: int, start: float, end: float) -> dict:
    return {
        "type": "stage", "stage": s, "mb": mb, "kind": "prefill", "num_prefill_tokens": 8,
        "num_decode_tokens": 0, "wait_start": start, "input_ready": start,
        "compute_start": start, "compute_end": end, "send_end": end,
    }  # fmt: skip


def log(requests_t0: float | None):
    records = [
        {"type": "header", "schema_version": 1, "num_stages": 2, "t0": 100.0, "config": {}},
        stage(0, 0, 0.0, 1.0), stage(0, 1, 2.0, 3.0),  # stage 0 busy [0, 1], [2, 3]
        stage(1, 0, 1.0, 2.0), stage(1, 1, 3.0, 4.0),  # stage 1 busy [1, 2], [3, 4]
    ]  # fmt: skip
    if requests_t0 is not None:
        records.append({"type": "requests_t0", "t": requests_t0})
    return parse_log(records, "hand-made")


def row(rid: str, first_scheduled: float | None, finished: float | None) -> RequestRow:
    return RequestRow(rid, 4, 0.0, finished, 0.1, 1.0, 0.0, 0.1, 0.1, None, first_scheduled)


def test_busy_in_a_span():
    busy = StageBusy([(0.0, 1.0), (2.0, 3.0)])
    assert busy.idle(0.5, 3.5) == pytest.approx(3.0 - 1.5)
    assert busy.idle(1.0, 2.0) == pytest.approx(1.0)
    assert busy.idle(2.2, 2.8) == pytest.approx(0.0)
    assert busy.idle(-1.0, 5.0) == pytest.approx(6.0 - 2.0)


def test_bubble_time_by_hand():
    rows = [
        row("a", 0.0, 3.0),  # log [0.5, 3.5]: stage 0 idle 1.5, stage 1 idle 1.5
        row("b", 1.6, 2.4),  # log [2.1, 2.9]: stage 0 idle 0, stage 1 idle 0.8
        row("c", None, None),  # never scheduled (e.g. aborted while waiting): no figure
    ]
    times = request_bubble_times(log(requests_t0=0.5), rows)
    assert times == pytest.approx([1.5, 0.4])
    entry = requests_entry(log(requests_t0=0.5), rows)["bubble_time_s"]
    assert entry["p50"] == pytest.approx(0.95) and entry["max"] == pytest.approx(1.5)
    assert entry["p90"] == pytest.approx(0.4 + 0.9 * 1.1)


def test_an_older_log_gives_no_figure():
    rows = [row("a", 0.0, 3.0)]
    assert request_bubble_times(log(requests_t0=None), rows) is None
    assert requests_entry(log(requests_t0=None), rows)["bubble_time_s"]["p50"] is None


def test_bubble_time_per_phase_by_hand():
    rows = [row("a", 0.0, 3.0), row("b", 1.6, 2.4), row("c", None, None)]
    # cut at 2.0 (log clock): a lives on both sides, b only after it
    before, after = phase_bubble_times(log(requests_t0=0.5), rows, cut=2.0)
    # a before [0.5, 2]: stage 0 idle 1.0, stage 1 idle 0.5; after [2, 3.5]: 0.5 and 1.0
    assert before == pytest.approx([0.75])
    assert after == pytest.approx([0.75, 0.4])
    assert phase_bubble_times(log(requests_t0=None), rows, cut=2.0) is None


def test_phase_split_text_prints_the_per_request_bubble_time():
    split = {"cut_s": 2.0, "while_prefills": 0.05, "decode_only": 0.3, "decode_only_share": 0.2}
    assert "per request" not in prefill_split_text({"prefill_split": split})  # older summary
    split["request_bubble_time_s"] = {
        "while_prefills": distribution([0.75]),
        "decode_only": distribution([0.75, 0.4]),
    }
    text = prefill_split_text({"prefill_split": split})
    assert text is not None and text.endswith(
        "per request p50/p99 0.7500/0.7500 s while prefills remain, 0.5750/0.7465 s after"
    ), text
