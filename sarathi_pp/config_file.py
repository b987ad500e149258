"""The config at the edge: a YAML file (``--config``, ``LLM.from_config``) and ``--set``'s
values read as YAML into the typed ``EngineConfig`` (``config.py``, which reads no file).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from sarathi_pp.config import EngineConfig, _apply, _build


def load_config(path: str | Path | None = None, **overrides: Any) -> EngineConfig:
    """Read a YAML config; keyword overrides (flat or ``section.key``) win."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file {str(p)!r} does not exist")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"config file {str(p)!r} is not valid YAML: {e}") from e
        if not isinstance(tree, dict):
            raise ValueError(f"config file {str(p)!r} must hold a mapping of sections")
        _build(tree)  # reject unknown keys of the file itself, naming them
    return _apply(tree, overrides)


def parse_set_value(text: str) -> Any:
    """Parse the value of ``--set section.key=value`` as YAML (ints, bools, null, strings)."""
    return yaml.safe_load(text) if text != "" else ""
