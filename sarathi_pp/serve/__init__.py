"""``sarathi-pp serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine
loop. ``engine_loop`` (the one thread that owns the ``LLMEngine``), ``app`` (the routes,
auth, streaming, abort on disconnect), ``protocol`` (request checks, OpenAI's shapes),
``metrics`` (``/metrics``), ``server`` (uvicorn with a graceful stop). The subcommand is in
``cli/serve.py``. It may import the engine, ``llm`` and everything below them (the import
contracts in ``pyproject.toml``), never ``cli`` or ``launch``."""
