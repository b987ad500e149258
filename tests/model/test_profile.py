"""``sarathi-pp profile`` end to end on the tiny random Llama of ``tests/conftest.py``
(2 layers, hidden 64) with a grid of a few configurations: seconds, not minutes."""

from __future__ import annotations

import csv

import pytest
import torch

from sarathi_pp.cli import main
from sarathi_pp.cli.profile import GridArgs, profile_grid
from sarathi_pp.planner.profile_analysis import (
    EXTRA_COLUMNS,
    PROFILE_COLUMNS,
    analyze_profile,
    load_profile,
)

GRID = ["--prefill-tokens", "0,16,32,64", "--decode-tokens", "0,4", "--context-lens", "32",
        "--tile-rows", "16,20,32,36", "--repeats", "2", "--warmup", "1",
        "--decode-sweep", "1,8", "--decode-contexts", "64"]  # fmt: skip


@pytest.fixture(autouse=True)
def _restore_threads():
    """The profiler sets the process's torch threads, as a stage process does."""
    num_threads = torch.get_num_threads()
    yield
    torch.set_num_threads(num_threads)


def engine_args(model_dir, *extra: str) -> list[str]:
    return ["--model", str(model_dir), "--dtype", "float32", "--set", "model.device=cpu",
            "--set", "model.max_model_len=256", *extra]  # fmt: skip


def expected_points():
    grid = GridArgs((0, 16, 32, 64), (0, 4), (32,), (16, 20, 32, 36), repeats=2, warmup=1,
                    decode_sweep=(1, 8), decode_contexts=(64,))  # fmt: skip
    return profile_grid(grid, max_model_len=256)[0]


def test_profile_writes_the_csv_and_reports(llama_dir, tmp_path, capsys):
    out = tmp_path / "profile.csv"
    assert main(["profile", *engine_args(llama_dir), *GRID, "--output", str(out)]) == 0

    lines = out.read_text().splitlines()
    comments = [line for line in lines if line.startswith("#")]
    assert any("stage 0 of 1" in c for c in comments) and any("machine:" in c for c in comments)
    header = next(csv.reader([lines[len(comments)]]))
    assert header == [*PROFILE_COLUMNS, *EXTRA_COLUMNS]

    rows = load_profile(out)
    assert sorted(r.key for r in rows) == expected_points()
    for r in rows:
        assert r.stage == 0 and r.num_layers == 2 and r.repeats == 2
        assert r.dtype == "float32" and r.device == "cpu" and r.threads >= 1
        assert 0 < r.min_seconds <= r.seconds

    findings = analyze_profile(rows)
    assert findings.prompt_len == 64
    assert sorted(findings.chunk_overhead) == [16, 32]
    assert [pc.prefill_tokens for pc in findings.piggyback] == [16, 32]

    printed = capsys.readouterr().out
    assert "torch's default" in printed  # where the thread count comes from
    assert "chunk    16:" in printed and "vs unchunked 64-token prefill" in printed
    assert "smallest chunk within 20%" in printed and "tile steps:" in printed


@pytest.mark.parametrize("stage", [None, 0])
def test_profile_a_stage_of_a_pipeline(llama_dir, tmp_path, stage):
    # Default: the binding stage, the last (it also runs lm_head); stage 0 takes token ids.
    out = tmp_path / "profile.csv"
    pick = [] if stage is None else ["--stage", str(stage)]
    argv = ["profile", *engine_args(llama_dir, "--pipeline-parallel-size", "2",
            "--set", "parallel.num_threads_per_stage=1"), *GRID, *pick, "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = load_profile(out)
    expected_stage = 1 if stage is None else stage
    assert {(r.stage, r.num_layers, r.threads) for r in rows} == {(expected_stage, 1, 1)}
    assert analyze_profile(rows).stage == expected_stage


def test_run_dir_is_the_default_folder(llama_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["profile", *engine_args(llama_dir), *GRID, "--repeats", "1", "--run-dir", str(run_dir)]
    assert main(argv) == 0
    assert load_profile(run_dir / "profile.csv")
    # Again: refused before any timing unless --overwrite.
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert main([*argv, "--overwrite"]) == 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--stage", "3"], "--stage 3 is not a stage of pipeline_parallel_size=1"),
        (["--prefill-tokens", "0,512"], "512 exceeds max_model_len=256"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--max-overhead", "0"], "--max-overhead must be > 0"),
    ],
)
def test_usage_errors(llama_dir, tmp_path, capsys, extra, message):
    argv = ["profile", *engine_args(llama_dir), *GRID, "--output", str(tmp_path / "p.csv")]
    with pytest.raises(SystemExit) as e:
        main([*argv, *extra])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "p.csv").exists()


def test_bad_token_list_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["profile", "--prefill-tokens", "0,abc"])
    assert e.value.code == 2
    assert "expected comma-separated integers" in capsys.readouterr().err
