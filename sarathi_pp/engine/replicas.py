"""``ReplicatedEngine``: ``parallel.data_parallel_size`` copies of the pipeline behind one
router, with the engine's face (what ``LLM``, the server's engine loop and the benchmark
call), so the front ends run one engine or several alike (``create_engine``).

Why N engines and not N pipelines inside one: each replica is a whole ``LLMEngine`` (its
executor and stage actors, its scheduler, block manager and run-dir recorder), so a
replica runs, fails and recovers exactly as a lone engine does, the simulator's replicas
(``sim/cluster.py``) are the same object, and nothing in the scheduler learns about
replicas. What they share: the router (``sarathi_pp/routing.py``), one sequence-id counter
(a request's seed derived from ``model.seed`` is its order of arrival at the router, so it
does not depend on the replica) and the tokenizer's view (replica 0's input processor
checks and renders every request once; the chosen replica queues it).

Stepping: ``step`` first issues what every replica can issue, then steps the replica whose
oldest micro-batch is done first (``_next``): the others' micro-batches run meanwhile on
their own actors, and none waits on another's slower step.

Failure: a replica whose stage is lost is recovered by its own engine (``engine/recovery.py``,
``parallel.max_stage_restarts``). One that dies for good is taken out: the router forgets
it and its unfinished requests move to the live replicas (``engine/handoff.py``: recomputed
from their tokens, nothing lost). ``num_live`` says how many are left; with none, the
engine is dead.

Records: each replica records into ``<run_dir>/replica-<i>/``; ``write_run_records`` also
writes the total into the run dir itself (``report/replicas.py``).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sarathi_pp.config import EngineConfig
from sarathi_pp.engine.input_processor import ProcessedRequest, RequestInput
from sarathi_pp.engine.llm_engine import ExecutorFactory, LLMEngine
from sarathi_pp.engine.recovery import EngineDeadError
from sarathi_pp.outputs import RequestOutput
from sarathi_pp.records.observer import Observer
from sarathi_pp.records.run_dir import RunDir
from sarathi_pp.report.replicas import replica_dir, write_total
from sarathi_pp.routing import Router, pending_tokens
from sarathi_pp.sampling_params import SamplingParams
from sarathi_pp.scheduler.base import QueueFullError

logger = logging.getLogger(__name__)

# While no replica's oldest micro-batch is done, how long each is waited on before the next
# is asked (seconds): bounds how late a finished replica is noticed, per other replica.
POLL_S = 0.002


def create_engine(
    config: EngineConfig, executor: str | ExecutorFactory | None = None
) -> LLMEngine | ReplicatedEngine:
    """The engine ``config`` asks for: one ``LLMEngine``, or a ``ReplicatedEngine`` of
    ``parallel.data_parallel_size`` of them."""
    if config.parallel.data_parallel_size == 1:
        return LLMEngine(config, executor)
    return ReplicatedEngine(config, executor)


class _Finished(Observer):
    """Keeps every finished engine request's final output (the total ``requests.csv``)."""

    def __init__(self, into: list[RequestOutput]) -> None:
        self.into = into

    def finished(self, output: RequestOutput) -> None:
        self.into.append(output)


class ReplicatedEngine:
    dead_reason: str | None = None  # set once no replica is left (or at shutdown)

    def __init__(self, config: EngineConfig, executor: str | ExecutorFactory | None = None) -> None:
        n = config.parallel.data_parallel_size
        self.config = config
        self._run: RunDir | None = None
        self._overwrite = config.run.overwrite
        if config.run.run_dir is not None:  # refused before any replica starts
            self._run = RunDir.check(config.run.run_dir, config.run.overwrite)
        self._finished: list[RequestOutput] = []
        seq_ids = itertools.count()
        self.engines: list[LLMEngine] = []
        try:
            for i in range(n):
                cfg = config
                if self._run is not None:
                    cfg = config.replace(**{"run.run_dir": str(replica_dir(self._run.path, i))})
                observers = [_Finished(self._finished)]
                self.engines.append(LLMEngine(cfg, executor, observers=observers, seq_ids=seq_ids))
        except BaseException:
            self.shutdown()
            raise
        first = self.engines[0]
        block_size = first.block_size if config.cache.enable_prefix_caching else None
        self.router = Router(n, "least_loaded", block_size)
        self._where: dict[str, int] = {}  # request id (a parent's for n > 1) -> replica
        self._turn = 0  # the replica waited on last
        self.replicas_lost: list[int] = []
        self.num_requests_moved = 0  # from lost replicas to live ones
        self._run_created = False
        self._recording = list(range(n))  # the replicas that record into this run dir

    # --- what every replica has alike (the first live one answers) ------------------
    @property
    def first(self) -> LLMEngine:
        return self.engines[self.router.live[0] if self.router.live else 0]

    num_replicas = property(lambda self: len(self.engines))
    num_live = property(lambda self: len(self.router.live))
    spec = property(lambda self: self.first.spec)
    model_dir = property(lambda self: self.first.model_dir)
    max_model_len = property(lambda self: self.first.max_model_len)
    placement = property(lambda self: self.first.placement)
    tokenizer = property(lambda self: self.first.tokenizer)
    inputs = property(lambda self: self.first.inputs)
    default_sampling = property(lambda self: self.first.default_sampling)
    recorder = property(lambda self: self.first.recorder)
    num_kv_blocks = property(lambda self: self.first.num_kv_blocks)
    run_dir = property(lambda self: None if self._run is None else self._run.path)

    def default_sampling_params(self) -> SamplingParams:
        return self.first.default_sampling_params()

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.first.tokenize(prompt, add_special_tokens)

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.first.detokenize(token_ids, skip_special_tokens)

    def token_text(self, token_id: int) -> str | None:
        return self.first.token_text(token_id)

    def validate_prompt(self, token_ids: list[int], where: str = "prompt") -> None:
        self.first.validate_prompt(token_ids, where)

    def now(self) -> float:
        return self.first.now()

    def add_observer(self, observer: Observer) -> None:
        """Tell ``observer`` what every replica's loop does (an observer with
        ``for_replica(i)`` gives each replica the observer that returns)."""
        per_replica = getattr(observer, "for_replica", None)
        for i, e in enumerate(self.engines):
            e.add_observer(per_replica(i) if per_replica is not None else observer)

    def set_scheduler(self, **overrides: Any) -> None:
        for i in self.router.live:
            self.engines[i].set_scheduler(**overrides)
        self.config = self.config.replace(**{f"scheduler.{k}": v for k, v in overrides.items()})

    def reset_prefix_cache(self) -> bool:
        """``LLMEngine.reset_prefix_cache`` on every live replica; ``False`` (nothing
        forgotten) while any request is unfinished."""
        if self.has_unfinished_requests():
            return False
        return all([self.engines[i].reset_prefix_cache() for i in self.router.live])

    # --- requests --------------------------------------------------------------------
    def add_requests(self, requests: Iterable[RequestInput]) -> list[ProcessedRequest]:
        """``LLMEngine.add_requests`` over the replicas: every request checked and processed
        once (all or none), then each queued on the replica the router picks."""
        self._check_alive()
        processed = self.first.process_requests(requests, in_use=self._where.__contains__)
        added: list[str] = []
        loads = self._loads()  # once per call, then each request's own added: O(requests)
        try:
            for req in processed:
                i = self.router.route(req.token_ids, loads)
                self.engines[i].queue_requests([req])
                self._where[req.request_id] = i
                added.append(req.request_id)
                loads[i] += self._request_tokens(req)
        except BaseException:
            for request_id in added:
                self.abort(request_id)
            raise
        return processed

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
    ) -> None:
        self.add_requests(
            [RequestInput.one(request_id, prompt, params, prompt_token_ids, arrival_time)]
        )

    def _request_tokens(self, req: ProcessedRequest) -> int:
        """A new request's pending tokens (``pending_tokens`` of its ``n`` sequences)."""
        p, num_prompt = req.params, len(req.token_ids)
        outputs = p.max_tokens if p.max_tokens is not None else self.max_model_len - num_prompt
        return p.n * (num_prompt + max(0, outputs))

    def _loads(self) -> list[int]:
        """Every replica's pending tokens (a removed one's do not matter)."""
        return [
            pending_tokens([*e.scheduler.waiting, *e.scheduler.running], e.max_model_len)
            for e in self.engines
        ]

    def abort(self, request_id: str) -> None:
        i = self._where.get(request_id)
        if i is not None:
            self.engines[i].abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(self.engines[i].has_unfinished_requests() for i in self.router.live)

    @property
    def num_inflight(self) -> int:
        return sum(self.engines[i].num_inflight for i in self.router.live)

    def is_alive(self) -> bool:
        return self.dead_reason is None

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"engine is dead: {self.dead_reason}")

    # --- the loop --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Issue on every live replica, then step one (the first, in turn, whose oldest
        micro-batch is done) and any idle one with outputs to hand out."""
        self._check_alive()
        outputs: list[RequestOutput] = []
        for i in list(self.router.live):
            self._guarded(i, self.engines[i].issue, outputs)
        busy = [i for i in self.router.live if self.engines[i].num_inflight]
        for i in list(self.router.live):
            e = self.engines[i]
            if i not in busy and (e.has_pending_outputs or e.has_unfinished_requests()):
                outputs += self._guarded(i, e.step, outputs)
        busy = [i for i in busy if i in self.router.live]
        if busy:
            i = self._turn = self._next(busy)
            outputs += self._guarded(i, self.engines[i].step, outputs)
        for out in outputs:
            if out.finished:
                self._where.pop(out.request_id, None)
        return outputs

    def _next(self, busy: list[int]) -> int:
        """The replica to step: the first, in turn after the last one stepped, whose oldest
        micro-batch is done. While none is, each is asked in turn to wait a little for its
        own (``POLL_S``), so the first to finish is stepped first and issues its next
        micro-batch while the others compute; after ``stage_timeout_s`` of that, the next in
        turn (its own wait then reports a stage that hangs)."""
        order = sorted(busy, key=lambda i: (i <= self._turn, i))
        if len(order) == 1:
            return order[0]
        deadline = time.monotonic() + self.config.parallel.stage_timeout_s
        timeout_s = 0.0
        while True:
            for i in order:
                if self.engines[i].oldest_ready(timeout_s):
                    return i
            if time.monotonic() > deadline:
                return order[0]
            timeout_s = POLL_S

    def _guarded(self, i: int, fn: Any, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """``fn()`` of replica ``i`` (its step or issue); a replica that dies of it is
        taken out and its requests moved (the outputs of its aborts join ``outputs``)."""
        try:
            return fn() or []
        except Exception:
            if self.engines[i].is_alive():
                raise
            self._take_out(i, outputs)
            return []

    def settle(self) -> None:
        """Step until nothing is in flight where no request waits (``LLM.generate``'s end)."""
        for i in self.router.live:
            self.engines[i].settle()

    def _take_out(self, i: int, outputs: list[RequestOutput]) -> None:
        engine = self.engines[i]
        self.router.remove(i)
        self.replicas_lost.append(i)
        released = engine.release_unfinished()
        outputs += released.aborted
        logger.error(
            "replica %d is lost for good (%s): %d replica(s) left, %d unfinished request(s) "
            "moved to them", i, engine.dead_reason, self.num_live, len(released.requests),
        )  # fmt: skip
        if not self.router.live:
            self.dead_reason = f"every replica is lost; the last: {engine.dead_reason}"
            raise EngineDeadError(f"engine is dead: {self.dead_reason}")
        for handoff in released.requests:
            self._place(handoff)
        self.num_requests_moved += len(released.requests)

    def _place(self, handoff: Any) -> None:
        loads = self._loads()
        order = sorted(self.router.live, key=lambda j: (loads[j], j))
        first = self.router.route(handoff.prompt_token_ids, loads)
        for j in [first, *[j for j in order if j != first]]:
            try:
                self.engines[j].adopt(handoff)
            except QueueFullError:
                continue
            self._where[handoff.request_id] = j
            return
        raise QueueFullError(f"request {handoff.request_id!r}: no live replica has room")

    # --- records ---------------------------------------------------------------------
    def start_run(self, run_dir: str | Path, overwrite: bool = False) -> None:
        run = RunDir.check(run_dir, overwrite)
        for i in self.router.live:
            self.engines[i].start_run(replica_dir(run.path, i), overwrite)
        self._run, self._overwrite, self._run_created = run, overwrite, False
        self._recording = list(self.router.live)  # a replica lost before has no part in it
        self._finished.clear()

    def write_run_records(self) -> dict[str, Any] | None:
        """Every replica's records, then the total in the run dir (``None`` without one)."""
        summaries = [self.engines[i].write_run_records() for i in self._recording]
        if self._run is None:
            return None
        if not self._run_created:
            self._run.path.mkdir(parents=True, exist_ok=True)
            if self._overwrite:
                self._run.clear()
            self._run_created = True
        dirs = [replica_dir(self._run.path, i) for i in self._recording]
        return write_total(
            self._run.path, dirs, list(self._finished), summaries,
            routing=self.router.routing, prefix_affinity=self.router.affinity,
            replicas_lost=list(self.replicas_lost), num_requests_moved=self.num_requests_moved,
        )  # fmt: skip

    def shutdown(self) -> None:
        """Shut every replica down, the last first (the first started Ray and stops it)."""
        for e in reversed(self.engines):
            try:
                e.shutdown()
            except Exception:  # noqa: BLE001 - the others still go
                logger.exception("shutting a replica down failed")
        if self.dead_reason is None:
            self.dead_reason = "it was shut down (LLM.shutdown / LLMEngine.shutdown)"
