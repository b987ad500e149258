"""Typed config: YAML at the edge, flat LLM(...) keywords, strict keys, checked values."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from sarathi_pp.config import (
    FLAT_KEYS,
    EngineConfig,
    SchedulerConfig,
    make_config,
)
from sarathi_pp.config_file import load_config, parse_set_value


def test_defaults():
    cfg = EngineConfig()
    assert cfg.scheduler.policy == "sarathi" and cfg.scheduler.chunk_size == 256
    assert cfg.parallel.pipeline_parallel_size == 1 and cfg.parallel.microbatches_in_flight == 1
    assert make_config() == cfg


@pytest.mark.parametrize("flat", list(FLAT_KEYS))
def test_every_flat_key_maps_to_a_real_field(flat):
    section, name = FLAT_KEYS[flat]
    assert name in {f.name for f in dataclasses.fields(getattr(EngineConfig(), section))}


def test_flat_keywords_land_in_their_sections():
    cfg = make_config(
        model="/m",
        dtype="bfloat16",
        scheduler="vllm",
        chunk_size=512,
        block_size=32,
        pipeline_parallel_size=4,
        num_kv_blocks=100,
        max_num_seqs=8,
        tile_align=False,
    )
    assert cfg.model.path == "/m" and cfg.model.dtype == "bfloat16"
    assert cfg.scheduler.policy == "vllm" and cfg.scheduler.chunk_size == 512
    assert cfg.scheduler.max_num_seqs == 8 and cfg.scheduler.tile_align is False
    assert cfg.cache.block_size == 32 and cfg.cache.num_kv_blocks == 100
    assert cfg.parallel.pipeline_parallel_size == 4 and cfg.parallel.microbatches_in_flight == 4


def test_dotted_keys_and_replace():
    cfg = make_config(**{"scheduler.chunk_size": 64, "parallel.num_microbatches_in_flight": 3})
    assert cfg.scheduler.chunk_size == 64 and cfg.parallel.microbatches_in_flight == 3
    new = cfg.replace(chunk_size=128, **{"model.dtype": "float16"})
    assert new.scheduler.chunk_size == 128 and new.model.dtype == "float16"
    assert new.parallel.microbatches_in_flight == 3  # the rest is kept
    assert cfg.scheduler.chunk_size == 64 and cfg.model.dtype == "auto"  # original untouched


def test_decode_microbatches_in_flight_default_to_the_stages_capped_by_the_limit():
    p = make_config(pipeline_parallel_size=2, num_microbatches_in_flight=3).parallel
    assert (p.microbatches_in_flight, p.decode_microbatches_in_flight) == (3, 2)
    p = make_config(pipeline_parallel_size=4, num_microbatches_in_flight=2).parallel
    assert p.decode_microbatches_in_flight == 2  # never more than the limit itself
    p = make_config(
        pipeline_parallel_size=2, num_microbatches_in_flight=3, num_decode_microbatches_in_flight=3
    ).parallel
    assert p.decode_microbatches_in_flight == 3
    assert make_config().parallel.decode_microbatches_in_flight == 1


def test_configs_are_frozen():
    cfg = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.scheduler.chunk_size = 1  # type: ignore[misc]


def test_unknown_flat_keyword_names_it_and_lists_allowed():
    with pytest.raises(ValueError, match="chunksize") as e:
        make_config(chunksize=10)
    assert "chunk_size" in str(e.value) and "section.key" in str(e.value)


def test_unknown_dotted_key_names_it_and_lists_allowed():
    with pytest.raises(ValueError, match="scheduler.chunksize") as e:
        make_config(**{"scheduler.chunksize": 10})
    assert "scheduler.chunk_size" in str(e.value)
    with pytest.raises(ValueError, match="sched.chunk_size"):
        make_config(**{"sched.chunk_size": 10})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(chunk_size=0), "chunk_size.*>= 1.*0"),
        (dict(chunk_size=True), "chunk_size.*True"),
        (dict(chunk_size="256"), "chunk_size.*'256'"),
        (dict(tile_size=-8), "tile_size.*-8"),
        (dict(max_num_seqs=0), "max_num_seqs.*0"),
        (dict(scheduler="fcfs"), "unknown scheduler 'fcfs'.*sarathi.*vllm.*orca.*simple_chunking"),
        (dict(dtype="fp8"), "dtype.*float32.*'fp8'"),
        (dict(device="tpu"), "device.*'tpu'"),
        (dict(block_size=0), "block_size.*0"),
        (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization.*0.0"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization.*1.5"),
        (dict(tile_align="yes"), "tile_align.*'yes'"),
        (dict(prefault_kv_cache="yes"), "prefault must be true or false, got 'yes'"),
        (dict(pipeline_parallel_size=0), "pipeline_parallel_size.*0"),
        (dict(num_microbatches_in_flight=0), "num_microbatches_in_flight.*0"),
        (dict(num_decode_microbatches_in_flight=0), "num_decode_microbatches_in_flight.*0"),
        (
            dict(
                pipeline_parallel_size=2,
                num_microbatches_in_flight=2,
                num_decode_microbatches_in_flight=3,
            ),
            "num_decode_microbatches_in_flight=3 exceeds num_microbatches_in_flight=2",
        ),
        (dict(model=""), "model.*''"),
        (dict(max_model_len=0), "max_model_len.*0"),
        (dict(max_waiting=0), "max_waiting.*0"),
        (dict(overwrite="false"), "overwrite must be true or false, got 'false'"),
        (dict(run_dir=""), "run_dir.*''"),
        (dict(run_dir=7), "run_dir.*7"),
        (dict(enforce_eager="no"), "enforce_eager must be true or false, got 'no'"),
        (
            dict(activation_memory="measure"),
            r"activation_memory must be one of \('estimate', "
            r"'profile'\), got 'measure'",
        ),  # fmt: skip
    ],
)
def test_bad_values_raise_value_error_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_config(**kwargs)


def test_scheduler_config_checks_directly():
    with pytest.raises(ValueError, match="chunk_size"):
        SchedulerConfig(chunk_size=0)


def _write(tmp_path, text: str):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_load_yaml_and_overrides_win(tmp_path):
    p = _write(
        tmp_path,
        "scheduler: {policy: simple_chunking, chunk_size: 32, tile_size: 8}\n"
        "parallel: {pipeline_parallel_size: 2}\ncache:\n",
    )
    cfg = load_config(p)
    assert cfg.scheduler.policy == "simple_chunking" and cfg.scheduler.chunk_size == 32
    assert cfg.scheduler.tile_size == 8 and cfg.parallel.pipeline_parallel_size == 2
    assert cfg.cache == EngineConfig().cache  # an empty section keeps the defaults
    cfg = load_config(p, chunk_size=64, **{"parallel.pipeline_parallel_size": 3})
    assert cfg.scheduler.chunk_size == 64 and cfg.parallel.pipeline_parallel_size == 3
    assert cfg.scheduler.policy == "simple_chunking"


def test_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = make_config(scheduler="orca", chunk_size=100, num_kv_blocks=7, run_dir="runs/x")
    p = _write(tmp_path, yaml.safe_dump(cfg.to_dict()))
    assert load_config(p) == cfg


def test_yaml_unknown_section_and_key(tmp_path):
    with pytest.raises(ValueError, match="unknown config section 'schedular'") as e:
        load_config(_write(tmp_path, "schedular: {chunk_size: 8}\n"))
    assert "scheduler" in str(e.value) and "parallel" in str(e.value)
    with pytest.raises(ValueError, match=r"scheduler\.chunk\b") as e:
        load_config(_write(tmp_path, "scheduler: {chunk: 8}\n"))
    assert "chunk_size" in str(e.value) and "tile_align" in str(e.value)


def test_yaml_bad_value_and_bad_files(tmp_path):
    with pytest.raises(ValueError, match="chunk_size.*0"):
        load_config(_write(tmp_path, "scheduler: {chunk_size: 0}\n"))
    with pytest.raises(ValueError, match="mapping"):
        load_config(_write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ValueError, match="section 'model' must be a mapping"):
        load_config(_write(tmp_path, "model: 3\n"))
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(_write(tmp_path, "scheduler: {chunk_size: [\n"))
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_parse_set_value():
    assert parse_set_value("256") == 256
    assert parse_set_value("false") is False
    assert parse_set_value("null") is None
    assert parse_set_value("vllm") == "vllm"
    assert parse_set_value("") == ""


def test_same_key_set_twice_is_rejected():
    with pytest.raises(
        ValueError, match="'scheduler.chunk_size' and 'chunk_size'|'chunk_size' and"
    ):
        make_config(chunk_size=8, **{"scheduler.chunk_size": 16})
    assert make_config(chunk_size=8, tile_size=8).scheduler.chunk_size == 8  # different keys


@pytest.mark.parametrize(
    "stages, setting, ahead, limit",
    [
        (1, "auto", False, 1),  # one stage: nothing to overlap
        (2, "auto", False, 2),  # the stages: TBT first (P + 1 is set as a number)
        (4, "auto", False, 4),
        (2, "auto", True, 2),  # the micro-batch ahead comes on top: P, plus it
        (4, "auto", True, 4),
        (2, 3, False, 3),  # throughput first, as set
        (2, None, False, 2),  # latency first: the stages
        (2, None, True, 2),
        (2, 3, True, 3),  # a number is kept as set
        (3, 1, False, 1),
    ],
)
def test_microbatches_in_flight_auto_rule(stages, setting, ahead, limit):
    p = make_config(pipeline_parallel_size=stages, num_microbatches_in_flight=setting).parallel
    assert p.in_flight_limit(schedule_ahead=ahead) == limit
    assert p.microbatches_in_flight >= limit  # the bound the stages and the planner size by


def test_bare_pipeline_gets_auto_in_flight():
    p = make_config(pipeline_parallel_size=2).parallel
    assert p.num_microbatches_in_flight == "auto" and p.microbatches_in_flight == 2
    assert p.decode_microbatches_in_flight == 2  # the decode-only tail keeps the stages


@pytest.mark.parametrize("bad", ["many", 0, 1.5, True])
def test_microbatches_in_flight_bad_values(bad):
    with pytest.raises(ValueError, match=f"num_microbatches_in_flight must be .* got {bad!r}"):
        make_config(pipeline_parallel_size=2, num_microbatches_in_flight=bad)
