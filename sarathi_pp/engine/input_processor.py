"""Requests in: the tokenizer, and the checks a prompt must pass before it is queued."""

from __future__ import annotations

from typing import Any

from sarathi_pp.checkpoint import Checkpoint
from sarathi_pp.config import ModelConfig
from sarathi_pp.sampling_params import SamplingParams
from sarathi_pp.tokenizer import has_tokenizer, load_tokenizer


class InputProcessor:
    def __init__(self, model: ModelConfig, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint
        tok_dir = model.tokenizer or checkpoint.path  # the model folder's by default
        if model.tokenizer is not None and not has_tokenizer(tok_dir):
            raise FileNotFoundError(f"tokenizer folder {tok_dir!r} has no tokenizer files")
        self.tokenizer: Any = load_tokenizer(tok_dir) if has_tokenizer(tok_dir) else None

    def eos_token_ids(self) -> set[int]:
        """The checkpoint's EOS ids and the tokenizer's."""
        ids = set(self.checkpoint.spec.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def request_tokens(
        self, request_id: str, prompt: str | None, params: Any, token_ids: list[int] | None
    ) -> list[int]:
        """A request's prompt token ids (``prompt`` tokenized when none are given)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if token_ids is not None:
            return list(token_ids)
        if not isinstance(prompt, str):
            raise TypeError(f"request {request_id!r}: prompt must be a string, got {prompt!r}")
        return self.tokenize(prompt) if prompt else []

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(
                f"model folder {self.checkpoint.path!r} has no tokenizer: "
                "pass prompt_token_ids instead"
            )
        return self.tokenizer.encode(prompt)

    def validate(
        self,
        token_ids: list[int],
        where: str,
        kv_capacity: int,
        max_unchunked: int | None,
        policy: str,
    ) -> None:
        """``ValueError`` naming ``where`` unless the prompt can run at all: in the
        vocabulary, within ``max_model_len`` and the KV cache's ``kv_capacity`` tokens, and
        within ``max_unchunked`` tokens when the policy does not chunk prompts."""
        if len(token_ids) == 0:
            raise ValueError(f"{where} is empty")
        vocab = self.checkpoint.spec.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{where} has token ids outside [0, {vocab}): {bad[:5]}")
        n, max_len = len(token_ids), self.checkpoint.max_model_len
        if n > max_len:
            raise ValueError(f"{where} has {n} tokens, more than max_model_len={max_len}")
        if n + 1 > kv_capacity:
            raise ValueError(f"{where} has {n} tokens; the whole KV cache holds {kv_capacity}")
        if max_unchunked is not None and n > max_unchunked:
            raise ValueError(
                f"{where} has {n} tokens, more than max_num_batched_tokens={max_unchunked} "
                f"(scheduler {policy!r} does not chunk prompts)"
            )
