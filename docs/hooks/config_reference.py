"""MkDocs hook: the configuration reference, generated from ``sarathi_pp/config.py`` at
every build (``reference/configuration.md``), so it cannot drift from the dataclasses.

Each section of ``EngineConfig`` is one table: the YAML key, the ``LLM(...)`` keyword that
sets it (``FLAT_KEYS``), the type, the default and the field's docstring. ``python
docs/hooks/config_reference.py`` prints the page.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's sarathi_pp, whatever is installed

PAGE = "reference/configuration.md"

INTRO = """# Configuration reference

Generated from the config dataclasses in `sarathi_pp/config.py` at every build of this site:
every key, its type, its default and its docstring. A YAML config is nested by section
(`scheduler: {policy: sarathi, chunk_size: 256}`); `LLM(...)` takes the flat keyword of the
second column (or `section.key`); the command line takes `--set section.key=value` for any
key. Unknown keys are refused with the list of allowed ones; a bad value raises `ValueError`
naming it. How the pieces fit (KV cache sizing, `chunk_size: auto`) is in the
[configuration guide](../guide/configuration.md).
"""


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass: the string literal right after each field."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 30:
        return f"`{value}` ({value / (1 << 30):g} GiB)"
    if value is None:
        return "`None`"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    return f"`{value}`"


def _cell(text: str) -> str:
    """One table cell: reST's double backquotes as Markdown code, one line, pipes escaped."""
    return " ".join(text.replace("``", "`").split()).replace("|", "\\|")


def _type(annotation: str) -> str:
    """A type as code; a union's ``|`` as an HTML entity (a table cell would split on it,
    and an escaped one shows its backslash inside code)."""
    return "<code>" + annotation.replace("|", "&#124;") + "</code>"


def sections() -> list[tuple[str, type]]:
    import typing

    from sarathi_pp.config import EngineConfig

    hints = typing.get_type_hints(EngineConfig)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(EngineConfig)]


def keys() -> list[str]:
    """Every ``section.key`` of the configuration (what the tests compare with the page)."""
    return [f"{name}.{f.name}" for name, cls in sections() for f in dataclasses.fields(cls)]


def render() -> str:
    from sarathi_pp.config import FLAT_KEYS

    keyword = {target: flat for flat, target in FLAT_KEYS.items()}
    out = [INTRO]
    for name, cls in sections():
        docs = field_docs(cls)
        out += [f"## `{name}`", ""]
        class_doc = inspect.getdoc(cls)
        if class_doc and not class_doc.startswith(cls.__name__ + "("):
            out += [_cell(class_doc), ""]
        out += ["| key | `LLM(...)` keyword | type | default | meaning |", "|---|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            kw = keyword.get((name, f.name))
            out.append(
                f"| `{name}.{f.name}` | {f'`{kw}`' if kw else '-'} | {_type(str(f.type))} "
                f"| {_default(f)} | {_cell(docs.get(f.name, ''))} |"
            )
        out.append("")
    return "\n".join(out)


def on_files(files, config):  # noqa: ANN001, ANN201 (MkDocs' hook signature)
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    return files


if __name__ == "__main__":
    print(render())
