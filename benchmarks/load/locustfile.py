"""Locust user for ``sarathi-pp serve``: streamed ``/v1/completions``, with time to first
token, the time between streamed chunks and the whole request reported as their own request
types (``TTFT``, ``TBT``, ``E2E``) in locust's statistics. Each finished request is also
kept (TTFT, gaps, end to end, tokens by the server's usage) and written as JSON to
``SARATHI_PP_RESULTS`` when locust quits, so the driver computes exact counts and
percentiles (locust's CSV misses requests that finish during ``--stop-timeout``).

Run by ``benchmarks/serve_load.py`` (``make serve-bench``), which sets the environment:
``SARATHI_PP_MODEL`` (the served model name), ``SARATHI_PP_MAX_TOKENS``,
``SARATHI_PP_PROMPTS`` (a file, one prompt a line) and ``SARATHI_PP_CHAT`` (1: chat
completions, each prompt one user turn). Every request is greedy and runs to
``max_tokens`` (``ignore_eos``), so its cost is known.
"""

from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, between, events, task

MODEL = os.environ.get("SARATHI_PP_MODEL", "bench")
MAX_TOKENS = int(os.environ.get("SARATHI_PP_MAX_TOKENS", "32"))
CHAT = os.environ.get("SARATHI_PP_CHAT") == "1"
_PROMPTS_FILE = os.environ.get("SARATHI_PP_PROMPTS")
PROMPTS = (
    [ln.strip() for ln in open(_PROMPTS_FILE).read().splitlines() if ln.strip()]  # noqa: SIM115
    if _PROMPTS_FILE
    else ["Hello, how are you?"]
)
RESULTS: list[dict] = []


@events.quitting.add_listener
def _write_results(environment, **kwargs) -> None:  # noqa: ANN001 - locust's hook
    path = os.environ.get("SARATHI_PP_RESULTS")
    if path:
        with open(path, "w") as f:
            json.dump(RESULTS, f)


class StreamingUser(HttpUser):
    wait_time = between(0.0, 0.2)

    @task
    def completion(self) -> None:
        prompt = random.choice(PROMPTS)
        body: dict = {
            "model": MODEL,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if CHAT:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
        else:
            path, body["prompt"] = "/v1/completions", prompt
        start = time.perf_counter()
        last = None
        ttft, gaps, tokens = None, [], None
        with self.client.post(
            path, json=body, stream=True, catch_response=True, name="completion"
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            for line in resp.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                c = (chunk.get("choices") or [{}])[0]
                text = c.get("text") or (c.get("delta") or {}).get("content")
                if not text:
                    continue
                now = time.perf_counter()
                name, since = ("TTFT", start) if last is None else ("TBT", last)
                self._metric(name, now - since)
                if last is None:
                    ttft = now - start
                else:
                    gaps.append(now - last)
                last = now
            e2e = time.perf_counter() - start
            self._metric("E2E", e2e)
            resp.success()
        RESULTS.append({"ttft": ttft, "gaps": gaps, "e2e": e2e, "tokens": tokens})

    def _metric(self, name: str, seconds: float) -> None:
        self.environment.events.request.fire(
            request_type=name,
            name=name,
            response_time=seconds * 1000.0,
            response_length=0,
            exception=None,
            context={},
        )
