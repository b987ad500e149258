"""Token sampling on the last stage: greedy, temperature, min-p, top-k, top-p, per-request seed.

Greedy rows are one batched argmax. Random rows are filtered and sampled in one batch; a
request with a ``seed`` draws from its own generator keyed by (seed, output index), so its
tokens do not depend on what else is in the batch or on preemption. A row whose logits are
not finite yields ``INVALID_TOKEN`` so the engine fails that request alone.

``logprobs`` gives the rows that ask for them (``SamplingParams.logprobs``) their sampled
token's log-probability and rank and the most likely tokens', from the raw logits (vLLM's
default: before temperature, top-k and top-p), one batched ``log_softmax`` and ``topk``;
``target_logprobs`` the same for the prompt tokens a prefill chunk's rows predict
(``SamplingParams.prompt_logprobs``).
"""

from __future__ import annotations

import torch

from sarathi_pp.microbatch import TokenLogprobs
from sarathi_pp.sampling_params import SamplingParams
from sarathi_pp.stages.worker.upload import to_device

INVALID_TOKEN = -1


def sample(logits: torch.Tensor, params: list[SamplingParams], num_outputs: list[int]) -> list[int]:
    """``logits``: float32 ``[num_rows, vocab]``, one row per sampled sequence."""
    return tokens_to_host(sample_on_device(logits, params, num_outputs))


def tokens_to_host(tokens: torch.Tensor) -> list:
    """The step's one wait for the device: the sampled tokens (and what rides with them)
    copied to the host (Note [one upload per micro-batch] in ``upload.py``)."""
    return tokens.tolist()


def sample_on_device(
    logits: torch.Tensor, params: list[SamplingParams], num_outputs: list[int]
) -> torch.Tensor:
    """``sample``'s tokens ``[num_rows]`` (int64), left on the device."""
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if random_rows:
        idx = to_device(random_rows, logits.device)
        probs = _filtered_probs(logits[idx], [params[i] for i in random_rows])
        tokens[idx] = _draw(
            probs, [params[i] for i in random_rows], [num_outputs[i] for i in random_rows]
        )
    bad = ~torch.isfinite(logits).all(dim=-1)
    # where, not tokens[bad] = ...: boolean indexing would wait for the device (nonzero)
    return torch.where(bad, INVALID_TOKEN, tokens)


def processed_logits(
    logits: torch.Tensor,
    params: list[SamplingParams],
    num_outputs: list[int],
    eos_token_ids: tuple[int, ...],
    in_place: bool = False,
    outputs: dict[int, list[int]] | None = None,
) -> torch.Tensor:
    """Tokens outside ``allowed_token_ids`` and the bad words' ruled out (vLLM's: a bad
    word's last token where the row's output so far, ``outputs[i]``, ends with the tokens
    before it), ``logit_bias`` added, and the EOS and stop tokens ruled out while a row has
    fewer than ``min_tokens`` outputs (vLLM's). ``logits`` itself when no row asks, else a
    copy (log-probabilities are reported from the raw logits); ``in_place``: ``logits`` is
    the caller's own copy already (penalized), changed and returned. A token is ruled out
    with the lowest finite value: -inf would read as the model's own failure."""
    rows = [
        i for i, p in enumerate(params)
        if p.logit_bias or num_outputs[i] < p.min_tokens or p.allowed_token_ids is not None
        or p.bad_words_token_ids
    ]  # fmt: skip
    if not rows:
        return logits
    out = logits if in_place else logits.clone()
    vocab = logits.shape[-1]
    lowest = torch.finfo(out.dtype).min
    dev = logits.device
    for i in rows:
        p = params[i]
        # ids past the vocabulary are refused by the engine; a stage never indexes past it
        if p.allowed_token_ids is not None:
            keep = torch.zeros(vocab, dtype=torch.bool, device=dev)
            keep[to_device([t for t in p.allowed_token_ids if t < vocab], dev, torch.long)] = True
            out[i].masked_fill_(~keep, lowest)
        if p.bad_words_token_ids:
            past = (outputs or {}).get(i, [])
            banned = [
                w[-1] for w in p.bad_words_token_ids
                if w[-1] < vocab and _ends_with(past, w[:-1])
            ]  # fmt: skip
            if banned:
                out[i, to_device(banned, dev)] = lowest
        if p.logit_bias:
            kept = [(t, b) for t, b in p.logit_bias.items() if t < vocab]  # on the host
            if kept:
                ids = to_device([t for t, _ in kept], dev)
                bias = to_device([b for _, b in kept], dev)
                out[i, ids] += bias.to(out.dtype)
        if num_outputs[i] < p.min_tokens:
            stops = [t for t in (*eos_token_ids, *p.stop_token_ids) if t < vocab]
            if stops:
                out[i, to_device(stops, dev)] = lowest
    return out


def _ends_with(tokens: list[int], suffix: tuple[int, ...]) -> bool:
    n = len(suffix)
    return n <= len(tokens) and (n == 0 or tuple(tokens[-n:]) == suffix)


def logprobs(
    logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]
) -> dict[int, TokenLogprobs]:
    """Row index -> the log-probabilities of its sampled token, for each row whose
    ``params`` ask for them and whose token is valid."""
    rows = [
        i for i, p in enumerate(params) if p.logprobs is not None and tokens[i] != INVALID_TOKEN
    ]
    if not rows:
        return {}
    idx = to_device(rows, logits.device)
    k = max(params[i].logprobs or 0 for i in rows)
    out = {}
    for i, lp in zip(rows, _ranked(logits[idx], [tokens[i] for i in rows], k)):
        n = params[i].logprobs or 0
        out[i] = TokenLogprobs(lp.logprob, lp.rank, lp.top_ids[:n], lp.top_logprobs[:n])
    return out


def target_logprobs(
    logits: torch.Tensor, targets: list[int], k: int
) -> tuple[TokenLogprobs, ...] | None:
    """Row ``i``'s log-probability and rank of ``targets[i]`` and its ``k`` most likely
    tokens (``SamplingParams.prompt_logprobs``: row ``i`` predicts prompt token ``i + 1``),
    from raw logits; ``None`` when a row's logits are not finite."""
    if not torch.isfinite(logits).all():
        return None
    return _ranked(logits, targets, k)


def _ranked(logits: torch.Tensor, chosen: list[int], k: int) -> tuple[TokenLogprobs, ...]:
    """Per row: ``chosen[i]``'s log-probability and rank, and the ``k`` most likely
    tokens', from one batched ``log_softmax`` and ``topk``."""
    lp = logits.float().log_softmax(dim=-1)
    ids = to_device(chosen, logits.device).unsqueeze(1)
    chosen_lp = lp.gather(1, ids)
    ranks = (lp > chosen_lp).sum(dim=-1) + 1
    top_lp, top_ids = lp.topk(k, dim=-1)
    return tuple(
        TokenLogprobs(value, rank, tuple(t_ids), tuple(t_lps))
        for value, rank, t_ids, t_lps in zip(
            chosen_lp[:, 0].tolist(), ranks.tolist(), top_ids.tolist(), top_lp.tolist()
        )
    )


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    dev = logits.device
    temperature = to_device([p.temperature for p in params], dev).unsqueeze(1)
    logits = logits / temperature
    if any(p.min_p > 0 for p in params):  # as vLLM: after temperature, before top-k/top-p
        probs = logits.softmax(dim=-1)
        min_p = to_device([p.min_p for p in params], dev).unsqueeze(1)
        floor = min_p * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    top_k = to_device([p.top_k or vocab for p in params], dev).unsqueeze(1)
    ranks = torch.arange(vocab, device=dev).unsqueeze(0)
    drop = ranks >= top_k
    probs_sorted = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    top_p = to_device([p.top_p for p in params], dev).unsqueeze(1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
    drop |= mass_before >= top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits.softmax(dim=-1))


def _draw(
    probs: torch.Tensor, params: list[SamplingParams], num_outputs: list[int]
) -> torch.Tensor:
    probs = torch.nan_to_num(probs, nan=0.0)
    ok = probs.sum(dim=-1) > 0
    safe = torch.where(ok.unsqueeze(1), probs, torch.ones_like(probs))
    out = torch.multinomial(safe, 1).squeeze(1)
    for i, p in enumerate(params):
        if p.seed is not None:
            g = torch.Generator(device=probs.device).manual_seed(_seed(p.seed, num_outputs[i]))
            out[i] = torch.multinomial(safe[i], 1, generator=g)[0]
    return out


def _seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index) % (2**63 - 1)
