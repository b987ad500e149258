"""Ctrl-C in the middle of ``generate``: a real SIGINT, delivered by a timer wherever the
main thread happens to be (a forward pass, scheduling, applying tokens). The interrupted
call's requests leave the engine, every block is free again, and the next call's outputs
equal a clean run's, promptly, also with one sequence at a time."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from sarathi_pp import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=450, temperature=0.0, ignore_eos=True)
PROMPTS = [[5 + i, 17, 33 + i, 2, 90 - i] * (3 + i) for i in range(4)]
# The interrupted call must outlast the longest delay on the fastest machine: 24 LONG requests
# took 0.63 s on a fast 2-core VM (and under 0.6 s in a CI run: the SIGINT came too late);
# 240 take 5.6 s there. The test waits only for the delay, not for the run.
INTERRUPTED = PROMPTS * 60


pytestmark = pytest.mark.usefixtures("python_ctrl_c")


def interrupt_after(delay_s: float) -> threading.Timer:
    timer = threading.Timer(delay_s, signal.raise_signal, [signal.SIGINT])
    timer.start()
    return timer


def check_recovers(llm: LLM, reference: list[list[int]], delay_s: float) -> None:
    timer = interrupt_after(delay_s)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(INTERRUPTED, LONG, use_tqdm=False)  # runs far longer than delay_s
    finally:
        timer.cancel()
    engine = llm.engine
    assert not engine.has_unfinished_requests() and engine.num_inflight == 0
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # no block leaked
    start = time.monotonic()
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 10
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("max_num_seqs", [256, 1])
def test_interrupted_generate_then_clean_outputs(llama_dir, max_num_seqs):
    kw = dict(max_model_len=512, chunk_size=16, max_num_seqs=max_num_seqs, dtype="float32")
    with LLM(str(llama_dir), **kw) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert len({tuple(r) for r in reference}) > 1  # the outputs vary: the check means something
        for delay_s in (0.05, 0.25, 0.6):  # early (prefills), later (decodes)
            check_recovers(llm, reference, delay_s)


def test_sigterm_keeps_every_finished_request(llama_dir, tmp_path):
    """``sarathi-pp generate`` stopped by SIGTERM (as a job scheduler stops it): exit 143,
    the requests that finished are in ``--output`` and in the run dir's records."""
    import json
    import os
    import subprocess
    import sys

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"prompt number {i} " * 3 for i in range(12)) + "\n")
    out, run = tmp_path / "out.jsonl", tmp_path / "run"
    cmd = [sys.executable, "-m", "sarathi_pp", "generate", "--model", str(llama_dir),
           "--set", "model.max_model_len=512", "--set", "scheduler.max_num_seqs=2",
           "--dtype", "float32", "--prompts-file", str(prompts), "--max-tokens", "300",
           "--ignore-eos", "--output", str(out), "--run-dir", str(run), "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if out.is_file() and out.read_text().count("\n") >= 2:
            break  # two requests finished: stop the run in the middle
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM" in err and "of 12 requests finished" in err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert 2 <= len(records) < 12
    assert all(len(r["token_ids"]) == 300 and r["finish_reason"] == "length" for r in records)
    assert len({r["index"] for r in records}) == len(records)
    rows = (run / "requests.csv").read_text().splitlines()[1:]
    finished = [r for r in rows if ",length," in r]
    assert len(finished) >= len(records)  # the records kept what finished
    assert json.loads((run / "summary.json").read_text())["requests"]["num_requests"] >= 2
