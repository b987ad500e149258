"""``SamplingParams.n > 1``: one prompt, ``n`` completions, as vLLM V1 does it.

The engine runs sequences of ``n == 1``; a request of ``n`` completions is ``n`` engine
requests ("child" requests, ids ``"{j}_{request_id}"`` as in vLLM's ``ParentRequest``),
each with ``n=1`` and, when the request has a ``seed``, ``seed + j`` (so the completions
differ and a rerun repeats them; without a seed the engine seeds each child from
``model.seed`` and its own arrival order). ``LLM.generate`` merges the children's final
outputs into one ``RequestOutput`` (``merge``); the server answers each child as its own
choice. The prompt is prefilled once per child (no prefix sharing: the KV cache has no
copy-on-write blocks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from sarathi_pp.outputs import RequestMetrics, RequestOutput
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
