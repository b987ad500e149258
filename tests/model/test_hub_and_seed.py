"""vLLM's ``LLM(...)`` keywords beyond the basics: a hub id ``org/name`` (resolved from a
Hugging Face cache laid out here, offline), ``seed`` (the engine-wide default for sampled
requests) and ``tensor_parallel_size`` (1 only)."""

from __future__ import annotations

import shutil

import huggingface_hub.constants
import pytest

from sarathi_pp import LLM, SamplingParams
from sarathi_pp.checkpoint import resolve_model_path
from sarathi_pp.config import make_config

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [9, 8, 7], [1, 2, 3, 4]]


@pytest.fixture
def hub_cache(tmp_path, llama_dir, monkeypatch):
    """``org/tiny-llama`` in a hub cache as huggingface_hub lays it out; no network."""
    repo = tmp_path / "hub" / "models--org--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(llama_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return repo / "snapshots" / commit


def test_hub_id_resolves_from_the_cache_and_runs(hub_cache, llama_dir):
    assert resolve_model_path("org/tiny-llama") == str(hub_cache)
    with LLM("org/tiny-llama", max_model_len=128) as llm:
        ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with LLM(str(llama_dir), max_model_len=128) as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert ours == ref and len(set(ours[0])) > 1


def test_unknown_hub_id_offline_is_a_clear_error(hub_cache):
    with pytest.raises(FileNotFoundError, match="'org/missing' is not a local folder, not in"):
        resolve_model_path("org/missing")
    with pytest.raises(FileNotFoundError, match="model directory 'no/such/dir' does not exist"):
        resolve_model_path("no/such/dir")  # two slashes: a path, never a hub id


def _sampled(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SAMPLED, use_tqdm=False)]


def test_engine_seed_makes_sampling_reproducible(llama_dir):
    with LLM(str(llama_dir), max_model_len=128, seed=7) as llm:
        first = _sampled(llm)
    with LLM(str(llama_dir), max_model_len=128, seed=7, chunk_size=3, tile_align=False) as llm:
        again = _sampled(llm)  # other batching, same requests in the same order
    with LLM(str(llama_dir), max_model_len=128, seed=8) as llm:
        other = _sampled(llm)
    assert first == again
    assert first != other
    assert first[0] != first[2]  # same prompt, distinct requests: distinct seeds


def test_tensor_parallel_size_one_only():
    assert make_config(tensor_parallel_size=1).parallel.tensor_parallel_size == 1
    with pytest.raises(ValueError, match="tensor_parallel_size=2: tensor parallelism is not"):
        make_config(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="seed must be an integer >= 0, got -1"):
        make_config(seed=-1)
