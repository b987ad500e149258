"""``sarathi-pp plan`` against what the engine really allocates: the spec-based per-stage
figures equal the loaded stages' (``LLMEngine.stage_memory``, real parameter bytes), the
B it prints is the number of full-length sequences the engine's KV cache holds, and the
YAML snippet loads into the original config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from sarathi_pp import LLM, load_config
from sarathi_pp.checkpoint import load_model_spec
from sarathi_pp.cli import main
from sarathi_pp.placement.partition import partition_layers
from sarathi_pp.planner.memory import spec_stage_memory
from sarathi_pp.scheduler.block_manager import blocks_for
from sarathi_pp.stages.model.llama import StageModel

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MAX_LEN = 128


def budget_for(model_dir, num_sequences: float) -> int:
    """A CPU budget that fits ``num_sequences`` full-length sequences next to the weights."""
    spec = load_model_spec(model_dir)
    [stage] = spec_stage_memory(spec, 1, "float32", 1)
    return stage.param_bytes + int(num_sequences * MAX_LEN * stage.kv_bytes_per_token)


# The in-flight limit follows the placement's schedule_ahead (``in_flight_limit``): fixed
# here, so the figures do not depend on the machine's core count.
NO_AHEAD = ["--set", "parallel.schedule_ahead=false"]


def plan_json(capsys, argv: list[str]) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", ["llama", "qwen2"])  # untied; tied embeddings
def test_spec_figures_equal_the_engines(tiny_model, name):
    model_dir = tiny_model(name)
    budget = budget_for(model_dir, 10.5)
    llm = LLM(
        str(model_dir), max_model_len=MAX_LEN, dtype="float32", device="cpu",
        cpu_memory_budget=budget, block_size=16,
    )  # fmt: skip
    try:
        expected = spec_stage_memory(llm.engine.spec, 1, "float32", budget)
        assert llm.engine.stage_memory == expected
        # the engine's KV cache holds exactly B = 10 sequences of max_model_len tokens
        assert llm.engine.num_kv_blocks // blocks_for(MAX_LEN, 16) == 10
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize(
    "name, num_stages", [("llama", 2), ("qwen2-4layer", 2), ("qwen2-4layer", 4)]
)
def test_partition_param_bytes_equal_the_loaded_stages(tiny_model, name, num_stages):
    # What each pipeline stage holds once loaded (the tied last stage keeps an embedding).
    model_dir = tiny_model(name)
    spec = load_model_spec(model_dir)
    planned = spec_stage_memory(spec, num_stages, "float32", 1)
    for i, (start, end) in enumerate(partition_layers(spec, num_stages)):
        stage = StageModel(
            spec, model_dir, start, end, i == 0, i == num_stages - 1, torch.float32,
            torch.device("cpu"), max_positions=MAX_LEN + 1,
        )  # fmt: skip
        assert stage.param_bytes() == planned[i].param_bytes, f"stage {i}"


def test_json_on_a_budget_of_ten_sequences(llama_dir, capsys):
    budget = budget_for(llama_dir, 10.5)
    got = plan_json(capsys, [
        "--model", str(llama_dir), "--dtype", "float32", "--set", f"model.max_model_len={MAX_LEN}",
        "--set", "model.device=cpu", "--set", f"cache.cpu_memory_budget={budget}",
        "--prompt-tokens", "60", "--output-tokens", "20",
    ])  # fmt: skip
    assert (got["max_decode_batch"], got["effective_decode_batch"], got["binds"]) == (
        10,
        10,
        "memory",
    )
    assert got["memory_bytes"] == budget and got["max_model_len"] == MAX_LEN
    assert got["pd_ratio"] == 3.0 and got["num_microbatches_in_flight"] == 1
    # 9 decodes; C = 3 x 9 = 27 -> clamped to 128; 128 + 9 = 137: 128 would keep 119 prefill
    # rows, under min_chunk_size, so up to 256 (247 rows)
    assert (got["num_decodes"], got["raw_prefill_chunk"], got["prefill_chunk"]) == (9, 27, 128)
    assert (got["clamped"], got["chunk_size"], got["tile_size"]) == ("min", 256, 128)
    # 19 decode steps; the 60-token prompt is 1 chunk carrying 9 -> 10 miss a chunk
    assert got["missed_decodes"] == 10
    assert [s["max_decode_batch"] for s in got["stages"]] == [10]


def test_shipped_configs(capsys):
    mixed = str(CONFIGS / "workloads" / "mixed.yaml")
    one = plan_json(capsys, ["--config", str(CONFIGS / "tiny-llama.yaml"), "--workload", mixed])
    # (4 GiB - 362_901_504) // (2048 x 16384) = 117; C = 8.667 x 116 = 1005; 1121 -> 1024
    assert (one["max_decode_batch"], one["chunk_size"], one["prefill_chunk"]) == (117, 1024, 1005)
    # num_microbatches_in_flight: auto, scheduling ahead off (as on a machine whose cores
    # the stages' threads take): n = 2 in flight, the stages
    two = plan_json(capsys, ["--config", str(CONFIGS / "tiny-llama-pp2.yaml"), "--workload", mixed,
                             *NO_AHEAD])  # fmt: skip
    # 4 layers a stage: m_kv 8192 -> 245; ceil(244 / 2) = 122; C = 1057; 1179 -> 1152
    assert (two["max_decode_batch"], two["num_decodes"], two["chunk_size"]) == (245, 122, 1152)
    assert two["num_microbatches_in_flight"] == 2
    assert [s["layers"] for s in two["stages"]] == [[0, 4], [4, 8]]
    assert two["stages"][1]["param_bytes"] == two["stages"][0]["param_bytes"] + 4096  # norm


def test_text_and_snippet_load_into_the_config(capsys, tmp_path):
    config_path = CONFIGS / "tiny-llama-pp2.yaml"
    argv = ["plan", "--config", str(config_path), "--pd-ratio", "4", *NO_AHEAD]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "B = floor((M_G 4294967296 - M_S" in text and "(memory binds)" in text
    assert "decodes per micro-batch = ceil((B - 1) / n) = ceil(244 / 2) = 122" in text
    assert "n/a: needs --workload" in text  # a ratio alone can't count chunks
    out = tmp_path / "plan.yaml"
    assert main([*argv, "--output", str(out)]) == 0
    snippet = yaml.safe_load(out.read_text())
    assert snippet == {"scheduler": {"chunk_size": 512, "tile_size": 128, "max_num_seqs": 245}}
    assert out.read_text().startswith("# sarathi-pp plan: B = floor(")
    merged = yaml.safe_load(config_path.read_text())
    merged["scheduler"].update(snippet["scheduler"])
    (tmp_path / "merged.yaml").write_text(yaml.safe_dump(merged))
    config = load_config(tmp_path / "merged.yaml")
    assert (config.scheduler.chunk_size, config.scheduler.max_num_seqs) == (512, 245)
    assert config.parallel.pipeline_parallel_size == 2


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--set", "cache.cpu_memory_budget=1000", "--pd-ratio", "4"], "M_G = 1000 bytes"),
        (["--prompt-tokens", "100", "--output-tokens", "0"], "0 output tokens per request"),
        ([], "give one of --workload FILE, --pd-ratio X"),
        (["--pd-ratio", "4", "--workload", "x.yaml"], "got --workload and --pd-ratio"),
        (["--pd-ratio", "4", "--set", "scheduler.max_num_seqs=0"], "max_num_seqs must be"),
        (["--workload", "missing.yaml"], "workload file 'missing.yaml' does not exist"),
        (["--pd-ratio", "4", "--run-dir", "runs/p"], "--run-dir: plan writes no run dir"),
        (["--pd-ratio", "4", "--overwrite"], "--overwrite: plan writes no run dir"),
    ],
)
def test_bad_input_is_a_usage_error(llama_dir, capsys, extra, message):
    argv = ["plan", "--model", str(llama_dir), "--dtype", "float32", "--set", "model.device=cpu"]
    with pytest.raises(SystemExit) as e:
        main([*argv, *extra])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_profile_missing_columns_is_a_usage_error(llama_dir, capsys, tmp_path):
    bad = tmp_path / "profile.csv"
    bad.write_text("num_tokens\n128\n")
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", str(llama_dir), "--dtype", "float32", "--set",
              "model.device=cpu", "--pd-ratio", "4", "--profile", str(bad)])  # fmt: skip
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "missing column(s) stage, prefill_tokens, decode_tokens, context_len, seconds" in err


def synthetic_profile(path: Path) -> None:
    """A 1024-token prompt whose chunked prefill costs +40% in chunks of 128, +15% in 256,
    +5% in 512; and a +18% step just past every multiple of 64 rows (a 64-row tile)."""
    from sarathi_pp.planner.profile_analysis import ProfileRow, write_profile

    per_row = 1e-5  # seconds per row off the steps
    rows = [ProfileRow(0, 1024, 0, 0, 1024 * per_row)]
    for c, overhead in ((128, 0.40), (256, 0.15), (512, 0.05)):
        rest = ((1 + overhead) * 1024 - c) * per_row / (1024 // c - 1)  # chunks after the first
        rows.append(ProfileRow(0, c, 0, 0, c * per_row))
        rows += [ProfileRow(0, c, 0, k, rest) for k in range(c, 1024, c)]
    for k in (64, 192):
        rows.append(ProfileRow(0, k, 0, 0, k * per_row))
    for k in (64, 128, 192, 256, 512):
        rows.append(ProfileRow(0, k + 4, 0, 0, 1.18 * (k + 4) * per_row))
    write_profile(path, rows)


def test_profile_sets_the_clamp_and_the_tile(capsys, tmp_path):
    from sarathi_pp.planner.profile_analysis import analyze_profile, load_profile

    profile = tmp_path / "profile.csv"
    synthetic_profile(profile)
    findings = analyze_profile(load_profile(profile), max_overhead=0.2)
    assert (findings.min_chunk, findings.tile_size) == ({0.1: 512, 0.2: 256}, 64)
    argv = ["--config", str(CONFIGS / "tiny-llama-pp2.yaml"), "--pd-ratio", "1"]
    got = plan_json(capsys, [*argv, "--profile", str(profile)])
    # C = 1 x 122 = 122 -> clamped up to the profile's 256; 256 + 122 = 378: 64 x 5 = 320
    # would keep 198 prefill rows, chunks the profile says cost more than 20%: 64 x 6 = 384
    assert (got["prefill_chunk"], got["clamped"], got["min_chunk_size"]) == (256, "min", 256)
    assert (got["tile_size"], got["chunk_size"]) == (64, 384)
    assert got["limit_notes"] == [
        "min_chunk_size 256 from the profile (overhead <= 0.2)",
        "tile_size 64 from the profile",
    ]
    assert "  min_chunk_size: 256  # from the profile" in got["yaml"]
    tight = plan_json(capsys, [*argv, "--profile", str(profile), "--max-overhead", "0.1"])
    assert (tight["min_chunk_size"], tight["chunk_size"]) == (512, 640)  # 512 + 122 = 634
    with pytest.raises(SystemExit):
        main(["plan", *argv, "--profile", str(profile), "--max-overhead", "0.01"])
    assert "no chunk keeps the chunked-prefill overhead within 0.01" in capsys.readouterr().err
