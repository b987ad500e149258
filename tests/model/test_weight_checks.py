"""A model folder whose weights cannot serve its config.json is refused when the stages
load, naming the tensor or the file: a tensor of the wrong shape, a truncated or corrupt
safetensors file, an index whose weight_map points outside the folder."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sarathi_pp import LLM
from sarathi_pp.checkpoint import load_model_spec
from sarathi_pp.stages.loader.weights import expected_shape, load_tensors, stage_tensor_names

INDEX = "model.safetensors.index.json"


def copy_model(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "model"))


def test_every_tensor_of_every_variant_has_its_expected_shape(any_model_dir):
    spec = load_model_spec(any_model_dir)
    names = stage_tensor_names(spec, 0, spec.num_layers, is_first=True, is_last=True)
    w = load_tensors(any_model_dir, names, torch.float32, torch.device("cpu"), spec=spec)
    for name, t in w.items():
        assert tuple(t.shape) == expected_shape(spec, name)[0], name


def test_a_tensor_of_the_wrong_shape_is_named(llama_dir, tmp_path):
    d = copy_model(llama_dir, tmp_path)
    tensors = load_file(d / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"  # [kv_heads 2 * head_dim 16, hidden 64]
    tensors[name] = torch.zeros(64, 64)
    save_file(tensors, d / "model.safetensors")
    want = (
        f"weight {name} in '{d / 'model.safetensors'}' has shape [64, 64], but config.json "
        "implies [32, 64] ([num_key_value_heads*head_dim, hidden_size])"
    )
    with pytest.raises(ValueError, match=re.escape(want)):
        LLM(str(d), max_model_len=64)


def test_config_that_disagrees_with_the_weights_is_named(llama_dir, tmp_path):
    d = copy_model(llama_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(ValueError, match=r"mlp\.gate_proj\.weight .* has shape \[128, 64\], "
                       r"but config.json implies \[96, 64\] \(\[intermediate_size, hidden_size"):  # fmt: skip
        LLM(str(d), max_model_len=64)


@pytest.mark.parametrize("keep", [0.5, 0.001, 0.0])
def test_a_truncated_file_is_named(llama_dir, tmp_path, keep):
    d = copy_model(llama_dir, tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match=re.escape(f"weights file '{f}' cannot be read (")) as e:
        LLM(str(d), max_model_len=64)
    assert "truncated or corrupt" in str(e.value)


def test_a_truncated_shard_is_named(llama_sharded_dir, tmp_path):
    d = copy_model(llama_sharded_dir, tmp_path)
    shard = sorted(d.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError, match=re.escape(f"weights file '{shard}' cannot be read (")):
        LLM(str(d), max_model_len=64)


@pytest.mark.parametrize("entry", ["../outside/{shard}", "/{outside}/{shard}", "a/../../{shard}"])
def test_weight_map_entries_must_stay_in_the_folder(llama_sharded_dir, tmp_path, entry):
    d = copy_model(llama_sharded_dir, tmp_path)
    outside = shutil.copytree(d, tmp_path / "outside")  # real files there: only the check stops it
    index = json.loads((d / INDEX).read_text())
    name, shard = next(iter(index["weight_map"].items()))
    bad = entry.format(shard=shard, outside=str(outside).lstrip("/"))
    index["weight_map"][name] = bad
    (d / INDEX).write_text(json.dumps(index))
    with pytest.raises(
        ValueError, match=re.escape(f"weight_map entry {bad!r} is not a file name inside")
    ):
        LLM(str(d), max_model_len=64)


def test_weight_map_entry_that_is_missing_is_named(llama_sharded_dir, tmp_path):
    d = copy_model(llama_sharded_dir, tmp_path)
    index = json.loads((d / INDEX).read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "model-99-of-99.safetensors"
    (d / INDEX).write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="'model-99-of-99.safetensors', which is missing"):
        LLM(str(d), max_model_len=64)


def test_a_symlinked_folder_layout_still_loads(llama_sharded_dir, tmp_path):
    # A Hugging Face cache snapshot: every file a link to a blob outside the folder.
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    shutil.copytree(llama_sharded_dir, blobs)
    snap.mkdir(parents=True)
    for f in blobs.iterdir():
        (snap / f.name).symlink_to(Path("../../blobs") / f.name)
    spec = load_model_spec(snap)
    names = stage_tensor_names(spec, 0, spec.num_layers, is_first=True, is_last=True)
    assert load_tensors(snap, names, torch.float32, torch.device("cpu"), spec=spec)


def test_tokenizer_never_trusts_remote_code(monkeypatch, llama_dir):
    import transformers

    from sarathi_pp.engine.tokenizer import load_tokenizer

    seen = {}
    real = transformers.AutoTokenizer.from_pretrained

    def spy(path, **kwargs):
        seen.update(kwargs)
        return real(path, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    load_tokenizer(llama_dir)
    assert seen.get("trust_remote_code") is False
