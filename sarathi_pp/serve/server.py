"""``run_server``: an engine, its loop and the app under uvicorn until SIGINT or SIGTERM.

A signal stops the server gracefully: no new requests (503), every request in flight
aborted (its stream ends with ``finish_reason="abort"``), then uvicorn closes the
connections and the app's lifespan stops the engine loop (run records written when a run
dir is configured, the engine shut down).
"""

from __future__ import annotations

import logging
from typing import Any

import uvicorn

from sarathi_pp.engine import LLMEngine
from sarathi_pp.serve.app import create_app
from sarathi_pp.serve.engine_loop import EngineLoop

logger = logging.getLogger(__name__)

# Seconds uvicorn waits for open connections after a stop signal before closing them.
GRACEFUL_SHUTDOWN_S = 10


class _Server(uvicorn.Server):
    """uvicorn's server, aborting the in-flight requests on the first stop signal: their
    streams end at once instead of holding the shutdown open."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop) -> None:
        super().__init__(config)
        self.engine_loop = engine_loop

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit:
            self.engine_loop.abort_all()
        super().handle_exit(sig, frame)


def build_server(
    engine: LLMEngine,
    served_model_name: str | list[str],
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    log_level: str = "info",
    chat_template: str | None = None,
    tool_call_parser: str = "hermes",
) -> uvicorn.Server:
    """The server for ``engine`` (an ``LLMEngine``) under ``served_model_name`` (one name
    or several, as vLLM's ``--served-model-name``: each is accepted as a request's
    ``model``, the first is the one responses carry); ``server.run()`` serves until a stop
    signal (or ``server.should_exit = True`` from another thread)."""
    engine_loop = EngineLoop(engine)
    app = create_app(engine_loop, served_model_name, api_key, chat_template, tool_call_parser)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    return _Server(config, engine_loop)
