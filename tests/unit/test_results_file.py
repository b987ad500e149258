"""The results file (``benchmarks/results.py``) and its renderer
(``benchmarks/render_results.py``): a run appends one well-formed record; the renderer shows
the newest record per measure, a full run before a quick one, writes the page and the README
block deterministically, and ``--check`` tells when they are stale; every benchmark script
records its runs."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import render_results as rr  # noqa: E402
import results  # noqa: E402

# Shared helpers and the renderer: not benchmarks, so they record nothing.
NOT_BENCHMARKS = {"common.py", "results.py", "render_results.py"}


@pytest.fixture
def results_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Recording on (tests/conftest.py turns it off), into a temp file."""
    path = tmp_path / "results.jsonl"
    monkeypatch.delenv(results.NO_RECORD_ENV, raising=False)
    monkeypatch.setenv(results.FILE_ENV, str(path))
    return path


# --- the writer ------------------------------------------------------------------------------
def test_a_run_appends_one_well_formed_record(results_file: Path):
    run = results.Run("fake", ["--quick", "--out", "a b"], quick=True)
    run.settings["workload"] = "short"
    run.measure("tokens/s", 150.0, "tok/s", baseline=100.0, baseline_label="PP=1",
                better="higher", headline="fake throughput")  # fmt: skip
    run.measure("lost", float("nan"), "ms")
    run.note("a note")
    run.note(None)  # nothing to say: no note
    run.check("outputs identical", True)
    assert run.write() == results_file
    run.write()  # a second run appends a second line
    lines = results_file.read_text().splitlines()
    assert len(lines) == 2
    record = json.loads(lines[0])
    assert record["schema"] == 1 and record["benchmark"] == "fake" and record["quick"] is True
    assert record["command"] == "python benchmarks/fake.py --quick --out 'a b'"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", record["date"])
    assert record["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", record["commit"])
    assert record["dirty"] in (True, False, None)
    machine = record["machine"]
    for key in ("cpu", "logical_cpus", "usable_cores", "gpu", "torch", "torch_threads"):
        assert key in machine, key
    assert isinstance(machine["load_avg_1m_start"], float)
    assert isinstance(machine["load_avg_1m_end"], float)
    tps, lost = record["measures"]
    assert tps == {
        "name": "tokens/s", "value": 150.0, "unit": "tok/s", "baseline": 100.0,
        "baseline_label": "PP=1", "ratio": 1.5, "better": "higher",
        "headline": "fake throughput", "detail": None,
    }  # fmt: skip
    assert lost["value"] is None and lost["ratio"] is None  # NaN is not JSON
    assert record["notes"] == ["a note"]
    assert record["checks"] == [{"what": "outputs identical", "ok": True}]
    assert record["settings"] == {"workload": "short"}


def test_no_record_appends_nothing(results_file: Path, monkeypatch: pytest.MonkeyPatch):
    run = results.Run("fake", [], enabled=False)  # --no-record
    run.measure("x", 1.0, "s")
    assert run.write() is None
    monkeypatch.setenv(results.NO_RECORD_ENV, "1")
    run = results.Run("fake", [])
    run.measure("x", 1.0, "s")
    assert run.write() is None
    assert not results_file.exists()


def test_a_measure_is_named_once():
    run = results.Run("fake", [])
    run.measure("x", 1.0, "s")
    with pytest.raises(ValueError, match="recorded twice"):
        run.measure("x", 2.0, "s")
    with pytest.raises(ValueError, match="higher"):
        run.measure("y", 2.0, "s", better="faster")


# --- every script records --------------------------------------------------------------------
def _calls(tree: ast.AST) -> set[str]:
    """Names of the functions and methods called anywhere in ``tree``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return names


def test_every_benchmark_script_records_its_runs():
    scripts = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if p.name not in NOT_BENCHMARKS)
    assert len(scripts) >= 11
    for script in scripts:
        tree = ast.parse(script.read_text())
        calls = _calls(tree)
        assert {"Run", "add_record_flag", "write"} <= calls, f"{script.name} records no run"
        names = {
            node.args[0].value
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and getattr(node.func, "id", "") == "Run"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        }
        assert names == {script.stem}, f"{script.name}: Run({names}) is not named after it"


# --- the renderer ----------------------------------------------------------------------------
def record(bench: str, date: str, quick: bool = False, **values: float) -> dict:
    """A record as a script writes it, with one measure per keyword (``_`` for spaces)."""
    return {
        "schema": 1, "benchmark": bench, "quick": quick, "date": date, "duration_s": 1.0,
        "command": f"python benchmarks/{bench}.py" + (" --quick" if quick else ""),
        "commit": "0123456789abcdef0123456789abcdef01234567", "dirty": False,
        "machine": {"cpu": "Test CPU", "logical_cpus": 2, "usable_cores": 2, "gpu": None,
                    "load_avg_1m_start": 0.5, "load_avg_1m_end": 1.25},
        "settings": {}, "notes": [f"run of {date}"], "checks": [],
        "measures": [
            {"name": k.replace("_", " "), "value": v, "unit": "x", "baseline": None,
             "baseline_label": None, "ratio": None, "better": "higher",
             "headline": f"{bench} {k}" if k.startswith("head") else None, "detail": None}
            for k, v in values.items()
        ],
    }  # fmt: skip


def write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


RECORDS = [
    record("bubbles", "2026-12-01T10:00:00Z", head=1.0, other=10.0),
    record("bubbles", "2026-12-03T10:00:00Z", head=2.0),  # newer: head 2, other stays 10
    record("bubbles", "2026-12-04T10:00:00Z", quick=True, head=9.0, only_quick=7.0),
    record("pipeline_scaling", "2026-12-02T10:00:00Z", quick=True, head=1.5),
]


def shown(figures: dict) -> dict:
    return {f"{b}/{n}": (f.measure["value"], f.record["quick"]) for (b, n), f in figures.items()}


def test_newest_record_per_measure_full_runs_first():
    assert shown(rr.choose(RECORDS)) == {
        "bubbles/head": (2.0, False),  # the newest full run, not the newer quick one
        "bubbles/other": (10.0, False),  # only the older run measured it
        "bubbles/only quick": (7.0, True),  # no full run: the quick one
        "pipeline_scaling/head": (1.5, True),
    }
    heads = [(f.measure["headline"], f.measure["value"]) for f in rr.headlines(RECORDS)]
    # the README leads with full runs only: pipeline_scaling's one run is quick
    assert heads == [("bubbles head", 2.0)]


def test_page_and_readme_block(tmp_path: Path):
    page = rr.render_page(RECORDS)
    assert page == rr.render_page(list(reversed(RECORDS)))  # no tie: order does not matter
    assert page.index("## pipeline_scaling") < page.index("## bubbles")
    rows = [ln for ln in page.splitlines() if ln.startswith("| ") and "measure" not in ln]
    assert len(rows) == 4
    assert rows[0].startswith("| head | 1.50x *quick* |")  # pipeline_scaling
    assert "`python benchmarks/pipeline_scaling.py --quick`" in rows[0]
    assert "| 2026-12-02 | `0123456` | Test CPU, 2 cores; load 0.50 -> 1.25 |" in rows[0]
    assert any(r.startswith("| head | 2.00x |") for r in rows)
    assert "- run of 2026-12-01T10:00:00Z" in page  # the notes of the runs shown
    block = rr.render_readme_block(RECORDS)
    assert "[bubbles head](docs/benchmarks/results.md#bubbles) | 2.00x |" in block
    assert "pipeline_scaling" not in block and "quick" not in block
    readme = "# x\n\nintro\n<!-- results:begin -->\nold table\n<!-- results:end -->\nrest\n"
    new = rr.replace_block(readme, block)
    assert new == f"# x\n\nintro\n<!-- results:begin -->\n{block}<!-- results:end -->\nrest\n"
    assert rr.replace_block(new, block) == new
    assert rr.replace_block("# x\nno markers\n", block) is None


def test_main_writes_then_check_passes_until_a_new_record(tmp_path: Path, capsys):
    data = write(tmp_path / "results.jsonl", RECORDS)
    page, readme = tmp_path / "docs" / "results.md", tmp_path / "README.md"
    readme.write_text("# x\n<!-- results:begin -->\n<!-- results:end -->\n")
    args = ["--results", str(data), "--page", str(page), "--readme", str(readme)]
    assert rr.main([*args, "--check"]) == 1  # nothing rendered yet
    assert not page.exists()
    assert rr.main(args) == 0
    assert page.exists() and "bubbles head" in readme.read_text()
    assert rr.main([*args, "--check"]) == 0
    with open(data, "a") as f:
        f.write(json.dumps(record("bubbles", "2026-12-05T10:00:00Z", head=3.0)) + "\n")
    before = page.read_text()
    assert rr.main([*args, "--check"]) == 1
    assert page.read_text() == before  # --check writes nothing
    assert "out of date" in capsys.readouterr().out
    assert rr.main(args) == 0 and "3.00x" in readme.read_text()


def test_a_readme_without_markers_is_left_alone(tmp_path: Path, capsys):
    data = write(tmp_path / "results.jsonl", RECORDS)
    readme = tmp_path / "README.md"
    readme.write_text("# x\nno table here\n")
    args = ["--results", str(data), "--page", str(tmp_path / "r.md"), "--readme", str(readme)]
    assert rr.main(args) == 0
    assert readme.read_text() == "# x\nno table here\n"
    assert "has no '<!-- results:begin -->'" in capsys.readouterr().err
    assert rr.main([*args, "--check"]) == 0  # the page is current; the README is not checked


def test_a_broken_line_is_named(tmp_path: Path, capsys):
    data = tmp_path / "results.jsonl"
    data.write_text(json.dumps(RECORDS[0]) + "\n{not json\n")
    assert rr.main(["--results", str(data), "--page", str(tmp_path / "r.md"), "--check"]) == 2
    assert f"{data}:2: not JSON" in capsys.readouterr().err
