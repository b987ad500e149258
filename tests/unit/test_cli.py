"""The ``sarathi-pp`` command line without a model: parsing, config, prompts, errors."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from sarathi_pp.cli import build_parser, main
from sarathi_pp.cli.common import config_from_args, parse_set_items
from sarathi_pp.cli.generate import (
    collect_prompts,
    sampling_params_from_args,
    should_show_progress,
    summary_line,
)
from sarathi_pp.config import EngineConfig


def parse(*argv: str):
    return build_parser().parse_args(["generate", *argv])


def exit_error(argv: list[str], capsys) -> str:
    """Run ``main`` expecting a usage error; the message it printed."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


# --- parser and defaults --------------------------------------------------------------------
def test_subcommand_required(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


@pytest.mark.parametrize("command", ["bench", "simulate"])
def test_run_dir_is_required_where_it_holds_one_run_dir_per_run(command, capsys):
    """``bench`` and ``simulate`` write DIR/<scheduler>/: the usage says so up front."""
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([command, "--workload", "w.yaml"])
    assert info.value.code == 2
    assert "required: --run-dir" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    usage = capsys.readouterr().out
    assert "[--run-dir" not in usage  # not shown as optional
    assert "required: DIR/<scheduler>/" in " ".join(usage.split())
    assert build_parser().parse_args(["generate", "--prompt", "x"]).run_dir is None  # optional


def test_generate_defaults():
    args = parse("--prompt", "hi")
    sp = sampling_params_from_args(args)
    assert sp.max_tokens == 16
    assert sp.is_greedy
    assert (sp.top_p, sp.top_k, sp.seed, sp.ignore_eos, sp.stop) == (1.0, 0, None, False, ())
    assert config_from_args(args) == EngineConfig()  # the builtin model, default sections


def test_sampling_flags():
    args = parse(
        "--prompt", "hi", "--max-tokens", "5", "--temperature", "0.7", "--top-p", "0.9",
        "--top-k", "3", "--seed", "11", "--ignore-eos", "--stop", "a", "--stop", "bc",
    )  # fmt: skip
    sp = sampling_params_from_args(args)
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k) == (5, 0.7, 0.9, 3)
    assert sp.ignore_eos and sp.stop == ("a", "bc")
    # --seed is the engine-wide default (vLLM's), each request's own seed derived from it
    assert sp.seed is None and config_from_args(args).model.seed == 11


# --- config ---------------------------------------------------------------------------------
def test_flags_and_set_reach_the_config(tmp_path):
    args = parse(
        "--model", str(tmp_path), "--scheduler", "vllm", "--chunk-size", "64",
        "--pipeline-parallel-size", "2", "--dtype", "float32", "--run-dir", "runs/x",
        "--overwrite", "--set", "model.max_model_len=128", "--set", "scheduler.tile_align=false",
        "--set", "block_size=8",
    )  # fmt: skip
    c = config_from_args(args)
    assert c.model.path == str(tmp_path) and c.model.dtype == "float32"
    assert (c.scheduler.policy, c.scheduler.chunk_size, c.scheduler.tile_align) == (
        "vllm",
        64,
        False,
    )
    assert c.parallel.pipeline_parallel_size == 2
    assert (c.run.run_dir, c.run.overwrite) == ("runs/x", True)
    assert c.model.max_model_len == 128 and c.cache.block_size == 8


@pytest.mark.parametrize("sub", ["generate", "bench", "serve"])
def test_data_parallel_size_flag_on_every_model_running_subcommand(sub):
    for flag in ("--data-parallel-size", "-dp"):
        extra = ["--prompt", "x"] if sub == "generate" else []
        extra += ["--run-dir", "runs/b", "--workload", "w.yaml"] if sub == "bench" else []
        args = build_parser().parse_args([sub, flag, "2", *extra])
        assert config_from_args(args).parallel.data_parallel_size == 2
        assert config_from_args(args).parallel.executor_name == "ray"


def test_config_file_then_flags(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("scheduler:\n  chunk_size: 32\n  max_num_seqs: 4\nmodel:\n  dtype: float32\n")
    c = config_from_args(parse("--config", str(path), "--set", "scheduler.chunk_size=7"))
    assert (c.scheduler.chunk_size, c.scheduler.max_num_seqs, c.model.dtype) == (7, 4, "float32")
    assert c.model.path == "builtin:tiny-llama"


def test_set_values_are_yaml():
    assert parse_set_items(["a.b=7", "a.c=true", "a.d=null", "a.e=x=y", "a.b=8", "a.f="]) == {
        "a.b": 8,  # last wins
        "a.c": True,
        "a.d": None,
        "a.e": "x=y",
        "a.f": "",
    }


@pytest.mark.parametrize("item", ["scheduler.chunk_size", "=3"])
def test_set_without_key_value(item, capsys):
    err = exit_error(["generate", "--prompt", "hi", "--set", item], capsys)
    assert "--set expects SECTION.KEY=VALUE" in err


def test_unknown_set_key(capsys):
    err = exit_error(["generate", "--prompt", "hi", "--set", "scheduler.chunk=7"], capsys)
    assert err.startswith("sarathi-pp: error: unknown config key 'scheduler.chunk'")
    assert "scheduler.chunk_size" in err  # the message lists the allowed keys


def test_bad_chunk_size(capsys):
    err = exit_error(["generate", "--prompt", "hi", "--chunk-size", "0"], capsys)
    assert err == "sarathi-pp: error: chunk_size must be an integer >= 1 or 'auto', got 0\n"


def test_flag_and_set_conflict(capsys):
    argv = ["generate", "--prompt", "hi", "--chunk-size", "8", "--set", "scheduler.chunk_size=9"]
    err = exit_error(argv, capsys)
    assert "scheduler.chunk_size is given twice" in err
    # The same value twice is no conflict.
    same = parse("--chunk-size", "8", "--set", "chunk_size=8")
    assert config_from_args(same).scheduler.chunk_size == 8


def test_missing_config_file(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    err = exit_error(["generate", "--prompt", "hi", "--config", str(missing)], capsys)
    assert str(missing) in err


def test_bad_sampling_value(capsys):
    err = exit_error(["generate", "--prompt", "hi", "--top-p", "0"], capsys)
    assert "top_p must be in (0, 1]" in err


# --- prompts --------------------------------------------------------------------------------
def test_prompt_order_and_blank_lines(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("third\n\n   \nfourth  \r\n\nfifth")
    args = parse("--prompt", "first", "--prompts-file", str(f), "--prompt", "second")
    assert collect_prompts(args) == ["first", "second", "third", "fourth  ", "fifth"]


def test_prompts_from_stdin():
    args = parse("--prompts-file", "-")
    assert collect_prompts(args, stdin=io.StringIO("a\n\nb\n")) == ["a", "b"]


def test_no_prompts(tmp_path, capsys):
    err = exit_error(["generate"], capsys)
    assert err == "sarathi-pp: error: no prompts: give --prompt TEXT or --prompts-file FILE\n"
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    err = exit_error(["generate", "--prompts-file", str(empty)], capsys)
    assert "no prompts" in err


def test_empty_prompt(capsys):
    err = exit_error(["generate", "--prompt", ""], capsys)
    assert "prompt 0 is empty" in err


def test_missing_prompts_file(tmp_path, capsys):
    missing = tmp_path / "nope.txt"
    err = exit_error(["generate", "--prompts-file", str(missing)], capsys)
    assert str(missing) in err


def test_missing_output_folder(tmp_path, capsys):
    out = tmp_path / "no" / "out.jsonl"
    err = exit_error(["generate", "--prompt", "hi", "--output", str(out)], capsys)
    assert str(tmp_path / "no") in err


# --- progress and summary -------------------------------------------------------------------
class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def test_progress_choice():
    assert should_show_progress(None, 2, _Stream(tty=True))
    assert not should_show_progress(None, 2, _Stream(tty=False))
    assert should_show_progress(None, 1000, _Stream(tty=False))
    assert not should_show_progress(False, 1000, _Stream(tty=True))
    assert should_show_progress(True, 2, _Stream(tty=False))


def test_summary_line():
    records = [{"token_ids": [1, 2, 3], "error": None}, {"token_ids": [4], "error": "boom"}]
    assert summary_line(records, 2.0) == (
        "sarathi-pp: 2 requests, 1 failed, 4 generated tokens in 2.00 s (2.0 tokens/s)"
    )


@pytest.mark.parametrize("module", ["sarathi_pp", "sarathi_pp.launch"])
def test_python_dash_m(module):
    proc = subprocess.run(
        [sys.executable, "-m", module, "generate"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert (
        proc.stderr == "sarathi-pp: error: no prompts: give --prompt TEXT or --prompts-file FILE\n"
    )


def test_a_run_that_is_stopping_holds_further_signals():
    """``hold_signals`` (what ``generate`` does once it is stopping): a SIGTERM or Ctrl-C is
    recorded, not raised, so the run's last line and records are written whole (torchrun
    terminates the other ranks when one rank fails; that used to cut rank 0's error line
    short)."""
    import signal

    from sarathi_pp.cli import common

    saved = list(common._received)
    try:
        common.hold_signals()
        signal.raise_signal(signal.SIGTERM)  # would raise KeyboardInterrupt via the CLI's handler
        assert common.received_signal() == signal.SIGTERM
        signal.raise_signal(signal.SIGINT)
        assert common.received_signal() == signal.SIGINT
    finally:
        common._received[:] = saved


def test_ray_job_help_names_its_own_command(capsys):
    from sarathi_pp.launch.ray_job import main

    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: python -m sarathi_pp.launch.ray_job")
    assert "sarathi-pp generate [" not in text and "--max-tokens" in text
    assert "parallel.executor=ray" in text


def test_ray_job_refuses_relative_outputs_in_ray_s_copy_of_the_working_dir(tmp_path):
    from pathlib import Path

    from sarathi_pp.launch.ray_job import check_written_paths

    copy = Path("/tmp/ray/session_1/runtime_resources/working_dir_files/_ray_pkg_abc")
    with pytest.raises(ValueError, match=r"--output 'o.jsonl' is relative.*--output -"):
        check_written_paths(["--prompt", "hi", "--output", "o.jsonl"], copy)
    with pytest.raises(ValueError, match=r"--run-dir 'runs/a' is relative"):
        check_written_paths(["--prompt", "hi", "--run-dir", "runs/a"], copy)
    check_written_paths(["--output", "-", "--run-dir", str(tmp_path / "r")], copy)  # fine
    check_written_paths(["--output", "o.jsonl", "--run-dir", "r"], tmp_path)  # not a Ray job
