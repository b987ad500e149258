"""The Hugging Face peer of the serving benchmark on the tiny Llama: exact output lengths,
greedy tokens as HF ``generate``, sane per-token times, arrivals honoured by the manager
mode, and ``RunDir.write_requests`` on its outputs.

transformers' continuous batching attends over a paged cache with its own masks, so its
logits may differ from ``generate``'s by rounding: tokens are compared with
``assert_greedy_match`` (a divergence is accepted only at a near-tie).
"""

from __future__ import annotations

import csv
import json
import random

import pytest
import torch
from helpers import assert_greedy_match, hf_greedy

from sarathi_pp.bench.peer_hf import run_hf_peer
from sarathi_pp.bench.workload import BenchRequest
from sarathi_pp.records.run_dir import RunDir

ARRIVALS_S = (0.0, 0.3, 0.6)


def make_requests(arrivals, output_tokens, prompt_lens=(5, 17, 40), seed=0):
    rng = random.Random(seed)
    return [
        BenchRequest(
            request_id=f"req-{i}",
            arrival_s=arrival,
            prompt_token_ids=tuple(rng.randrange(3, 256) for _ in range(n)),
            output_tokens=out,
        )
        for i, (arrival, out, n) in enumerate(zip(arrivals, output_tokens, prompt_lens))
    ]


@pytest.fixture(scope="module")
def all_at_once(llama_dir):
    requests = make_requests((0.0,) * 3, (8,) * 3)
    finished = []
    threads_before = torch.get_num_threads()
    result = run_hf_peer(llama_dir, requests, num_threads=1, progress=finished.append)
    assert torch.get_num_threads() == threads_before  # restored
    return requests, result, finished


@pytest.fixture(scope="module")
def with_arrivals(llama_dir):
    requests = make_requests(ARRIVALS_S, (4, 6, 8))
    finished = []
    return (
        requests,
        run_hf_peer(llama_dir, requests, num_threads=1, progress=finished.append),
        finished,
    )


def check_outputs(model_dir, requests, result) -> None:
    assert [o.request_id for o in result.outputs] == [r.request_id for r in requests]
    for r, out in zip(requests, result.outputs):
        assert out.error is None
        assert out.prompt_token_ids == list(r.prompt_token_ids)
        tokens = out.outputs[0].token_ids
        assert len(tokens) == r.output_tokens
        assert out.outputs[0].finish_reason == "length"
        ref, margins = hf_greedy(model_dir, r.prompt_token_ids, r.output_tokens)
        assert_greedy_match(tokens, ref, margins)
        check_times(out.metrics, len(tokens))


def check_times(m, num_tokens) -> None:
    t = m.token_times
    assert len(t) == num_tokens
    assert all(a <= b for a, b in zip(t, t[1:])), t
    assert m.arrival_time <= m.first_scheduled_time <= t[0] == m.first_token_time
    assert t[-1] <= m.finished_time


def test_all_at_once_runs_generate_batch_and_matches_hf(llama_dir, all_at_once):
    requests, result, finished = all_at_once
    assert result.mode == "generate_batch"
    assert result.latency_comparable
    assert "generate_batch" in result.note and "1 threads" in result.note
    assert finished[-1] == len(requests)
    check_outputs(llama_dir, requests, result)
    assert len({o.metrics.arrival_time for o in result.outputs}) == 1  # one start for all


def test_arrivals_replayed_by_the_manager(llama_dir, with_arrivals):
    requests, result, finished = with_arrivals
    assert result.mode == "manager"
    assert result.latency_comparable
    assert finished == [1, 2, 3]
    check_outputs(llama_dir, requests, result)
    start = result.outputs[0].metrics.arrival_time
    for r, out in zip(requests, result.outputs):
        assert out.metrics.arrival_time == pytest.approx(start + r.arrival_s)
        # Served at its arrival: not before, and (steps take ms) well before the next one.
        assert 0 <= out.metrics.ttft < 0.3, (r.request_id, out.metrics.ttft)


def test_requests_csv_from_peer_outputs(tmp_path, with_arrivals):
    requests, result, _ = with_arrivals
    RunDir(tmp_path).write_requests(result.outputs)
    with open(tmp_path / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    assert [row["request_id"] for row in rows] == [r.request_id for r in requests]
    for r, row in zip(requests, rows):
        assert int(row["num_output_tokens"]) == r.output_tokens
        assert float(row["arrival_s"]) == pytest.approx(r.arrival_s, abs=1e-6)
        times = [float(x) for x in row["token_times"].split()]
        assert len(times) == r.output_tokens and times[0] >= 0


def test_model_folder_errors_name_the_folder(tmp_path, llama_dir):
    requests = make_requests((0.0,), (2,))
    with pytest.raises(FileNotFoundError, match="config.json"):
        run_hf_peer(tmp_path, requests)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        run_hf_peer(tmp_path, requests)
    with pytest.raises(ValueError, match="float64"):
        run_hf_peer(llama_dir, requests, dtype="float64")
    with pytest.raises(ValueError, match="empty"):
        run_hf_peer(llama_dir, [])


def test_no_progress_means_no_loading_bar(llama_dir, capfd):
    """``bench --peer hf --no-progress`` (``progress=None``): transformers' own "Loading
    weights" bar stays off too, and its setting is restored after."""
    from transformers.utils import logging as hf_logging

    capfd.readouterr()
    result = run_hf_peer(llama_dir, make_requests((0.0,) * 2, (2,) * 2, (5, 9)), num_threads=1)
    assert all(len(o.outputs[0].token_ids) == 2 for o in result.outputs)
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()
