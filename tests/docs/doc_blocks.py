"""The fenced code blocks of the documentation's Markdown and their tags.

The convention (docs/getting-started.md says it to readers): the line before a fenced block
(blank lines skipped) is ``<!-- runnable -->`` (the tests run the block as written),
``<!-- runnable: server -->`` (a command that serves until stopped: the tests start it and
run the page's later runnable blocks against it) or ``<!-- not-runnable: WHY -->``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
TAG = re.compile(r"<!-- (runnable|runnable: server|not-runnable: .+) -->$")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str  # "python", "bash", or "" (untagged fence)
    code: str
    tag: str | None  # "runnable", "runnable: server", "not-runnable: ..." or None

    @property
    def runnable(self) -> bool:
        return self.tag is not None and self.tag.startswith("runnable")

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2)
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        code = "\n".join(line[len(indent) :] for line in lines[i + 1 : j])
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        t = TAG.match(lines[k].strip()) if k >= 0 else None
        found.append(Block(path, i + 1, lang, code + "\n", t.group(1) if t else None))
        i = j + 1
    return found


def guide_pages() -> list[Path]:
    """The user's pages whose blocks must be tagged: getting started and the user guide."""
    return [DOCS / "getting-started.md", *sorted((DOCS / "guide").glob("*.md"))]
