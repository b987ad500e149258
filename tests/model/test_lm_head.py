"""The last stage's lm_head (Note [packed lm_head] in ``sarathi_pp.stages.model.llama``): packed
where the stage does not also embed tokens with it, its logits equal ``F.linear``'s over the
checkpoint's weight, and the stage's M_S equals what the planner counts from the config."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sarathi_pp.checkpoint import load_model_spec
from sarathi_pp.placement.partition import partition_layers
from sarathi_pp.planner.memory import spec_stage_memory
from sarathi_pp.stages.loader.weights import EMBED, LM_HEAD, load_tensors
from sarathi_pp.stages.model import linear
from sarathi_pp.stages.model.llama import StageModel


def _last_stage(model_dir, spec, num_stages: int) -> StageModel:
    start, end = partition_layers(spec, num_stages)[-1]
    return StageModel(
        spec, model_dir, start, end, num_stages == 1, True, torch.float32, torch.device("cpu"), 256
    )


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
@pytest.mark.parametrize("is_first", [True, False])
def test_lm_head_packing_and_memory(tiny_model, variant, is_first, monkeypatch):
    monkeypatch.setattr(linear, "MIN_PACKED_ELEMENTS", 1)  # the test models are small
    model_dir = tiny_model(variant)
    spec = load_model_spec(model_dir)
    num_stages = 1 if is_first else 2
    stage = _last_stage(model_dir, spec, num_stages)
    tied = spec.tie_word_embeddings
    packs = linear.available_kinds() != ["f_linear"]
    assert stage.lm_head is not None
    # Packed unless it is the embedding this stage also looks tokens up in.
    assert stage.lm_head.is_packed == (packs and not (tied and is_first))
    assert (stage.embed is not None) == is_first  # a later stage keeps no embedding
    name = EMBED if tied else LM_HEAD
    weight = load_tensors(model_dir, [name], torch.float32, torch.device("cpu"), spec=spec)[name]
    hidden = torch.randn(5, spec.hidden_size)
    normed = stage.ops.rms_norm(hidden, stage.norm, spec.rms_norm_eps)
    torch.testing.assert_close(stage.logits(hidden), F.linear(normed, weight), rtol=1e-5, atol=1e-4)
    # M_S as loaded = the planner's count from the config alone (no packed copy counted twice
    # or missed).
    planned = spec_stage_memory(spec, num_stages, "float32", 2**34)[-1]
    assert stage.param_bytes() == planned.param_bytes
