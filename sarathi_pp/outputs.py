"""Output types in vLLM's shape (``RequestOutput`` / ``CompletionOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field


def tpot(e2e: float | None, ttft: float | None, num_output_tokens: int) -> float | None:
    """Time per output token after the first: ``(e2e - TTFT) / (output tokens - 1)``;
    ``None`` for one output token or an unfinished request."""
    if num_output_tokens < 2 or e2e is None or ttft is None:
        return None
    return (e2e - ttft) / (num_output_tokens - 1)


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.monotonic()`` seconds, one clock per engine) of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per generated token
    num_preemptions: int = 0
    # Prompt tokens read from the prefix cache at the request's first prefill start
    # (vLLM's ``RequestOutput.num_cached_tokens``); ``None``: not looked up (prefix
    # caching off, or the request wants its prompt's logprobs).
    num_cached_tokens: int | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token: first token - arrival."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tbt(self) -> list[float]:
        """Time between tokens: every gap between consecutive generated tokens."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def scheduling_delay(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class Logprob:
    """One token's log-probability (vLLM's ``Logprob``): ``rank`` 1 is the most likely
    token; ``decoded_token`` its text alone (``None`` without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: token id -> Logprob, the sampled token first, then the most likely
# ones (``SamplingParams.logprobs`` of them; the sampled one appears once).
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token: ``None`` for the first (nothing precedes it), then token id -> Logprob,
# the prompt's own token first, then the most likely ones (``SamplingParams.prompt_logprobs``).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # set when finish_reason == "error"
    # With ``SamplingParams.logprobs`` set: one entry per token of ``token_ids``, and their
    # sampled tokens' log-probabilities summed; ``None`` otherwise (as vLLM).
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    # With ``SamplingParams.prompt_logprobs`` set: one entry per prompt token, once the
    # whole prompt has been computed (``None`` before, and otherwise, as vLLM)
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def num_cached_tokens(self) -> int | None:
        """Prompt tokens read from the prefix cache (vLLM's name); ``None``: not looked up."""
        return self.metrics.num_cached_tokens
