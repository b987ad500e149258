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
    assert (args.port, args.api_key, args.served_model_name) == (9, "k", "n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_stops_gracefully(llama_dir: Path, tmp_path: Path) -> None:
    port = _free_port()
    run_dir = tmp_path / "run"
    base = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "sarathi_pp", "serve", "--model", str(llama_dir)]
    argv += ["--port", str(port), "--run-dir", str(run_dir), "--log-level", "warning"]
    env = {**os.environ, "SARATHI_PP_API_KEY": "secret"}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert httpx.get(base + "/v1/models").status_code == 401
        headers = {"Authorization": "Bearer secret"}
        models = httpx.get(base + "/v1/models", headers=headers).json()
        assert [m["id"] for m in models["data"]] == [str(llama_dir)]  # --model's value

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
