"""The vLLM peer's driver: run with the peer venv's python (``make peer-vllm``), never
imported by the project (it imports only the standard library and vLLM).

    .venv-vllm/bin/python vllm_peer_main.py IN.json OUT.jsonl

``IN.json`` (``PROTOCOL_VERSION``)::

    {"version": 1,
     "settings": {"model": DIR, "pipeline_parallel_size": N, "dtype": "float32",
                  "max_num_batched_tokens": N | null, "block_size": N | null,
                  "max_model_len": N | null, "kv_cache_memory_bytes": N | null, "seed": 0},
     "requests": [{"request_id": "0", "arrival_s": 0.0, "prompt_token_ids": [...],
                   "max_tokens": 64}, ...]}           # greedy, EOS ignored

``OUT.jsonl``, one JSON object a line, appended as the run goes (a reader sees the
requests finished so far even if this process dies)::

    {"type": "hello", "version": 1, "vllm": "0.32.0"}
    {"type": "request", "request_id", "arrival_s", "first_token_s", "token_times_s": [...],
     "token_ids": [...], "finish_reason"}                # times: s since the run's start
    {"type": "done", "wall_s": ...}
    {"type": "error", "kind": "version" | "setting" | "run", "message": ...}

Exit status: 0 done, 3 version mismatch, 4 vLLM refused the settings, 5 the run failed.
vLLM's engine runs in a spawned process: hence the ``__main__`` guard.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

PROTOCOL_VERSION = 1
NUM_WARMUP_TOKENS = 2
WARMUP_PROMPT_LEN = 16
MAX_SLEEP_S = 0.01


class _Out:
    def __init__(self, path: str) -> None:
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


def _engine(settings: dict[str, Any]) -> Any:
    from vllm import EngineArgs, LLMEngine

    pp = int(settings.get("pipeline_parallel_size") or 1)
    kwargs: dict[str, Any] = {
        "model": settings["model"],
        "skip_tokenizer_init": True,  # token ids in and out
        "pipeline_parallel_size": pp,
        "dtype": settings.get("dtype") or "auto",
        "enable_prefix_caching": bool(settings.get("enable_prefix_caching", False)),
        "seed": int(settings.get("seed") or 0),
    }
    keys = ("max_num_batched_tokens", "block_size", "max_model_len", "kv_cache_memory_bytes")
    for key in keys:
        if settings.get(key) is not None:
            kwargs[key] = settings[key]
    if pp > 1:
        kwargs["distributed_executor_backend"] = "mp"
    return LLMEngine.from_engine_args(EngineArgs(**kwargs))


def _params(max_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)


def _drain(engine: Any) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def _serve(engine: Any, requests: list[dict[str, Any]], out: _Out) -> None:
    order = sorted(requests, key=lambda r: r["arrival_s"])
    prompt = order[0]["prompt_token_ids"][:WARMUP_PROMPT_LEN]
    engine.add_request("peer-warmup", {"prompt_token_ids": prompt}, _params(NUM_WARMUP_TOKENS))
    _drain(engine)
    times: dict[str, list[float]] = {r["request_id"]: [] for r in order}
    start = time.monotonic()
    next_idx = done = 0
    while done < len(order):
        now = time.monotonic() - start
        while next_idx < len(order) and order[next_idx]["arrival_s"] <= now:
            r = order[next_idx]
            engine.add_request(
                r["request_id"], {"prompt_token_ids": r["prompt_token_ids"]},
                _params(r["max_tokens"]), arrival_time=time.time(),
            )  # fmt: skip
            next_idx += 1
        if not engine.has_unfinished_requests():
            if next_idx < len(order):
                wait = order[next_idx]["arrival_s"] - (time.monotonic() - start)
                time.sleep(min(max(wait, 0.0), MAX_SLEEP_S))
            continue
        outputs = engine.step()
        now = time.monotonic() - start
        for o in outputs:
            seen = times[o.request_id]
            seen.extend([now] * (len(o.outputs[0].token_ids) - len(seen)))
            if o.finished:
                done += 1
                out.write(_request_record(o, times, order))


def _request_record(o: Any, times: dict[str, list[float]], order: list[dict]) -> dict[str, Any]:
    r = next(r for r in order if r["request_id"] == o.request_id)
    token_times = times[o.request_id]
    return {
        "type": "request",
        "request_id": o.request_id,
        "arrival_s": r["arrival_s"],
        "first_token_s": token_times[0] if token_times else None,
        "token_times_s": token_times,
        "token_ids": list(o.outputs[0].token_ids),
        "finish_reason": o.outputs[0].finish_reason,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: vllm_peer_main.py IN.json OUT.jsonl", file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as f:
        message = json.load(f)
    out = _Out(argv[2])
    if message.get("version") != PROTOCOL_VERSION:
        out.write({
            "type": "error", "kind": "version",
            "message": f"protocol version {message.get('version')!r} sent; this peer speaks "
            f"{PROTOCOL_VERSION}",
        })  # fmt: skip
        return 3
    try:
        import vllm

        engine = _engine(message["settings"])
    except Exception as e:  # vLLM's config validation: named in its message
        out.write({"type": "error", "kind": "setting", "message": f"{type(e).__name__}: {e}"})
        return 4
    out.write({"type": "hello", "version": PROTOCOL_VERSION, "vllm": vllm.__version__})
    wall = time.monotonic()
    try:
        _serve(engine, message["requests"], out)
    except Exception as e:
        out.write({"type": "error", "kind": "run", "message": f"{type(e).__name__}: {e}"})
        return 5
    out.write({"type": "done", "wall_s": time.monotonic() - wall})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
