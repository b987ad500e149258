"""What the runtime needs to know of a Hugging Face checkpoint, from its config.json's
mapping (``checkpoint.load_model_spec`` reads the file).

Pure Python (no torch, no I/O): the scheduler, the planner and the KV sizing use it without a
device. Covers the Llama family: Llama (incl. Llama 3 rope scaling), Mistral and Qwen2.
Both the older ``rope_theta``/``rope_scaling`` keys and transformers 5's
``rope_parameters`` are read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str = "default"
    rope_params: dict[str, Any] = field(default_factory=dict)
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

    # --- sizes (bytes are for a given dtype) ----------------------------------------------
    def kv_bytes_per_token(self, num_layers: int, dtype: str) -> int:
        """m_kv: bytes of one token's K and V in ``num_layers`` layers."""
        return 2 * num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]  # 2: K, V

    def layer_params(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        return attn + mlp + 2 * h  # + two RMSNorm weights

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def num_params(self) -> int:
        lm_head = 0 if self.tie_word_embeddings else self.embedding_params()
        return (
            self.num_layers * self.layer_params()
            + self.embedding_params()
            + lm_head
            + self.hidden_size
        )


def _rope(cfg: dict[str, Any]) -> tuple[float, str, dict[str, Any]]:
    params = cfg.get("rope_parameters")
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
        if "rope_theta" in cfg:
            params.setdefault("rope_theta", cfg["rope_theta"])
    params = dict(params)
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "linear" and "factor" not in params:
        raise ValueError("rope type 'linear' needs a 'factor'")
    if rope_type == "llama3":
        needed = (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        )
        missing = [k for k in needed if k not in params]
        if missing:
            raise ValueError(f"rope type 'llama3' lacks {', '.join(missing)}")
    return theta, rope_type, params


def spec_from_dict(cfg: dict[str, Any], source: str = "config.json") -> ModelSpec:
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch is None:
        by_type = {
            "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
        }
        arch = by_type.get(cfg.get("model_type", ""))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{source}: unsupported architecture {archs or cfg.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    shape = _shape(cfg, source)
    theta, rope_type, rope_params = _rope(cfg)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    eos_ids = tuple(_int(t, "eos_token_id", source, 0) for t in eos_ids)
    window = cfg.get("sliding_window")
    if window is not None:
        window = _int(window, "sliding_window", source)
    if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
        window = None
    if arch == "LlamaForCausalLM":
        bias = bool(cfg.get("attention_bias", False))
    else:
        bias = arch == "Qwen2ForCausalLM"
    if cfg.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias=true is not supported")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
    return ModelSpec(
        architecture=arch,
        **shape,
        rms_norm_eps=_real(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps", source, positive=True),
        rope_theta=_real(theta, "rope_theta", source, positive=True),
        rope_type=rope_type,
        rope_params=rope_params,
        attention_bias=bias,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=_int(
            cfg.get("max_position_embeddings", 2048), "max_position_embeddings", source
        ),
        sliding_window=window,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
    )


def _shape(cfg: dict[str, Any], source: str) -> dict[str, int]:
    """The tensor shapes' figures, checked (``ValueError`` naming the key): the weights are
    checked against them when loaded, so nonsense here would fail every request instead."""
    for key in REQUIRED_KEYS:
        if key not in cfg:
            raise ValueError(f"{source}: missing {key!r}")
    got = {key: _int(cfg[key], key, source) for key in REQUIRED_KEYS}
    heads, hidden = got["num_attention_heads"], got["hidden_size"]
    kv_heads = cfg.get("num_key_value_heads")
    kv_heads = heads if kv_heads is None else _int(kv_heads, "num_key_value_heads", source)
    if heads % kv_heads:
        raise ValueError(
            f"{source}: num_key_value_heads={kv_heads} does not divide "
            f"num_attention_heads={heads} (each KV head serves a whole group of query heads)"
        )
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ValueError(
                f"{source}: hidden_size={hidden} is not divisible by num_attention_heads={heads} "
                "(and no head_dim is given)"
            )
        head_dim = hidden // heads
    head_dim = _int(head_dim, "head_dim", source)
    if head_dim % 2:
        raise ValueError(f"{source}: head_dim={head_dim} must be even (rotary embeddings)")
    return dict(
        vocab_size=got["vocab_size"], hidden_size=hidden,
        intermediate_size=got["intermediate_size"], num_layers=got["num_hidden_layers"],
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
    )  # fmt: skip


def _int(value: Any, key: str, source: str, minimum: int = 1) -> int:
    """An integer config value ``>= minimum`` (``4.0`` is taken as 4; ``true`` is refused)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{source}: {key} must be an integer >= {minimum}, got {value!r}")
    return value


def _real(value: Any, key: str, source: str, positive: bool = False) -> float:
    """A finite real config value (``> 0`` with ``positive``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or (positive and value <= 0):
        what = "a finite number > 0" if positive else "a finite number"
        raise ValueError(f"{source}: {key} must be {what}, got {value!r}")
    return float(value)
