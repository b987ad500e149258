"""A live ``sarathi-pp serve`` app for the tests: uvicorn on 127.0.0.1 (a free port) in a
background thread over the engine (``create_engine``: one, or data-parallel replicas) of the given model
and config overrides."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sarathi_pp import load_config
from sarathi_pp.engine import create_engine
from sarathi_pp.serve.server import build_server

MODEL = "tiny"
# A minimal chat template (the tiny models' byte tokenizer has none).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def with_chat_template(model_dir: Path, dest: Path) -> Path:
    """A copy of ``model_dir`` at ``dest`` whose tokenizer config carries ``CHAT_TEMPLATE``."""
    shutil.copytree(model_dir, dest)
    config_path = dest / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return dest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(
    model_dir: Path,
    api_key: str | None = None,
    names: str | list[str] = MODEL,
    chat_template: str | None = None,
    **overrides: Any,
) -> Iterator:
    engine = create_engine(load_config(None, model=str(model_dir), **overrides))
    server = build_server(
        engine, names, "127.0.0.1", free_port(), api_key, "warning", chat_template
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    server.base_url = f"http://127.0.0.1:{port}"
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive()
