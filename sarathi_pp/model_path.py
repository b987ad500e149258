"""Resolve a ``model`` setting to a local folder: a path, or ``builtin:NAME``."""

from __future__ import annotations

from pathlib import Path

BUILTIN_PREFIX = "builtin:"


def resolve_model_path(path: str) -> str:
    if path.startswith(BUILTIN_PREFIX):
        from sarathi_pp.stages.builtin import resolve_builtin  # builds with torch: lazy

        return resolve_builtin(path[len(BUILTIN_PREFIX) :])
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"model directory {path!r} does not exist")
    return str(p)
