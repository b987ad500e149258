"""``GET /metrics``: the server's Prometheus metrics, in a registry of their own (two servers
in one process, as in the tests, never share or collide).

Updated by the engine thread only, as an observer of the engine loop
(``records/observer.py``): ``finished`` per finished engine request, ``completed`` per
micro-batch (each stage's compute time); and ``engine_state`` after every step (gauges read
from the scheduler there, never from the HTTP thread). The bubble gauges
(``bubble_window``) are computed at each scrape from the last minute's records. vLLM's names
for the concepts both have are exported beside ours (``vllm_metrics.py``).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sarathi_pp.engine import LLMEngine
from sarathi_pp.outputs import RequestOutput
from sarathi_pp.records.observer import Observer
from sarathi_pp.serve.bubble_window import BubbleCollector, BubbleWindow
from sarathi_pp.serve.vllm_metrics import VllmMetrics

# Seconds; a tiny CPU model answers in milliseconds, a large one in tens of seconds.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics(Observer):
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "sarathi_pp_requests", "Finished requests", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter("sarathi_pp_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "sarathi_pp_generation_tokens", "Generated tokens", registry=r
        )
        self.ttft = Histogram(
            "sarathi_pp_time_to_first_token_seconds",
            "Time to first token (arrival to first token)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tbt = Histogram(
            "sarathi_pp_time_between_tokens_seconds",
            "Time between consecutive generated tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "sarathi_pp_e2e_request_latency_seconds",
            "End-to-end request latency (arrival to finish)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge("sarathi_pp_num_requests_running", "Running requests", registry=r)
        self.waiting = Gauge("sarathi_pp_num_requests_waiting", "Waiting requests", registry=r)
        self.kv_blocks_used = Gauge("sarathi_pp_kv_blocks_used", "KV blocks in use", registry=r)
        self.kv_blocks_total = Gauge("sarathi_pp_kv_blocks_total", "KV blocks", registry=r)
        self.preemptions = Counter("sarathi_pp_preemptions", "Preemptions", registry=r)
        self.prefix_queries = Counter(
            "sarathi_pp_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (each prefill start)",
            registry=r,
        )
        self.prefix_hits = Counter(
            "sarathi_pp_prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r
        )
        self.prefix_cached_blocks = Gauge(
            "sarathi_pp_prefix_cache_blocks", "KV blocks findable by content", registry=r
        )
        self._prefix_seen: tuple[Any, int, int] = (None, 0, 0)  # (stats, queries, hits)
        # Per pipeline stage; under load, 1 - rate(busy) is the stage's bubble fraction.
        self.stage_busy = Counter(
            "sarathi_pp_stage_busy_seconds",
            "Seconds each pipeline stage spent computing micro-batches",
            ["stage"],
            registry=r,
        )
        self.stage_microbatches = Counter(
            "sarathi_pp_stage_microbatches", "Micro-batches each stage ran", ["stage"], registry=r
        )
        # Structured output on the last stage (on the pipeline's critical path): mask time
        # per constrained token is rate(seconds) / rate(masks)
        self.grammar_masks = Counter(
            "sarathi_pp_grammar_masks", "Token masks applied for structured output", registry=r
        )
        self.grammar_mask_seconds = Counter(
            "sarathi_pp_grammar_mask_seconds",
            "Seconds the last stage spent computing and applying structured output's masks",
            registry=r,
        )
        self._num_preemptions_seen = 0
        self.vllm = VllmMetrics(r)  # vLLM's names too (``name_model`` labels them)

    def watch_bubbles(self, window: BubbleWindow) -> None:
        """Export the pipeline's bubbles over the last minute, computed at each scrape."""
        self.registry.register(BubbleCollector(window))

    def finished(self, out: RequestOutput) -> None:
        """One finished engine request's ``RequestOutput`` (each completion of ``n > 1`` is
        its own engine request, as vLLM counts them)."""
        completion = out.outputs[0]
        self.requests.labels(finish_reason=completion.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(completion.token_ids))
        m = out.metrics
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        for gap in m.tbt:
            self.tbt.observe(gap)
        if m.e2e_latency is not None:
            self.e2e.observe(m.e2e_latency)
        self.vllm.finished(out, completion)

    # --- as an observer of the engine loop (``LLMEngine.add_observer``) ------------------
    def completed(
        self, microbatch: Any, result: Any, now: float, wait: float | None = None,
        full: bool | None = None,
    ) -> None:  # fmt: skip
        """A micro-batch's tokens are back: every stage's timing of it."""
        self.stage_events(result.events)
        if result.num_grammar_masks:
            self.grammar_masks.inc(result.num_grammar_masks)
            self.grammar_mask_seconds.inc(result.grammar_mask_s)

    def stage_events(self, events: Any) -> None:
        """The ``StageEvent``s of one completed micro-batch (one per stage)."""
        for e in events:
            stage = str(e.stage)
            self.stage_busy.labels(stage=stage).inc(max(0.0, e.compute_end - e.compute_start))
            self.stage_microbatches.labels(stage=stage).inc()

    def engine_state(self, engine: LLMEngine) -> None:
        scheduler = engine.scheduler
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        blocks = scheduler.block_manager
        self.kv_blocks_total.set(blocks.num_blocks)
        self.kv_blocks_used.set(blocks.num_blocks - blocks.num_free_blocks)
        num_preemptions = scheduler.num_preemptions
        new = max(0, num_preemptions - self._num_preemptions_seen)
        if new:
            self.preemptions.inc(new)
        self._num_preemptions_seen = num_preemptions
        used = blocks.num_blocks - blocks.num_free_blocks
        usage = used / blocks.num_blocks if blocks.num_blocks else 0.0
        self.vllm.state(len(scheduler.running), len(scheduler.waiting), usage, new)
        stats, queries, hits = self._prefix_seen
        if stats is not blocks.stats:  # a new scheduler (``set_scheduler``): counts anew
            stats, queries, hits = blocks.stats, 0, 0
        dq, dh = stats.queries - queries, stats.hits - hits
        self.prefix_queries.inc(dq)
        self.prefix_hits.inc(dh)
        self.vllm.prefix_cache(dq, dh)
        self.prefix_cached_blocks.set(blocks.num_cached_blocks)
        self._prefix_seen = (stats, stats.queries, stats.hits)

    def render(self) -> bytes:
        return generate_latest(self.registry)
