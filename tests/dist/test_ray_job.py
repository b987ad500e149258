"""``ray job submit --working-dir . -- python -m sarathi_pp.launch.ray_job ...`` against a
real ``ray start --head`` cluster (with its dashboard: the job server lives there)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sarathi_pp import LLM, SamplingParams
from sarathi_pp.comm.dist_setup import free_port

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))


@pytest.fixture
def ray_head(tmp_path):
    """A head node of its own, stopped by killing its process group (``ray stop`` would
    stop every Ray on the machine, the test session's included)."""
    dash = free_port()
    # The head's PATH reaches the job: put this interpreter's bin folder first, as an
    # activated virtualenv would (``make test`` runs .venv/bin/python without activating).
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "RAY_ADDRESS": "", "RAY_AUTH_MODE": "token", "PATH": path}
    head = subprocess.Popen(
        # Every port its own: the session's Ray (tests/conftest.py) already holds the
        # defaults, e.g. the dashboard agent's 52365, and a clash leaves no job agent.
        [RAY, "start", "--head", "--block", "--port", str(free_port()), "--num-cpus", "4",
         "--include-dashboard", "true", "--dashboard-port", str(dash),
         "--dashboard-agent-listen-port", str(free_port()),
         "--dashboard-agent-grpc-port", str(free_port()),
         "--runtime-env-agent-port", str(free_port()),
         "--metrics-export-port", str(free_port()), "--disable-usage-stats"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        yield f"http://127.0.0.1:{dash}", env
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)


def submit(address, env, args, timeout=240):
    cmd = [RAY, "job", "submit", "--address", address, "--working-dir", str(REPO), "--",
           sys.executable, "-m", "sarathi_pp.launch.ray_job", *args]  # fmt: skip
    deadline = time.monotonic() + 120
    not_up_yet = ("Connection", "No available agent", "try again later")
    while True:  # the job server and its agent come up some seconds after the head
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        out = proc.stderr + proc.stdout
        if (
            proc.returncode == 0
            or time.monotonic() > deadline
            or not any(m in out for m in not_up_yet)
        ):
            return proc
        time.sleep(3)


def test_ray_job_submit_matches_pp1(ray_head, llama_dir):
    address, env = ray_head
    prompts = ["Hello", "Two stages"]
    args = ["--model", str(llama_dir), "--pipeline-parallel-size", "2", "--max-tokens", "6",
            "--ignore-eos", "--output", "-", "--set", "model.max_model_len=256"]  # fmt: skip
    for p in prompts:
        args += ["--prompt", p]
    proc = submit(address, env, args)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"index"')]
    with LLM(str(llama_dir), max_model_len=256) as pp1:
        ref = pp1.generate(
            prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False
        )
    assert [r["token_ids"] for r in records] == [o.outputs[0].token_ids for o in ref]
    # A relative output would land in Ray's copy of the working dir: refused, naming it.
    proc = submit(address, env, ["--model", str(llama_dir), "--prompt", "x", "--run-dir", "rd"])
    assert proc.returncode != 0
    assert (
        "--run-dir 'rd' is relative, and this job runs in Ray's copy" in proc.stdout + proc.stderr
    )
