"""Every block of the guide tagged ``<!-- runnable -->`` runs as written, on
``builtin:tiny-llama`` (the offline Python example, ``sarathi-pp generate``, ``sarathi-pp
serve`` with one ``openai`` request, ``sarathi-pp report``, a small ``sarathi-pp
simulate``). Each page runs in a fresh folder that holds a link to the project's
``configs/``; ``sarathi-pp`` is this interpreter's ``python -m sarathi_pp``; a server's port
(8000 in the pages) is swapped for a free one. The pages' blocks run in page order, so a
``report`` follows the ``generate`` that recorded its run dir.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from doc_blocks import ROOT, Block, blocks, guide_pages

pytestmark = pytest.mark.slow

PAGES = [p for p in guide_pages() if any(b.runnable for b in blocks(p))]
TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    # this checkout's sarathi_pp, whichever one is installed
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


def _command(block: Block, port: int) -> list[str]:
    code = block.code.replace("8000", str(port))
    if block.lang == "python":
        return [sys.executable, "-c", code]
    assert block.lang in ("bash", "sh"), f"{block.where}: a runnable block needs a language"
    code = re.sub(r"(?m)^(\s*)sarathi-pp\b", rf'\1"{sys.executable}" -m sarathi_pp', code)
    return ["bash", "-euo", "pipefail", "-c", code]


def _wait_healthy(proc: subprocess.Popen, port: int, where: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"{where}: the server exited {proc.returncode}: {proc.stdout.read()}"
            )
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{where}: the server was not healthy within {TIMEOUT_S} s")


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_runnable_blocks(page: Path, tmp_path: Path):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    port, server = _free_port(), None
    try:
        for block in (b for b in blocks(page) if b.runnable):
            argv = _command(block, port)
            if block.tag == "runnable: server":
                assert server is None, f"{block.where}: one server a page"
                server = subprocess.Popen(
                    argv, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True, start_new_session=True,
                )  # fmt: skip
                _wait_healthy(server, port, block.where)
                continue
            proc = subprocess.run(
                argv, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S
            )
            assert proc.returncode == 0, f"{block.where} failed:\n{proc.stdout}\n{proc.stderr}"
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)  # the server and what it started
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


def test_the_required_examples_are_runnable():
    """The issue's list: the offline Python example, generate, serve with an openai
    request, report, a small simulate."""
    runnable = [b for p in guide_pages() for b in blocks(p) if b.runnable]
    text = "\n".join(b.code for b in runnable)
    assert any(b.lang == "python" and "LLM(" in b.code for b in runnable)
    assert any(b.tag == "runnable: server" and "sarathi-pp serve" in b.code for b in runnable)
    assert any(b.lang == "python" and "from openai import OpenAI" in b.code for b in runnable)
    for command in ("sarathi-pp generate", "sarathi-pp report", "sarathi-pp simulate"):
        assert command in text, command
