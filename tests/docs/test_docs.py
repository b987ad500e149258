"""The documentation: the README's size and stamps, the built site (navigation, search
index, the timeline picture), the generated configuration reference against the config
dataclasses, every guide code block tagged, and no code citing the dated lab notebook.

The site is built once (``mkdocs build --strict``, a few seconds); the test skips only where
mkdocs is not installed (``make venv`` installs the ``docs`` extra, so CI builds it).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from doc_blocks import DOCS, ROOT, blocks, guide_pages

README = ROOT / "README.md"
TIMELINE = "assets/demo-timeline.png"


def test_readme_is_short_and_undated():
    """At most 250 lines; no run stamps (UTC, a time of day) anywhere, and no dates outside
    the results table (rendered from the results file, each row dated by its record)."""
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    begin, end = text.index("<!-- results:begin -->"), text.index("<!-- results:end -->")
    outside = text[:begin] + text[end:]
    for pattern, what, where in [
        (r"\bUTC\b", "a UTC stamp", text),
        (r"\b\d{1,2}:\d{2}(?::\d{2})?\b", "a time of day", text),
        (r"\b20\d\d-\d\d-\d\d\b", "a dated run", outside),
    ]:
        hits = [line for line in where.splitlines() if re.search(pattern, line)]
        assert not hits, f"README.md has {what}: {hits}"


def test_readme_results_markers():
    lines = README.read_text().splitlines()
    assert lines.count("<!-- results:begin -->") == 1
    assert lines.count("<!-- results:end -->") == 1
    assert lines.index("<!-- results:begin -->") < lines.index("<!-- results:end -->")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]'; make venv does)")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def _nav_pages(nav: object) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in _nav_pages(item)]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in _nav_pages(value)]
    return []


def test_nav_lists_every_page(site: Path):
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    nav = _nav_pages(config["nav"])
    pages = [str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")]
    missing = sorted(set(pages) - set(nav))
    assert not missing, f"pages not in mkdocs.yml's nav: {missing}"
    assert "reference/configuration.md" in nav  # generated at build time
    home = (site / "index.html").read_text()
    for page in guide_pages():
        href = str(page.relative_to(DOCS)).removesuffix(".md") + "/"
        assert f'href="{href}"' in home, f"the built navigation lacks {href}"


def test_search_index_and_timeline(site: Path):
    assert (site / "search" / "search_index.json").stat().st_size > 1000
    assert (site / TIMELINE).stat().st_size > 10_000
    assert TIMELINE in (site / "index.html").read_text()
    assert (ROOT / "docs" / TIMELINE).is_file()
    assert "docs/" + TIMELINE in README.read_text()


def _config_keys() -> list[str]:
    from sarathi_pp.config import EngineConfig

    hints = typing.get_type_hints(EngineConfig)
    return [
        f"{section.name}.{f.name}"
        for section in dataclasses.fields(EngineConfig)
        for f in dataclasses.fields(hints[section.name])
    ]


def test_every_config_key_in_the_reference(site: Path):
    page = (site / "reference" / "configuration" / "index.html").read_text()
    keys = _config_keys()
    assert len(keys) > 30
    missing = [k for k in keys if f"<code>{k}</code>" not in page]
    assert not missing, f"keys missing from the configuration reference: {missing}"


def test_every_guide_block_is_tagged():
    untagged = [b.where for page in guide_pages() for b in blocks(page) if b.tag is None]
    assert not untagged, (
        f"code blocks without <!-- runnable --> / <!-- not-runnable: ... -->: {untagged}"
    )


def test_readme_examples_are_the_docs_runnable_ones():
    """The README's examples are run through their copies in the guide (verbatim)."""
    runnable = {b.code for page in guide_pages() for b in blocks(page) if b.runnable}
    readme = [b for b in blocks(README) if b.runnable]
    assert len(readme) >= 3
    for b in readme:
        assert b.code in runnable, f"{b.where} is not a runnable block of the guide, verbatim"


CODE_DIRS = ("sarathi_pp", "benchmarks", "tests", "configs")
NOTEBOOK = "control-plane" + ".md"  # split, so this file does not cite it either
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def _dated_titles() -> list[str]:
    """The lab notebook's headings, without their dates: what a comment would cite."""
    titles = []
    # the dated records (code-notes.md's headings are Note names: stable, citable)
    for md in (DOCS / "lab" / NOTEBOOK, DOCS / "lab" / "readme-measurements.md"):
        for line in md.read_text().splitlines():
            if line.startswith("#"):
                title = line.lstrip("#").strip()
                title = re.sub(r"\s*\((?:[^()]*\b20\d\d-\d\d-\d\d\b[^()]*)\)\s*$", "", title)
                if len(title) >= 20:
                    titles.append(title)
    return titles


def test_no_code_cites_the_notebook_or_a_dated_heading():
    titles = _dated_titles()
    assert titles
    offenders = []
    for d in CODE_DIRS:
        for path in (ROOT / d).rglob("*"):
            if not path.is_file() or path.suffix not in {
                ".py",
                ".sh",
                ".yaml",
                ".yml",
                ".c",
                ".h",
                ".txt",
                ".json",
            }:
                continue
            text = path.read_text(errors="replace")
            if NOTEBOOK in text:
                offenders.append(f"{path.relative_to(ROOT)} cites {NOTEBOOK}")
            offenders += [f"{path.relative_to(ROOT)} cites '{t}'" for t in titles if t in text]
    assert not offenders, offenders
