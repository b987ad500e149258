"""``SamplingParams.n > 1``: one prompt, ``n`` completions, as vLLM V1 does it.

The engine runs sequences of ``n == 1``; a request of ``n`` completions is a
``ParentRequest`` of ``n`` engine requests ("child" requests, ids ``"{j}_{request_id}"`` as
in vLLM's ``ParentRequest``), each with ``n=1`` and, when the request has a ``seed``,
``seed + j`` (so the completions differ and a rerun repeats them; without a seed the engine
seeds each child from ``model.seed`` and its own arrival order). The engine's output side
merges the children's outputs into one ``RequestOutput`` of the parent (``merge``), its
completion ``j`` child ``j``'s, every time one of them has news: ``LLMEngine.step`` hands
out the parent's, never a child's. The prompt is prefilled once per child (no prefix
sharing: the KV cache has no copy-on-write blocks). Each child is its own row in the run's
records (``requests.csv``), as it is its own sequence in the scheduler.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from sarathi_pp.outputs import CompletionOutput, RequestMetrics, RequestOutput
from sarathi_pp.sampling_params import SamplingParams


def child_requests(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """The engine requests of ``request_id``: itself when ``params.n == 1``."""
    if params.n == 1:
        return [(request_id, params)]
    return [
        (
            f"{j}_{request_id}",
            dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + j),
        )
        for j in range(params.n)
    ]


class ParentRequest:
    """A request of ``n > 1`` completions: its children's ids, and their latest outputs."""

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.children = child_requests(request_id, params)
        self.child_ids = [child_id for child_id, _ in self.children]
        self._latest: dict[str, RequestOutput] = {}
        self._wants_logprobs = params.logprobs is not None

    def update(self, child: RequestOutput) -> RequestOutput:
        """The parent's output with ``child``'s news: every completion so far (a child with
        no output yet is an empty, unfinished completion), finished when every child is."""
        self._latest[child.request_id] = child
        outputs = [self._latest.get(c) or self._empty(c, child) for c in self.child_ids]
        return merge(self.request_id, outputs)

    @property
    def finished(self) -> bool:
        return len(self._latest) == len(self.child_ids) and all(
            o.finished for o in self._latest.values()
        )

    def _empty(self, child_id: str, like: RequestOutput) -> RequestOutput:
        completion = CompletionOutput(
            0, "", [], None, logprobs=[] if self._wants_logprobs else None
        )
        metrics = RequestMetrics(arrival_time=like.metrics.arrival_time)
        return RequestOutput(
            child_id, like.prompt, like.prompt_token_ids, [completion], False, metrics
        )


def merge(request_id: str, children: list[RequestOutput]) -> RequestOutput:
    """One output of ``request_id`` from its children's (in child order): completion ``j``
    is child ``j``'s, with ``index=j``. Its metrics span the children: the request arrived
    once, its first token is the first of any completion, it finishes with the last one,
    and its token times are all of theirs in time order (the gaps a client streaming every
    completion would see)."""
    if len(children) == 1 and children[0].request_id == request_id:
        return children[0]
    completions = [dataclasses.replace(c.outputs[0], index=j) for j, c in enumerate(children)]
    ms = [c.metrics for c in children]
    finished = all(c.finished for c in children)
    metrics = RequestMetrics(
        arrival_time=min(m.arrival_time for m in ms),
        first_scheduled_time=_earliest(m.first_scheduled_time for m in ms),
        first_token_time=_earliest(m.first_token_time for m in ms),
        finished_time=_latest(m.finished_time for m in ms) if finished else None,
        token_times=sorted(t for m in ms for t in m.token_times),
        num_preemptions=sum(m.num_preemptions for m in ms),
        # the prompt is computed once at least: what its least lucky child read cached
        num_cached_tokens=min(
            (m.num_cached_tokens for m in ms if m.num_cached_tokens is not None), default=None
        ),
    )
    errors = [c.error for c in children if c.error]
    first = children[0]
    return RequestOutput(
        request_id=request_id,
        prompt=first.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=completions,
        finished=finished,
        metrics=metrics,
        error="; ".join(errors) if errors else None,
        # every child computes the same prompt: the first that has it all
        prompt_logprobs=next(
            (c.prompt_logprobs for c in children if c.prompt_logprobs is not None), None
        ),
    )


def _earliest(times: Iterable[float | None]) -> float | None:
    known = [t for t in times if t is not None]
    return min(known) if known else None


def _latest(times: Iterable[float | None]) -> float | None:
    known = [t for t in times if t is not None]
    return max(known) if known else None
