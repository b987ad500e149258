"""``sarathi-pp serve``: an OpenAI-compatible HTTP server over one engine loop
(``sarathi_pp.serve``): ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/health``, ``/metrics``."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from sarathi_pp.cli.common import PROG, add_engine_args, config_from_args, user_errors

API_KEY_ENV = "SARATHI_PP_API_KEY"


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve the model over OpenAI's HTTP API",
        description="An OpenAI-compatible HTTP server (completions, chat completions, "
        "streaming) over one engine loop; /health and /metrics (Prometheus) beside it.",
    )
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1 (this machine only)")
    g.add_argument("--port", type=int, default=8000, help="default: 8000")
    g.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model name clients send and /v1/models lists (default: the --model value)",
    )
    g.add_argument(
        "--api-key",
        metavar="KEY",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV})",
    )
    g.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's log level (default: info)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM (a graceful stop: exit 0)."""
    from sarathi_pp.engine import LLMEngine
    from sarathi_pp.serve.server import build_server

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    with user_errors():
        if not 0 < args.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {args.port}")
        config = config_from_args(args)
        engine = LLMEngine(config)
    name = args.served_model_name or args.model or config.model.path
    server = build_server(engine, name, args.host, args.port, api_key, args.log_level)
    try:
        server.run()  # its lifespan stops the engine loop and shuts the engine down
    except (KeyboardInterrupt, SystemExit):
        # After a graceful stop uvicorn raises the stop signal again for the handler it
        # replaced (Python's, or Ray's, which exits); before the start, uvicorn exits when
        # it cannot listen (e.g. the port is taken), having logged why.
        if not server.started:
            print(f"{PROG}: error: could not serve on {args.host}:{args.port}", file=sys.stderr)
            return 1
    print(f"{PROG}: stopped", file=sys.stderr)
    return 0
