"""Per-request sampling parameters, in vLLM's shape and with vLLM's defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop, per request.

    Defaults follow vLLM: ``temperature=1.0``, ``top_p=1.0``, ``top_k=0`` (off; ``-1`` is
    accepted as "off" too), ``max_tokens=16``. ``temperature=0`` means greedy.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    use_beam_search: bool = False

    def __post_init__(self) -> None:
        # Normalise list arguments so the value stays hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        if self.n != 1:
            raise ValueError(f"n={self.n} is not supported yet (only n=1)")
        if self.logprobs is not None:
            raise ValueError(f"logprobs={self.logprobs} is not supported yet")
        if self.use_beam_search:
            raise ValueError("beam search is not supported")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(
                f"top_k must be 0 or -1 (off) or a positive integer, got {self.top_k!r}"
            )
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")

    @property
    def is_greedy(self) -> bool:
        # As vLLM: a temperature this small is greedy (dividing by it would overflow).
        return self.temperature < SAMPLING_EPS
