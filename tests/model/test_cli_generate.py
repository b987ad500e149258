"""``sarathi-pp generate`` end to end on the tiny random Llama of ``tests/conftest.py``
(byte tokenizer, ``llama_dir``)."""

from __future__ import annotations

import json
import re
import time

import pytest

from sarathi_pp import LLM, SamplingParams
from sarathi_pp.cli import build_parser, main
from sarathi_pp.cli.common import config_from_args


def engine_args(model_dir) -> list[str]:
    return ["--model", str(model_dir), "--set", "model.max_model_len=128", "--dtype", "float32"]


PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog", "a"]


def test_jsonl_matches_llm(llama_dir, tmp_path):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text(f"\n{PROMPTS[1]}\n\n{PROMPTS[2]}\n")
    out = tmp_path / "out.jsonl"
    argv = [
        "generate", *engine_args(llama_dir), "--prompt", PROMPTS[0],
        "--prompts-file", str(prompts_file), "--max-tokens", "6", "--ignore-eos",
        "--output", str(out),
    ]  # fmt: skip
    assert main(argv) == 0

    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2]
    assert [r["prompt"] for r in records] == PROMPTS
    keys = {"index", "prompt", "prompt_token_ids", "token_ids", "text", "finish_reason", "error", "ttft_s"}  # fmt: skip
    for r in records:
        assert set(r) == keys
        assert len(r["token_ids"]) == 6
        assert r["finish_reason"] == "length" and r["error"] is None
        assert isinstance(r["ttft_s"], float) and r["ttft_s"] >= 0

    # The oracle: the Python API, greedy, on the same config.
    llm = LLM(config=config_from_args(build_parser().parse_args(argv)))
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    for r, e in zip(records, expected, strict=True):
        assert r["prompt_token_ids"] == e.prompt_token_ids
        assert r["token_ids"] == e.outputs[0].token_ids
        assert r["text"] == e.outputs[0].text


def test_set_chunk_size_takes_effect(llama_dir, tmp_path, monkeypatch):
    import sarathi_pp.llm

    seen = []

    class SpyLLM(sarathi_pp.llm.LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append(self)

    monkeypatch.setattr(sarathi_pp.llm, "LLM", SpyLLM)
    runs = {}
    for chunk_size in (7, 256):
        out = tmp_path / f"chunk{chunk_size}.jsonl"
        argv = [
            "generate", *engine_args(llama_dir), "--set", f"scheduler.chunk_size={chunk_size}",
            "--prompt", PROMPTS[1], "--max-tokens", "4", "--ignore-eos", "--output", str(out),
        ]  # fmt: skip
        assert main(argv) == 0
        assert seen[-1].config.scheduler.chunk_size == chunk_size
        runs[chunk_size] = json.loads(out.read_text())["token_ids"]
    # A 44-token prompt in chunks of 7 gives the same greedy tokens as in one chunk.
    assert runs[7] == runs[256]


def test_readable_stdout_and_summary(llama_dir, capsys):
    argv = [
        "generate",
        *engine_args(llama_dir),
        "--prompt",
        "Hi",
        "--max-tokens",
        "3",
        "--ignore-eos",
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0] == "[0] prompt: 'Hi'"
    assert lines[1].startswith("    output: ")
    assert lines[2] == "    finish: length, 3 tokens"
    assert "sarathi-pp: 1 request, 3 generated tokens in" in captured.err
    assert "tokens/s" in captured.err


def test_summary_times_the_generation_not_the_report(llama_dir, tmp_path, monkeypatch, capsys):
    """With ``--run-dir`` the report (timeline, trace) is written after the last request
    finished; the tokens/s line must not count it (it did: 4-5x low on short runs)."""
    from sarathi_pp.engine.llm_engine import LLMEngine

    generate, write = LLM.generate, LLMEngine.write_run_records
    seen: dict[str, float] = {}

    def timed_generate(self, *args, **kwargs):
        seen["generate"] = time.perf_counter()
        return generate(self, *args, **kwargs)

    def slow_write(self):  # after every request finished; slow, as a big report is
        seen.setdefault("write", time.perf_counter())
        time.sleep(0.5)
        return write(self)

    monkeypatch.setattr(LLM, "generate", timed_generate)
    monkeypatch.setattr(LLMEngine, "write_run_records", slow_write)
    argv = [
        "generate", *engine_args(llama_dir), "--prompt", "Hi", "--max-tokens", "3",
        "--ignore-eos", "--run-dir", str(tmp_path / "run"),
    ]  # fmt: skip
    assert main(argv) == 0
    err = capsys.readouterr().err
    wall_s = float(re.search(r"generated tokens in ([0-9.]+) s", err).group(1))
    assert wall_s <= seen["write"] - seen["generate"] + 0.01, (err, seen)  # 0.01: rounding
    assert (tmp_path / "run" / "summary.json").is_file()  # the report was written all the same


def test_num_completions_and_logprobs(llama_dir, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    argv = [
        "generate", *engine_args(llama_dir), "--prompt", PROMPTS[0], "--prompt", PROMPTS[2],
        "--max-tokens", "4", "--ignore-eos", "--temperature", "1.0", "--seed", "9",
        "--num-completions", "3", "--logprobs", "2", "--prompt-logprobs", "1",
    ]  # fmt: skip
    assert main([*argv, "--output", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    llm = LLM(config=config_from_args(build_parser().parse_args(argv)))
    params = SamplingParams(
        temperature=1.0, max_tokens=4, ignore_eos=True, n=3, logprobs=2, prompt_logprobs=1
    )
    expected = llm.generate([PROMPTS[0], PROMPTS[2]], params, use_tqdm=False)
    for r, e in zip(records, expected, strict=True):
        assert r["prompt_logprobs"][0] is None
        assert [[p["token_id"] for p in pos] for pos in r["prompt_logprobs"][1:]] == [
            list(entry) for entry in e.prompt_logprobs[1:]
        ]
        assert [pos[0]["logprob"] for pos in r["prompt_logprobs"][1:]] == [
            entry[t].logprob for t, entry in zip(e.prompt_token_ids[1:], e.prompt_logprobs[1:])
        ]
        assert [c["index"] for c in r["completions"]] == [0, 1, 2]
        assert [c["token_ids"] for c in r["completions"]] == [c.token_ids for c in e.outputs]
        assert r["token_ids"] == r["completions"][0]["token_ids"]  # the first's, at the top
        for c, ce in zip(r["completions"], e.outputs):
            assert [[p["token_id"] for p in pos] for pos in c["logprobs"]] == [
                list(entry) for entry in ce.logprobs
            ]
            assert [pos[0]["logprob"] for pos in c["logprobs"]] == [
                entry[t].logprob for t, entry in zip(ce.token_ids, ce.logprobs)
            ]
            assert c["cumulative_logprob"] == ce.cumulative_logprob
    assert len({tuple(c["token_ids"]) for c in records[0]["completions"]}) > 1
    assert main(argv) == 0  # readable: each completion
    captured = capsys.readouterr()
    assert captured.out.count("    output 2: ") == 2 and "cumulative logprob" in captured.out
    assert captured.out.count("    logprobs: ") == 6
    assert captured.out.count("    prompt logprobs: ") == 2
    assert "2 requests, 24 generated tokens" in captured.err


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--num-completions", "0"], "--num-completions: n must be an integer >= 1, got 0"),
        (
            ["--logprobs", "21"],
            "--logprobs: logprobs must be None or an integer in [0, 20], got 21",
        ),
        (
            ["--prompt-logprobs", "-1"],
            "--prompt-logprobs: prompt_logprobs must be None or an integer in [0, 20], got -1",
        ),
        (["--repetition-penalty", "0"], "--repetition-penalty: repetition_penalty must be > 0"),
        (["--min-p", "2"], "--min-p: min_p must be in [0, 1], got 2.0"),
        (["--min-tokens", "20"], "--min-tokens: min_tokens must be in [0, max_tokens=16], got 20"),
        (["--bad-word", " "], "--bad-word: bad_words must be non-blank strings, got ' '"),
        (
            ["--truncate-prompt-tokens", "0"],
            "--truncate-prompt-tokens: truncate_prompt_tokens must be None, -1",
        ),
        (
            ["--structured-outputs", '{"regex": "(ab"}'],
            "--structured-outputs: prompt 0: structured_outputs.regex '(ab' cannot be compiled",
        ),
        (["--structured-outputs", "[1]"], "--structured-outputs: must be a JSON object"),
    ],
)
def test_bad_sampling_flags_are_usage_errors(llama_dir, capsys, flags, says):
    with pytest.raises(SystemExit) as info:
        main(["generate", *engine_args(llama_dir), "--prompt", "hi", *flags])
    assert info.value.code == 2
    assert says in capsys.readouterr().err


def test_missing_model_dir(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    with pytest.raises(SystemExit) as info:
        main(["generate", "--model", str(missing), "--prompt", "hi"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("sarathi-pp: error: ") and str(missing) in err
    assert "Traceback" not in err


def test_bad_words_and_truncation_flags(llama_dir, tmp_path):
    out = tmp_path / "out.jsonl"
    argv = [
        "generate", *engine_args(llama_dir), "--prompt", "x" * 200, "--max-tokens", "6",
        "--ignore-eos", "--bad-word", "ab", "--truncate-prompt-tokens", "50",
    ]  # fmt: skip
    assert main([*argv, "--output", str(out)]) == 0  # 201 tokens: too long without the cut
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    llm = LLM(config=config_from_args(build_parser().parse_args(argv)))
    params = SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, bad_words=["ab"], truncate_prompt_tokens=50
    )
    (expected,) = llm.generate(["x" * 200], params, use_tqdm=False)
    assert record["token_ids"] == expected.outputs[0].token_ids
    assert len(expected.prompt_token_ids) == 50
    assert expected.prompt_token_ids == llm.engine.tokenize("x" * 200)[-50:]


def test_prompt_too_long_is_a_usage_error(llama_dir, capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", *engine_args(llama_dir), "--prompt", "ok", "--prompt", "x" * 200])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "prompt 1 has 201 tokens, more than max_model_len=128" in err


def test_run_dir_and_overwrite(llama_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["generate", *engine_args(llama_dir), "--prompt", "Hi", "--max-tokens", "2"]
    assert main([*argv, "--run-dir", str(run_dir)]) == 0
    assert (run_dir / "config.yaml").is_file()
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main([*argv, "--run-dir", str(run_dir)])
    assert info.value.code == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main([*argv, "--run-dir", str(run_dir), "--overwrite"]) == 0
