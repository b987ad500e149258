"""One HTTP request's engine requests and their answer: ``Answer`` keeps the latest output
of each (its ``n`` choices merged by the engine), ``Reader`` reads a non-streamed request's
outputs while watching for its client to leave, ``checked`` turns a failed output into the
``ApiError`` it means, ``safe_end`` says how much of an unfinished text may be streamed."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import Request

from sarathi_pp.outputs import RequestOutput
from sarathi_pp.serve import responses as shapes
from sarathi_pp.serve.engine_loop import EngineFailure, Sink
from sarathi_pp.serve.protocol import ApiError

# Seconds between checks that the client of a non-streamed request is still there.
DISCONNECT_POLL_S = 0.5


class Answer:
    """The engine requests of one HTTP request (``ids``: one per prompt, in prompt order) and
    their latest outputs. Each has ``n`` completions, merged by the engine
    (``LLMEngine.step`` hands out a parent request's output with all of them): choice
    ``i * n + j`` is prompt ``i``'s completion ``j``."""

    def __init__(self, ids: list[str], n: int) -> None:
        self.ids = ids
        self.n = n
        self.num_choices = len(ids) * n
        self._index = {rid: i for i, rid in enumerate(ids)}
        self._latest: list[Any] = [None] * len(ids)
        self.failed = False  # the stream ended on an error
        self.echo: list[str] = []  # with echo: each prompt's text, set when added
        self.first_text: list[str] = []  # and with logprobs: its first token's text
        self.echoed = [False] * self.num_choices  # streaming: the prompt has been sent
        self.sent_end = [False] * self.num_choices  # streaming: the finish reason has been sent
        self.echo_only = False  # ``max_tokens: 0`` with echo: no completion tokens
        self.call_ids: dict[int, str] = {}  # streaming a named tool call: each choice's id

    def echoed_logprobs(self, prompt_idx: int, out: RequestOutput) -> dict[str, Any]:
        """The ``logprobs`` of prompt ``prompt_idx``'s echo (``out``: its output), its text
        offsets from 0; empty if the prompt's never came (the request failed first)."""
        if out.prompt_logprobs is None:
            return shapes.completion_logprobs([], [])
        return shapes.completion_logprobs(
            out.prompt_token_ids, out.prompt_logprobs, first_text=self.first_text[prompt_idx]
        )

    def update(self, out: RequestOutput) -> int:
        """Record ``out``; its prompt's index."""
        index = self._index[out.request_id]
        self._latest[index] = out
        return index

    def choices(self) -> list[tuple[int, int, Any, Any]]:
        """Every choice of the final outputs, in choice order: ``(choice index, prompt
        index, the prompt's output, the choice's completion)``."""
        return sorted(
            (i * self.n + c.index, i, out, c)
            for i, out in enumerate(self._latest)
            for c in out.outputs
        )

    @property
    def unfinished(self) -> list[str]:
        return [rid for rid, o in zip(self.ids, self._latest, strict=True) if not _finished(o)]

    @property
    def all_finished(self) -> bool:
        return all(_finished(o) for o in self._latest)

    def usage(self) -> dict[str, Any]:
        """Each prompt's tokens once (its ``n`` choices share it, as OpenAI counts) and the
        completion tokens of every choice; of the prompt tokens, those read from the prefix
        cache (where looked up)."""
        outs = [o for o in self._latest if o is not None]
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
        completion_tokens = 0
        if not self.echo_only:
            completion_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        cached = [o.num_cached_tokens for o in outs if o.num_cached_tokens is not None]
        return shapes.usage(prompt_tokens, completion_tokens, sum(cached) if cached else None)


def _finished(out: RequestOutput) -> bool:
    return out is not None and out.finished


class ClientGone(Exception):
    """The client of a non-streamed request disconnected: nobody reads the answer."""


class Reader:
    """A non-streamed request's outputs, one at a time; ``ClientGone`` once its client has
    disconnected (checked every ``DISCONNECT_POLL_S``: a long answer nobody reads would hold
    its blocks)."""

    def __init__(self, sink: Sink, request: Request) -> None:
        self.sink = sink
        self.request = request
        self.next_check = time.monotonic() + DISCONNECT_POLL_S

    async def next(self) -> Any:
        get = asyncio.ensure_future(self.sink.queue.get())
        try:
            while True:
                timeout = max(0.0, self.next_check - time.monotonic())
                done, _ = await asyncio.wait({get}, timeout=timeout)
                if time.monotonic() >= self.next_check:
                    self.next_check = time.monotonic() + DISCONNECT_POLL_S
                    if await self.request.is_disconnected():
                        raise ClientGone
                if done:
                    return get.result()
        finally:
            get.cancel()


def checked(item: Any) -> Any:
    """A ``RequestOutput`` from a sink, or the ``ApiError`` its failure means."""
    if isinstance(item, EngineFailure):
        raise ApiError(503, f"the request could not finish: {item}", "service_unavailable")
    for completion in item.outputs:
        if completion.finish_reason == "error":
            message = completion.error or item.error or "the request failed"
            raise ApiError(500, message, "server_error")
    return item


def safe_end(text: str, stops: tuple[str, ...]) -> int:
    """How much of an unfinished ``text`` may be streamed: all but a tail that could be the
    start of a stop string (the engine cuts a stop string out of the text once it is
    whole, so a streamed part of it could not be taken back)."""
    for k in range(min(len(text), max((len(s) for s in stops), default=1) - 1), 0, -1):
        if any(s.startswith(text[-k:]) for s in stops):
            return len(text) - k
    return len(text)
