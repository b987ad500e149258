"""``sarathi-pp serve [MODEL]``: an OpenAI-compatible HTTP server over one engine loop
(``sarathi_pp.serve``), with vLLM's flag names (``vllm serve MODEL`` habits):
``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/tokenize``,
``/detokenize`` (those under ``--api-key``), ``/health``, ``/version``, ``/metrics``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from sarathi_pp.cli.common import PROG, add_engine_args, config_from_args, user_errors

API_KEY_ENV = "SARATHI_PP_API_KEY"


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve the model over OpenAI's HTTP API",
        description="An OpenAI-compatible HTTP server (completions, chat completions, "
        "streaming) over one engine loop, with vLLM's flag names. Routes: /v1/completions, "
        "/v1/chat/completions, /v1/models, /tokenize, /detokenize (these need the API key "
        "when one is set), /health, /version, /metrics (Prometheus, sarathi_pp_* and "
        "vllm:* names; these never need it).",
    )
    p.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="the model, as vLLM's 'serve MODEL' (the same as --model; both: they must agree)",
    )
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1 (this machine only)")
    g.add_argument("--port", type=int, default=8000, help="default: 8000")
    g.add_argument(
        "--served-model-name",
        metavar="NAME",
        nargs="+",
        help="the model names clients may send (each listed by /v1/models; responses carry "
        "the first; default: the MODEL value)",
    )
    g.add_argument(
        "--api-key",
        metavar="KEY",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize "
        f"(not /health, /version, /metrics; default: ${API_KEY_ENV})",
    )
    g.add_argument(
        "--chat-template",
        metavar="FILE|TEMPLATE",
        help="a Jinja chat template (a file, or the template itself) instead of the "
        "tokenizer's; a request's chat_template wins",
    )
    g.add_argument(
        "--tool-call-parser",
        metavar="NAME",
        default="hermes",
        help="how a chat reply's tool calls are read under tool_choice 'auto' "
        "(vLLM's flag; default: hermes)",
    )
    g.add_argument(
        "--uvicorn-log-level",
        "--log-level",
        dest="log_level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="uvicorn's log level (default: info)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM (a graceful stop: exit 0)."""
    from sarathi_pp.engine import create_engine
    from sarathi_pp.serve.server import build_server

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    with user_errors():
        if args.model_tag is not None:
            if args.model is not None and args.model != args.model_tag:
                raise ValueError(
                    f"the model is given twice: {args.model_tag!r} (MODEL) and "
                    f"{args.model!r} (--model); give one"
                )
            args.model = args.model_tag
        if not 0 < args.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {args.port}")
        chat_template = read_chat_template(args.chat_template)
        from sarathi_pp.serve.tools import tool_parser

        tool_parser(args.tool_call_parser)  # an unknown name: an error listing the valid ones
        config = config_from_args(args)
        engine = create_engine(config)
    names = args.served_model_name or [args.model or config.model.path]
    server = build_server(
        engine, names, args.host, args.port, api_key, args.log_level, chat_template,
        args.tool_call_parser,
    )  # fmt: skip
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


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the template itself (vLLM's rule: a value
    with Jinja markup is a template; anything else must be a file)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if any(mark in value for mark in ("{{", "{%")):
        return value
    raise FileNotFoundError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
