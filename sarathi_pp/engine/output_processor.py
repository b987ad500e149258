"""From sampled tokens to ``RequestOutput``: detokenization, stop checks, output building.

The engine loop hands every sequence that received a token to ``check_stop``, which says
whether and why it ends (EOS or a stop token, a stop string, ``max_tokens`` or
``max_model_len``), and asks ``output`` for the ``RequestOutput`` the caller sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sarathi_pp.engine.tokenizer import Detokenizer
from sarathi_pp.microbatch import TokenLogprobs
from sarathi_pp.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
)
from sarathi_pp.sequence import Sequence, SequenceStatus

StopReason = int | str | None  # the stop token id, the stop string, or None


@dataclass
class _TextState:
    stream: Any  # the detokenizer's incremental stream (None: decode the whole output)
    prompt_token_ids: list[int]  # one copy per request, shared by its outputs (as vLLM)
    text: str = ""
    logprobs: SampleLogprobs | None = None  # built as tokens come (SamplingParams.logprobs)
    cumulative_logprob: float = 0.0
    prompt_logprobs: PromptLogprobs | None = None  # built once the prompt is all in


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: set[int], max_model_len: int) -> None:
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._text: dict[int, _TextState] = {}  # seq_id -> text so far
        self._token_text: dict[int, str] = {}  # token id -> its text alone (logprobs)

    def add(self, seq: Sequence) -> None:
        skip = seq.params.skip_special_tokens
        stream = self.detokenizer.new_stream(skip) if self.detokenizer else None
        state = _TextState(stream, list(seq.prompt_token_ids))
        if seq.params.logprobs is not None:
            state.logprobs = []
        self._text[seq.seq_id] = state

    def drop(self, seq: Sequence) -> None:
        self._text.pop(seq.seq_id, None)

    def check_stop(self, seq: Sequence) -> tuple[SequenceStatus, StopReason] | None:
        """Update ``seq``'s text with its newest token; how it ends, or ``None``."""
        token = seq.output_token_ids[-1]
        p = seq.params
        state = self._text[seq.seq_id]
        if self.detokenizer is not None:
            state.text += self._new_text(seq, state)
        if token in p.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED, token
        if not p.ignore_eos and token in self.eos_token_ids:  # as vLLM: no stop_reason
            return SequenceStatus.FINISHED_STOPPED, None
        if p.stop and (hit := self._stop_string(seq, state)) is not None:
            return SequenceStatus.FINISHED_STOPPED, hit
        at_max = p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens
        if at_max or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH, None
        return None

    def _new_text(self, seq: Sequence, state: _TextState) -> str:
        assert self.detokenizer is not None
        skip = seq.params.skip_special_tokens
        if state.stream is not None:
            return self.detokenizer.step(state.stream, seq.output_token_ids, skip)
        spaces = seq.params.spaces_between_special_tokens
        full = self.detokenizer.decode(seq.output_token_ids, skip, spaces)
        return full[len(state.text) :]

    def _stop_string(self, seq: Sequence, state: _TextState) -> str | None:
        # Only the tail can hold a new match: the text before it was checked already.
        longest = max(len(s) for s in seq.params.stop)
        tail_from = max(0, len(state.text) - longest - 16)
        for s in seq.params.stop:
            i = state.text.find(s, tail_from)
            if i >= 0:  # as vLLM: the stop string is cut, unless asked for
                keep = len(s) if seq.params.include_stop_str_in_output else 0
                state.text = state.text[: i + keep]
                return s
        return None

    def output(self, seq: Sequence) -> RequestOutput:
        """The request's output so far (the final one once ``seq`` is finished)."""
        state = self._text.get(seq.seq_id)
        if state is None:  # not added here: its text and log-probabilities from scratch
            state = _TextState(None, list(seq.prompt_token_ids))
            state.logprobs = [] if seq.params.logprobs is not None else None
        self._add_logprobs(seq, state)
        if state.prompt_logprobs is None and seq.params.prompt_logprobs is not None:
            state.prompt_logprobs = self._prompt_logprobs(seq)
        text = state.text
        # Not copied at every step (a 4K-token prompt would be copied for each new token).
        prompt_ids = state.prompt_token_ids
        if seq.is_finished:
            self._text.pop(seq.seq_id, None)
            if self.detokenizer is not None and not isinstance(seq.stop_reason, str):
                # The stream holds back an incomplete UTF-8 tail; the final text has it all.
                p = seq.params
                text = self.detokenizer.decode(
                    seq.output_token_ids, p.skip_special_tokens, p.spaces_between_special_tokens
                )
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.status.finish_reason,
            stop_reason=seq.stop_reason,
            error=seq.error,
            logprobs=None if state.logprobs is None else list(state.logprobs),
            cumulative_logprob=None if state.logprobs is None else state.cumulative_logprob,
        )
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=prompt_ids,
            outputs=[completion],
            finished=seq.is_finished,
            metrics=seq.metrics,
            error=seq.error,
            prompt_logprobs=state.prompt_logprobs,
        )

    def _add_logprobs(self, seq: Sequence, state: _TextState) -> None:
        """Turn the sequence's new ``TokenLogprobs`` into vLLM's per-token dicts."""
        if state.logprobs is None:
            return
        tokens = seq.output_token_ids
        for i in range(len(state.logprobs), len(seq.output_logprobs)):
            lp: TokenLogprobs = seq.output_logprobs[i]
            state.logprobs.append(self._entry(tokens[i], lp))
            state.cumulative_logprob += lp.logprob

    def _prompt_logprobs(self, seq: Sequence) -> PromptLogprobs | None:
        """vLLM's prompt log-probabilities of ``seq``, once every position is in."""
        prompt = seq.prompt_token_ids
        if len(seq.prompt_logprobs) < len(prompt) - 1:
            return None
        out: PromptLogprobs = [None]
        for token, lp in zip(prompt[1:], seq.prompt_logprobs):
            out.append(self._entry(token, lp))
        return out

    def _entry(self, token: int, lp: TokenLogprobs) -> dict[int, Logprob]:
        """``token``'s log-probability first, then the most likely tokens' (once each)."""
        entry = {token: Logprob(lp.logprob, lp.rank, self.token_text(token))}
        for r, (tid, value) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
            if tid not in entry:
                entry[tid] = Logprob(value, r, self.token_text(tid))
        return entry

    def token_text(self, token_id: int) -> str | None:
        """``token_id``'s own text (special tokens too); ``None`` without a tokenizer."""
        if self.detokenizer is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            # special tokens too: the token's own text, whatever the request's text skips
            text = self._token_text[token_id] = self.detokenizer.decode([token_id], False)
        return text
