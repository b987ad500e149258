"""vLLM's metric names on ``/metrics``, beside ours (``metrics.py``), for the concepts both
have: dashboards and autoscalers keyed on vLLM's names find them. Names, types and the
``model_name`` label as vLLM v0.10's ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``);
a Counter ``vllm:x`` is exposed as ``vllm:x_total``.

Not exported (no such concept here): prefix-cache queries and hits, speculative decoding,
LoRA, the iteration-token histograms. ``vllm:gpu_cache_usage_perc`` is vLLM's older name of
``vllm:kv_cache_usage_perc`` (still what many dashboards read), exported as well.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from sarathi_pp.outputs import RequestOutput

# vLLM's buckets (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class VllmMetrics:
    """vLLM's metrics of one served model (``model_name``: its first served name)."""

    def __init__(self, registry: CollectorRegistry, model_name: str = "") -> None:
        r, label = registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, label, registry=r, multiprocess_mode="mostrecent")

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, label, buckets=buckets, registry=r)

        self._gauges = {
            "running": gauge("vllm:num_requests_running", "Requests in model execution"),
            "waiting": gauge("vllm:num_requests_waiting", "Requests waiting to be processed"),
            "kv": gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = 100%)"),
            "gpu_kv": gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (1 = 100%; old name)"),
        }
        self._counters = {
            "preemptions": Counter("vllm:num_preemptions", "Preemptions", label, registry=r),
            "prompt": Counter("vllm:prompt_tokens", "Prefill tokens processed", label, registry=r),
            "generation": Counter(
                "vllm:generation_tokens", "Generation tokens processed", label, registry=r
            ),
            "prefix_queries": Counter(
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in queried tokens",
                label,
                registry=r,
            ),
            "prefix_hits": Counter(
                "vllm:prefix_cache_hits", "Prefix cache hits, in cached tokens", label, registry=r
            ),
        }
        self._success = Counter(
            "vllm:request_success", "Finished requests", [*label, "finished_reason"], registry=r
        )
        self._histograms = {
            "ttft": histogram(
                "vllm:time_to_first_token_seconds", "Time to first token", _TTFT_BUCKETS
            ),  # fmt: skip
            "itl": histogram(
                "vllm:inter_token_latency_seconds", "Inter-token latency", _TOKEN_BUCKETS
            ),  # fmt: skip
            "tpot": histogram(
                "vllm:time_per_output_token_seconds",
                "Time per output token (vLLM's older inter-token name)",
                _TOKEN_BUCKETS,
            ),  # fmt: skip
            "e2e": histogram(
                "vllm:e2e_request_latency_seconds", "End-to-end request latency", _REQUEST_BUCKETS
            ),  # fmt: skip
            "queue": histogram(
                "vllm:request_queue_time_seconds", "Time waiting in the queue", _REQUEST_BUCKETS
            ),  # fmt: skip
            "prefill": histogram(
                "vllm:request_prefill_time_seconds", "Time in the prefill phase", _REQUEST_BUCKETS
            ),  # fmt: skip
            "decode": histogram(
                "vllm:request_decode_time_seconds", "Time in the decode phase", _REQUEST_BUCKETS
            ),  # fmt: skip
            "inference": histogram(
                "vllm:request_inference_time_seconds",
                "Time from first scheduled to finished",
                _REQUEST_BUCKETS,
            ),  # fmt: skip
            "prompt_len": histogram(
                "vllm:request_prompt_tokens", "Prompt tokens per request", _COUNT_BUCKETS
            ),  # fmt: skip
            "output_len": histogram(
                "vllm:request_generation_tokens", "Generated tokens per request", _COUNT_BUCKETS
            ),  # fmt: skip
        }
        self.model_name = model_name
        if model_name:
            self.name_model(model_name)

    def name_model(self, model_name: str) -> None:
        """Label everything ``model_name`` from here on (every series shows at once, at 0)."""
        self.model_name = model_name
        for metric in (*self._gauges.values(), *self._counters.values(),
                       *self._histograms.values()):  # fmt: skip
            metric.labels(model_name=model_name)

    def _h(self, key: str) -> Any:
        return self._histograms[key].labels(model_name=self.model_name)

    def finished(self, out: RequestOutput, completion: Any) -> None:
        """One finished engine request (``completion``: its one completion)."""
        name = self.model_name
        reason = completion.finish_reason or "unknown"
        self._success.labels(model_name=name, finished_reason=reason).inc()
        self._counters["prompt"].labels(model_name=name).inc(len(out.prompt_token_ids))
        self._counters["generation"].labels(model_name=name).inc(len(completion.token_ids))
        self._h("prompt_len").observe(len(out.prompt_token_ids))
        self._h("output_len").observe(len(completion.token_ids))
        m = out.metrics
        if m.ttft is not None:
            self._h("ttft").observe(m.ttft)
        for gap in m.tbt:
            self._h("itl").observe(gap)
            self._h("tpot").observe(gap)
        if m.e2e_latency is not None:
            self._h("e2e").observe(m.e2e_latency)
        if m.scheduling_delay is not None:
            self._h("queue").observe(m.scheduling_delay)
        scheduled, first, end = m.first_scheduled_time, m.first_token_time, m.finished_time
        if scheduled is not None and first is not None:
            self._h("prefill").observe(max(0.0, first - scheduled))
        if first is not None and end is not None:
            self._h("decode").observe(max(0.0, end - first))
        if scheduled is not None and end is not None:
            self._h("inference").observe(max(0.0, end - scheduled))

    def prefix_cache(self, new_queries: int, new_hits: int) -> None:
        """Prompt tokens looked up in the prefix cache, and found, since the last call."""
        name = self.model_name
        self._counters["prefix_queries"].labels(model_name=name).inc(new_queries)
        self._counters["prefix_hits"].labels(model_name=name).inc(new_hits)

    def state(self, running: int, waiting: int, kv_usage: float, new_preemptions: int) -> None:
        """After an engine step: the queues, the KV cache's used fraction, preemptions since."""
        name = self.model_name
        self._gauges["running"].labels(model_name=name).set(running)
        self._gauges["waiting"].labels(model_name=name).set(waiting)
        self._gauges["kv"].labels(model_name=name).set(kv_usage)
        self._gauges["gpu_kv"].labels(model_name=name).set(kv_usage)
        if new_preemptions:
            self._counters["preemptions"].labels(model_name=name).inc(new_preemptions)
