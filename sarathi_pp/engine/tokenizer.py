"""Tokenizer from the model folder (``AutoTokenizer``) and incremental detokenization."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(path: str | Path) -> bool:
    return any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    # Never run code shipped in the model folder (tokenizer_config.json's auto_map).
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)


class Detokenizer:
    """Streams text out of generated token ids, one token at a time (tokenizers'
    ``DecodeStream`` for fast tokenizers: no re-decoding of the whole output per token)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])

    def new_stream(self, skip_special_tokens: bool = True) -> Any:
        if self._backend is None:
            return None
        from tokenizers.decoders import DecodeStream

        return DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, stream: Any, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text added by the last of ``token_ids`` (the whole output so far)."""
        if stream is None:  # slow tokenizer: decode everything again
            return ""
        if skip_special_tokens and token_ids[-1] in self._special:
            return ""
        return stream.step(self._backend, token_ids[-1]) or ""

    def decode(
        self, token_ids: list[int], skip_special_tokens: bool = True, spaces: bool = True
    ) -> str:
        """``spaces``: ``spaces_between_special_tokens``, which a slow tokenizer's decode
        takes (a fast one's ignores it: its decoder joins tokens as trained)."""
        if spaces:  # the tokenizers' default
            return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(
            token_ids, skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=False
        )
