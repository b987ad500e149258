"""The room for ``sarathi-pp serve`` (an OpenAI-compatible HTTP server over one engine
loop): FastAPI + uvicorn, streaming, ``/metrics`` and ``/health``. Its subcommand goes in
``cli/serve.py``. It may import the engine, ``llm`` and everything below them (the import
contracts in ``pyproject.toml``), never ``cli`` or ``launch``. Nothing lives here yet."""
