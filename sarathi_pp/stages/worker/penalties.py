"""Presence, frequency and repetition penalties on the last stage (vLLM's, and HF's
repetition penalty), and the token history they and ``bad_words`` need.

A penalty needs the sequence's tokens, and a bad word of several tokens the output's last
ones, which the last stage does not otherwise keep: a micro-batch carries only the tokens
it computes. ``PenaltyState`` keeps them for those sequences
(``SamplingParams.keeps_tokens``), as vLLM's workers keep a persistent batch:
- the prefill chunk that samples (a prompt's last chunk, or a recompute's) carries the
  tokens before it (``ScheduledChunk.history``): the state restarts from the chunk's end;
- each token sampled is added (at its position: a micro-batch run again after a failure
  leaves the state as one run would);
- a decode finds its tokens there (its input token is the one sampled before);
- ``MicroBatch.released`` names the sequences that have finished: they are forgotten (a
  micro-batch lost on the way hands its ``released`` to the next one:
  ``Scheduler.on_microbatches_lost``).
A replaced stage starts empty; the engine recomputes every sequence it held, and each
recompute's last chunk brings the history again. A decode whose tokens are not there
fails its request alone, naming why (it would be a bug, not a user's mistake).
"""

from __future__ import annotations

import torch

from sarathi_pp.microbatch import MicroBatch, ScheduledChunk
from sarathi_pp.stages.worker.upload import to_device


class PenaltyState:
    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}  # seq_id -> its tokens (prompt + output)

    def release(self, microbatch: MicroBatch) -> None:
        for seq_id in microbatch.released:
            self.tokens.pop(seq_id, None)

    def before_sampling(self, chunk: ScheduledChunk) -> list[int]:
        """The sequence's tokens up to and including ``chunk``'s last (the positions the
        sampled token follows). ``KeyError``/``ValueError`` when they are not known."""
        tokens: list[int] | None
        if chunk.is_prefill:
            tokens = [*chunk.history, *chunk.token_ids]
            if len(tokens) != chunk.end:
                raise ValueError(
                    f"sequence {chunk.seq_id}: {len(chunk.history)} tokens of history before "
                    f"a chunk at {chunk.start}"
                )
            self.tokens[chunk.seq_id] = tokens
            return tokens
        tokens = self.tokens.get(chunk.seq_id)
        if tokens is None or len(tokens) < chunk.end:
            have = 0 if tokens is None else len(tokens)
            raise ValueError(
                f"sequence {chunk.seq_id}: the last stage knows {have} of its tokens, its "
                f"decode at {chunk.start} needs {chunk.end} (penalties and bad words need them)"
            )
        del tokens[chunk.end :]  # a micro-batch run again: the state as after one run
        return tokens

    def sampled(self, chunk: ScheduledChunk, token: int) -> None:
        tokens = self.tokens.get(chunk.seq_id)
        if tokens is not None and len(tokens) == chunk.end:
            tokens.append(token)


def apply_penalties(
    logits: torch.Tensor, rows: list[int], histories: list[list[int]], chunks: list
) -> torch.Tensor:
    """``logits`` with each of ``rows`` penalized by its chunk's ``sampling_params`` over
    its tokens (``histories[i]``: prompt then output; the last ``num_output_tokens`` are
    the output). A new tensor; ``logits`` is left as it was (log-probabilities are
    reported from the raw logits, as vLLM's default)."""
    out = logits.clone()
    vocab = logits.shape[-1]
    for row, tokens, chunk in zip(rows, histories, chunks):
        p = chunk.sampling_params
        num_out = chunk.num_output_tokens
        # token ids the model can have produced, kept on the host (a mask on the device
        # would wait for it), then one copy without a wait
        ids = to_device([t for t in tokens if 0 <= t < vocab], logits.device, torch.long)
        x = out[row]
        if p.repetition_penalty != 1.0 and len(ids):
            seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            seen[ids] = True
            penalized = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
            x = torch.where(seen, penalized, x)
        if (p.frequency_penalty or p.presence_penalty) and num_out:
            output = ids[len(ids) - num_out :] if num_out <= len(ids) else ids
            counts = torch.bincount(output, minlength=vocab).to(x.dtype)
            x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(x.dtype)
        out[row] = x
    return out
