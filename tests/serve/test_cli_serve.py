"""``sarathi-pp serve`` as a process: flags, the API key from the environment, and the
graceful stop on SIGTERM (in-flight stream aborted, run records written, exit 0)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from sarathi_pp.cli import build_parser  # noqa: E402


def test_serve_flags_and_defaults() -> None:
    args = build_parser().parse_args(["serve", "--model", "m"])
    assert (args.host, args.port, args.served_model_name, args.api_key) == (
        "127.0.0.1",
        8000,
        None,
        None,
    )
    args = build_parser().parse_args(
        ["serve", "--port", "9", "--api-key", "k", "--served-model-name", "n", "--set", "a.b=1"]
    )
    assert (args.port, args.api_key, args.served_model_name) == (9, "k", ["n"])
    assert args.tool_call_parser == "hermes"  # vLLM's flag; tool_choice auto reads with it


def test_vllm_flag_names_reach_the_config() -> None:
    """Every vLLM flag name this CLI takes, as the config key it means (``vllm serve MODEL
    ...`` habits); ``serve MODEL`` positional."""
    from sarathi_pp.cli.common import config_from_args

    argv = ["serve", "builtin:tiny-llama", "--max-model-len", "512",
            "--gpu-memory-utilization", "0.5", "--max-num-seqs", "7", "--tokenizer", "tok",
            "--block-size", "32", "-tp", "1", "-pp", "2", "--dtype", "half",
            "--served-model-name", "a", "b", "--uvicorn-log-level", "warning",
            "--scheduler", "vllm", "--max-num-batched-tokens", "1024"]  # fmt: skip
    args = build_parser().parse_args(argv)
    assert (args.model_tag, args.served_model_name, args.log_level) == (
        "builtin:tiny-llama", ["a", "b"], "warning",
    )  # fmt: skip
    args.model = args.model_tag
    c = config_from_args(args)
    assert (c.model.path, c.model.max_model_len, c.model.tokenizer, c.model.dtype) == (
        "builtin:tiny-llama", 512, "tok", "float16",
    )  # fmt: skip
    assert (c.cache.gpu_memory_utilization, c.cache.block_size) == (0.5, 32)
    assert (c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens) == (7, 1024)
    assert (c.parallel.pipeline_parallel_size, c.parallel.tensor_parallel_size) == (2, 1)
    assert build_parser().parse_args(["serve", "--dtype", "float"]).dtype == "float32"
    for flag, on in (([], True), (["--no-enable-prefix-caching"], False)):
        args = build_parser().parse_args(["serve", "m", *flag])
        args.model = args.model_tag
        assert config_from_args(args).cache.enable_prefix_caching is on
    for flag, on in (([], True), (["--no-enforce-eager"], False), (["--enforce-eager"], True)):
        args = build_parser().parse_args(["serve", "m", *flag])
        args.model = args.model_tag
        assert config_from_args(args).model.enforce_eager is on


@pytest.mark.parametrize(
    "argv, words",
    [
        (["m", "--model", "other"], ["given twice", "'m'", "'other'"]),
        (["m", "--max-num-batched-tokens", "512"], ["chunk_size=512", "'sarathi'"]),
        (["m", "-tp", "2"], ["tensor_parallel_size=2", "not"]),
        (["m", "--tool-call-parser", "mistral"], ["unknown tool-call parser 'mistral'", "hermes"]),
    ],
)
def test_vllm_flags_we_cannot_honour_are_refused_by_name(argv, words, capsys) -> None:
    from sarathi_pp.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(proc: subprocess.Popen, base: str, timeout_s: float) -> None:
    """Until the server at ``base`` answers ``/health`` with 200 (it may still be loading)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        assert time.monotonic() < deadline, "the server did not start"
        try:
            if httpx.get(base + "/health").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)


def test_sigterm_stops_gracefully(llama_dir: Path, tmp_path: Path) -> None:
    port = _free_port()
    run_dir = tmp_path / "run"
    base = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "sarathi_pp", "serve", str(llama_dir)]  # vLLM's positional
    argv += ["--port", str(port), "--run-dir", str(run_dir), "--uvicorn-log-level", "warning"]
    env = {**os.environ, "SARATHI_PP_API_KEY": "secret"}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_until_healthy(proc, base, 60)
        assert httpx.get(base + "/v1/models").status_code == 401
        headers = {"Authorization": "Bearer secret"}
        models = httpx.get(base + "/v1/models", headers=headers).json()
        assert [m["id"] for m in models["data"]] == [str(llama_dir)]  # MODEL's value

        body = {"prompt": "x", "max_tokens": 500, "ignore_eos": True, "stream": True}
        with httpx.stream(
            "POST", base + "/v1/completions", json=body, headers=headers, timeout=30
        ) as r:
            events = r.iter_lines()
            first = next(line for line in events if line.startswith("data:"))
            assert json.loads(first[5:])["choices"][0]["finish_reason"] is None
            proc.send_signal(signal.SIGTERM)
            rest = [line[5:].strip() for line in events if line.startswith("data:")]
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "abort"
        assert proc.wait(30) == 0
        assert (run_dir / "requests.csv").is_file()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_stops_gracefully_after_the_pipeline_is_lost(llama_dir: Path, tmp_path: Path):
    """PP=2 on the server's own Ray; stage 1 exits on its first micro-batch with no restart
    left: requests get 503 naming the stage, and SIGTERM still stops the server gracefully
    (exit 0, records written). Ray's shutdown used to reset the process's SIGTERM handling
    when the engine died, and SIGTERM then killed the server (143, no records)."""
    port = _free_port()
    run_dir = tmp_path / "run"
    base = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "sarathi_pp", "serve", "--model", str(llama_dir),
            "--pipeline-parallel-size", "2", "--port", str(port), "--run-dir", str(run_dir),
            "--log-level", "warning", "--set", "parallel.max_stage_restarts=0",
            "--set", "parallel.inject_fault=exit@stage=1,step=1"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_until_healthy(proc, base, 120)  # it starts its own Ray
        body = {"prompt": "x", "max_tokens": 4}
        r = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 503 and "pipeline stage 1" in r.text, r.text
        assert httpx.get(base + "/health").status_code == 503
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.communicate()[1].decode()[-2000:]
        assert "sarathi-pp: stopped" in proc.communicate()[1].decode()
        rows = (run_dir / "requests.csv").read_text().splitlines()
        assert len(rows) == 2 and ",abort," in rows[1], rows  # the request the loss ended
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_chat_template_flag_is_a_file_or_a_template(tmp_path: Path) -> None:
    from sarathi_pp.cli.serve import read_chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert read_chat_template(str(path)) == "{{ messages }}"
    assert read_chat_template("{% for m in messages %}{% endfor %}").startswith("{%")
    with pytest.raises(FileNotFoundError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
