"""OpenAI's response shapes, built as plain dicts: completion and chat responses, their
streamed chunks, usage, log-probabilities, and the tokenizer's answer (the requests are
``protocol.py``'s)."""

from __future__ import annotations

import time
from typing import Any

from sarathi_pp.outputs import Logprob, PromptLogprobs, SampleLogprobs

# OpenAI's JSON has no -inf: a log-probability below this is sent as this (as vLLM).
MIN_LOGPROB = -9999.0


def tokenize_response(
    tokens: list[int], max_model_len: int, token_strs: list[str] | None
) -> dict[str, Any]:
    return {
        "count": len(tokens),
        "max_model_len": max_model_len,
        "tokens": tokens,
        "token_strs": token_strs,
    }


def usage(
    num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int | None = None
) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` where the prompts
    were looked up in the prefix cache."""
    out: dict[str, Any] = {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
    }
    if num_cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens}
    return out


def _envelope(
    request_id: str,
    obj: str,
    model: str,
    choices: list[dict[str, Any]],
    use: dict[str, int] | None,
) -> dict[str, Any]:
    """OpenAI's response (or chunk) around ``choices`` (each with its ``index`` and
    ``finish_reason``)."""
    return {
        "id": request_id,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [{"logprobs": None, **c} for c in choices],
        "usage": use,
    }


def _choice(index: int, body: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, **body, "finish_reason": finish_reason}


def completion_response(
    request_id: str, model: str, choices: list[dict[str, Any]], use: dict[str, int]
) -> dict[str, Any]:
    """``choices``: each choice's ``{"text", "finish_reason", "logprobs"}``, in order."""
    return _envelope(request_id, "text_completion", model, _indexed(choices), use)


def chat_response(
    request_id: str, model: str, choices: list[dict[str, Any]], use: dict[str, int]
) -> dict[str, Any]:
    """``choices``: each choice's ``{"text", "finish_reason", "logprobs"}``, in order."""
    messages = [
        {
            "message": {"role": "assistant", "content": c["text"]}
            | ({"tool_calls": c["tool_calls"]} if c.get("tool_calls") else {}),
            "finish_reason": c["finish_reason"],
            "logprobs": c["logprobs"],
        }
        for c in choices
    ]
    out = _envelope(request_id, "chat.completion", model, _indexed(messages), use)
    if choices and "prompt_logprobs" in choices[0]:  # vLLM's: one prompt, at the top
        out["prompt_logprobs"] = choices[0]["prompt_logprobs"]
    return out


def _indexed(choices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"index": i, **c} for i, c in enumerate(choices)]


def completion_chunk(
    request_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice = _choice(index, {"text": text, "logprobs": logprobs}, finish_reason)
    return _envelope(request_id, "text_completion", model, [choice], None)


def chat_chunk(
    request_id: str,
    model: str,
    delta: dict[str, str],
    finish_reason: str | None,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice = _choice(index, {"delta": delta, "logprobs": logprobs}, finish_reason)
    return _envelope(request_id, "chat.completion.chunk", model, [choice], None)


# --- log-probabilities ---------------------------------------------------------------------
def _token_text(token_id: int, entry: Logprob) -> str:
    # Without a tokenizer the token has no text: vLLM's "token_id:<id>" spelling.
    return entry.decoded_token if entry.decoded_token is not None else f"token_id:{token_id}"


def _clamped(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[dict[int, Logprob] | None],
    text_offset: int = 0,
    first_text: str = "",
) -> dict[str, Any]:
    """OpenAI's completion ``logprobs`` over ``token_ids`` (one ``logprobs`` entry each):
    each token's text, log-probability, the most likely tokens' (``{text: logprob}``) and
    where its text starts, counted from ``text_offset``. An echoed prompt's first token has
    no entry (``None``: nothing precedes it): its text is ``first_text``, its values null."""
    out: dict[str, list] = {
        "text_offset": [],
        "token_logprobs": [],
        "tokens": [],
        "top_logprobs": [],
    }
    for token_id, entry in zip(token_ids, logprobs, strict=True):
        out["text_offset"].append(text_offset)
        if entry is None:
            text = first_text
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            text = _token_text(token_id, entry[token_id])
            out["token_logprobs"].append(_clamped(entry[token_id].logprob))
            out["top_logprobs"].append(
                {_token_text(t, e): _clamped(e.logprob) for t, e in entry.items()}
            )
        out["tokens"].append(text)
        text_offset += len(text)
    return out


def joined_logprobs(a: dict[str, Any], b: dict[str, Any] | None) -> dict[str, Any]:
    """Two completion ``logprobs`` objects as one (an echoed prompt's, then its tokens')."""
    return a if b is None else {k: a[k] + b[k] for k in a}


def prompt_logprobs_json(plp: PromptLogprobs | None) -> list[Any] | None:
    """vLLM's ``prompt_logprobs`` field: per prompt token ``null`` (the first) or
    ``{token_id: {"logprob", "rank", "decoded_token"}}``, the prompt's token first."""
    if plp is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): {
                "logprob": _clamped(e.logprob),
                "rank": e.rank,
                "decoded_token": e.decoded_token,
            }
            for t, e in entry.items()
        }
        for entry in plp
    ]


def chat_logprobs(token_ids: list[int], logprobs: SampleLogprobs, top: int) -> dict[str, Any]:
    """OpenAI's chat ``logprobs``: ``{"content": [...]}``, one item per token with its
    ``top`` most likely tokens (most likely first)."""

    def item(token_id: int, e: Logprob) -> dict[str, Any]:
        text = _token_text(token_id, e)
        return {"token": text, "logprob": _clamped(e.logprob), "bytes": list(text.encode())}

    content = []
    for token_id, entry in zip(token_ids, logprobs, strict=True):
        ranked = sorted(
            ((t, e) for t, e in entry.items() if e.rank is not None and e.rank <= top),
            key=lambda te: te[1].rank or 0,
        )
        content.append(
            {**item(token_id, entry[token_id]), "top_logprobs": [item(t, e) for t, e in ranked]}
        )
    return {"content": content}
