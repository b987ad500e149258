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

from sarathi_pp.engine import LLMEngine, ReplicatedEngine
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
        self._prefix_seen: list[tuple[Any, int, int]] = []  # (stats, queries, hits) each
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
        # Data-parallel replicas (``parallel.data_parallel_size`` > 1): each one's own, by
        # its ``replica`` label; the metrics above are the totals over the live replicas.
        self.replica_up = Gauge(
            "sarathi_pp_replica_up", "1 while the replica serves, 0 once lost", ["replica"],
            registry=r,
        )  # fmt: skip
        self.replica_running = Gauge(
            "sarathi_pp_replica_num_requests_running", "Running requests", ["replica"], registry=r
        )
        self.replica_waiting = Gauge(
            "sarathi_pp_replica_num_requests_waiting", "Waiting requests", ["replica"], registry=r
        )
        self.replica_kv_blocks_used = Gauge(
            "sarathi_pp_replica_kv_blocks_used", "KV blocks in use", ["replica"], registry=r
        )
        self.replica_stage_busy = Counter(
            "sarathi_pp_replica_stage_busy_seconds",
            "Seconds each replica's pipeline stage spent computing micro-batches",
            ["replica", "stage"],
            registry=r,
        )
        self.replica_requests = Counter(
            "sarathi_pp_replica_requests", "Finished requests", ["replica"], registry=r
        )
        self._num_preemptions_seen = 0
        self.vllm = VllmMetrics(r)  # vLLM's names too (``name_model`` labels them)

    def watch_bubbles(self, window: BubbleWindow) -> None:
        """Export the pipeline's bubbles over the last minute, computed at each scrape."""
        self.registry.register(BubbleCollector(window))

    def watch_replica_bubbles(self, windows: list[BubbleWindow]) -> None:
        """Export each replica's pipeline's bubbles by a ``replica`` label."""
        self.registry.register(BubbleCollector(windows, prefix="sarathi_pp_replica"))

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

    def for_replica(self, replica_idx: int) -> Observer:
        """The observer of replica ``replica_idx``'s loop: these metrics, and its own."""
        return _ReplicaObserver(self, str(replica_idx))

    def engine_state(self, engine: LLMEngine | ReplicatedEngine) -> None:
        """The gauges after a step: of the engine, or summed over the live replicas (each
        one's also by its ``replica`` label)."""
        if isinstance(engine, ReplicatedEngine):
            live = engine.router.live
            for i, e in enumerate(engine.engines):
                s = e.scheduler
                up = i in live
                self.replica_up.labels(replica=str(i)).set(int(up))
                self.replica_running.labels(replica=str(i)).set(len(s.running) if up else 0)
                self.replica_waiting.labels(replica=str(i)).set(len(s.waiting) if up else 0)
                used = s.block_manager.num_blocks - s.block_manager.num_free_blocks
                self.replica_kv_blocks_used.labels(replica=str(i)).set(used if up else 0)
            schedulers = [engine.engines[i].scheduler for i in live]
        else:
            schedulers = [engine.scheduler]
        running = sum(len(s.running) for s in schedulers)
        waiting = sum(len(s.waiting) for s in schedulers)
        num_blocks = sum(s.block_manager.num_blocks for s in schedulers)
        used = num_blocks - sum(s.block_manager.num_free_blocks for s in schedulers)
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_blocks_total.set(num_blocks)
        self.kv_blocks_used.set(used)
        num_preemptions = sum(s.num_preemptions for s in schedulers)
        new = max(0, num_preemptions - self._num_preemptions_seen)
        if new:
            self.preemptions.inc(new)
        self._num_preemptions_seen = num_preemptions
        usage = used / num_blocks if num_blocks else 0.0
        self.vllm.state(running, waiting, usage, new)
        # prefix caching: each scheduler's counts (a replica's, or a new one after
        # ``set_scheduler``) as deltas since last seen
        seen = []
        for s in schedulers:
            stats = s.block_manager.stats
            _, queries, hits = next((x for x in self._prefix_seen if x[0] is stats), (stats, 0, 0))
            dq, dh = stats.queries - queries, stats.hits - hits
            self.prefix_queries.inc(dq)
            self.prefix_hits.inc(dh)
            self.vllm.prefix_cache(dq, dh)
            seen.append((stats, stats.queries, stats.hits))
        self._prefix_seen = seen
        self.prefix_cached_blocks.set(sum(s.block_manager.num_cached_blocks for s in schedulers))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ReplicaObserver(Observer):
    """One replica's loop as ``ServerMetrics`` hears it: the totals, and the replica's own."""

    def __init__(self, metrics: ServerMetrics, replica: str) -> None:
        self.metrics, self.replica = metrics, replica

    def completed(
        self, microbatch: Any, result: Any, now: float, wait: float | None = None,
        full: bool | None = None,
    ) -> None:  # fmt: skip
        self.metrics.completed(microbatch, result, now, wait, full)
        for e in result.events:
            busy = max(0.0, e.compute_end - e.compute_start)
            self.metrics.replica_stage_busy.labels(replica=self.replica, stage=str(e.stage)).inc(
                busy
            )

    def finished(self, output: RequestOutput) -> None:
        self.metrics.finished(output)
        self.metrics.replica_requests.labels(replica=self.replica).inc()
