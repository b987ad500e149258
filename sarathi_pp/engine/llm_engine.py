"""``LLMEngine``: the online loop in vLLM's shape (``add_request`` / ``step`` / ``abort``).

One ``step()`` issues every micro-batch the scheduler can issue (up to the in-flight limit:
the number of pipeline stages by default), waits for the oldest in flight and applies its
sampled tokens. Around the loop: ``InputProcessor`` (the front door's checks,
``add_requests``), ``OutputProcessor`` (stop checks, text, ``RequestOutput``), the
observers (``records/observer.py``: the run dir's recorder first, then any given) and
``PipelineRecovery`` (failed steps). The loop imports no torch:
executors are reached by name (``executors.create_executor``).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from sarathi_pp.checkpoint import load_checkpoint
from sarathi_pp.config import (
    RANDOM_WEIGHT_MODELS,
    REAL_BUILTIN_MODEL,
    EngineConfig,
    SchedulerConfig,
)
from sarathi_pp.engine.handoff import ReplicaHandoff
from sarathi_pp.engine.input_processor import InputProcessor, ProcessedRequest, RequestInput
from sarathi_pp.engine.output_processor import OutputProcessor
from sarathi_pp.engine.parallel_sampling import ParentRequest
from sarathi_pp.engine.recovery import PipelineRecovery
from sarathi_pp.executors import Executor, builtin_resolver, create_executor
from sarathi_pp.executors.interrupts import deferred_interrupts
from sarathi_pp.microbatch import MicroBatch, MicroBatchResult
from sarathi_pp.outputs import RequestOutput
from sarathi_pp.placement.partition import check_num_stages
from sarathi_pp.planner.memory import engine_decode_batch, num_kv_blocks
from sarathi_pp.records.observer import Observer, Observers
from sarathi_pp.records.recorder import NullRecorder, RunRecorder
from sarathi_pp.records.run_dir import RunDir
from sarathi_pp.report import write_report
from sarathi_pp.sampling_params import SamplingParams
from sarathi_pp.scheduler import Scheduler, create_scheduler
from sarathi_pp.scheduler.base import IDLE_DEPENDENCY, IDLE_NO_WORK
from sarathi_pp.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


# Builds an executor from the config and the checkpoint: the simulator passes its own
# (``sarathi_pp.sim``), which the registry of real executors does not hold.
ExecutorFactory = Callable[[EngineConfig, Any], Executor]


class LLMEngine(PipelineRecovery, ReplicaHandoff):
    def __init__(
        self,
        config: EngineConfig,
        executor: str | ExecutorFactory | None = None,
        clock: Callable[[], float] = time.monotonic,
        observers: Iterable[Observer] = (),
        seq_ids: Iterator[int] | None = None,
    ) -> None:
        """``executor``: a registry name (default: the config's) or a factory;
        ``clock``: the engine's time (``time.monotonic``; the simulator's virtual clock);
        ``observers``: told what the loop does (``records/observer.py``), after the run
        dir's recorder; ``seq_ids``: where sequence ids come from (replicas share one
        counter, so ids are unique over them and a request's seed derived from
        ``model.seed`` is its order of arrival at the router, whichever replica runs it)."""
        self._clock = clock
        run_dir = None
        if config.run.run_dir is not None:  # refuse a used run dir before any work
            run_dir = RunDir.check(config.run.run_dir, config.run.overwrite)
        self.config = config
        self.checkpoint = load_checkpoint(config.model, builtin_resolver())
        self.inputs = InputProcessor(config.model, self.checkpoint)
        self.tokenizer = self.inputs.tokenizer
        check_num_stages(self.spec, config.parallel.pipeline_parallel_size)
        if callable(executor):
            self.executor: Executor = executor(config, self.checkpoint)
        else:
            name = executor or config.parallel.executor_name
            self.executor = create_executor(name, config, self.checkpoint)
        try:
            self._init_cache_and_scheduler(config)
        except BaseException:
            self.executor.shutdown()
            raise
        self._inflight: deque[MicroBatch] = deque()
        self._aborted: list[RequestOutput] = []  # final outputs of aborts, for the next step
        self._seq_ids = seq_ids if seq_ids is not None else itertools.count()
        if config.model.path in RANDOM_WEIGHT_MODELS:
            logger.warning(
                "note: %s has random weights, so its text means nothing (a real model: --model %s)",
                config.model.path,
                REAL_BUILTIN_MODEL,
            )
        self._requests: dict[str, Sequence] = {}  # engine request id -> its sequence
        self._parents: dict[str, ParentRequest] = {}  # child id -> its parent (n > 1)
        self._parent_ids: dict[str, ParentRequest] = {}  # parent id -> itself, while open
        eos_ids = self.inputs.eos_token_ids()
        self.outputs = OutputProcessor(self.tokenizer, eos_ids, self.max_model_len)
        self.recorder: RunRecorder | NullRecorder = NullRecorder()
        if run_dir is not None:
            overwrite = config.run.overwrite
            self.recorder = RunRecorder(
                run_dir, self.resolved_config, self.now(), overwrite, write_report
            )
        # What the loop tells: the recorder first (its log is the run's record), then the rest.
        self.observe = Observers([self.recorder, *observers])

    def _init_cache_and_scheduler(self, config: EngineConfig) -> None:
        self.placement = self.executor.placement  # device, dtype, threads, M_G, block size
        self.stage_memory = self.executor.load_model()
        self.block_size = self.placement.block_size
        self.num_kv_blocks = num_kv_blocks(
            config.cache, self.stage_memory, self.block_size, self.max_model_len,
            config.scheduler.max_num_seqs,
        )  # fmt: skip
        self.executor.init_kv_cache(self.num_kv_blocks, self.block_size)
        # Scheduling ahead: one micro-batch more in flight, its decodes fed by the ring.
        # The most in flight; while only decodes run, the scheduler's limit may be lower
        # (``_inflight_limit``).
        ahead = self.executor.schedule_ahead
        self.schedule_ahead = ahead.on
        # ``num_microbatches_in_flight: auto``: P, and the one ahead where it is on
        self.microbatches_in_flight = config.parallel.in_flight_limit(ahead.on)
        self.max_inflight = self.microbatches_in_flight + int(self.schedule_ahead)
        if config.parallel.pipeline_parallel_size > 1:
            state = "on" if self.schedule_ahead else "off"
            logger.info("scheduling ahead %s (%s)", state, ahead.source)
            logger.info(
                "micro-batches in flight: %d%s (num_microbatches_in_flight=%s)",
                self.microbatches_in_flight, " + 1 ahead" if self.schedule_ahead else "",
                config.parallel.num_microbatches_in_flight,
            )  # fmt: skip
        self.num_stages = config.parallel.pipeline_parallel_size
        self.scheduler = self._create_scheduler(config.scheduler)

    # --- what the engine runs ----------------------------------------------------------
    spec = property(lambda self: self.checkpoint.spec)
    model_dir = property(lambda self: self.checkpoint.path)
    max_model_len = property(lambda self: self.checkpoint.max_model_len)
    run_dir = property(lambda self: self.recorder.path)

    def add_observer(self, observer: Observer) -> None:
        """Tell ``observer`` what the loop does from now on (after those already told)."""
        self.observe.observers.append(observer)

    @property
    def resolved_config(self) -> EngineConfig:
        """The config in force with every ``auto`` and default resolved."""
        p = self.placement
        return self.config.replace(
            max_model_len=self.max_model_len, block_size=p.block_size, dtype=p.dtype,
            device=p.device, schedule_ahead=self.schedule_ahead,
        )  # fmt: skip

    def set_scheduler(self, **overrides: Any) -> None:
        """Switch scheduler settings (``policy``, ``chunk_size``, ...) between workloads,
        keeping the loaded stages and their KV cache: comparing policies on one pipeline
        costs no new stage processes. Only while no request is unfinished."""
        if self.has_unfinished_requests():
            raise RuntimeError("set_scheduler needs an idle engine (requests are unfinished)")
        config = self.config.replace(**{f"scheduler.{k}": v for k, v in overrides.items()})
        next_id = self.scheduler.next_microbatch_id  # ids stay unique per run
        self.scheduler = self._create_scheduler(config.scheduler, next_id)
        self.config = config

    def set_prefix_caching(self, enabled: bool) -> None:
        """Turn prefix caching on or off between workloads (``cache.enable_prefix_caching``;
        the cache starts empty either way), keeping the loaded stages: the prefix-caching
        benchmark compares the two on one pipeline. Only while no request is unfinished."""
        if self.has_unfinished_requests():
            raise RuntimeError("set_prefix_caching needs an idle engine (requests are unfinished)")
        self.config = self.config.replace(**{"cache.enable_prefix_caching": enabled})
        next_id = self.scheduler.next_microbatch_id
        self.scheduler = self._create_scheduler(self.config.scheduler, next_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's ``reset_prefix_cache``): later requests prefill
        their whole prompt until blocks are cached again. ``False``, and nothing forgotten,
        while a request is unfinished (its blocks are in use)."""
        if self.has_unfinished_requests():
            return False
        self.scheduler.block_manager.reset_prefix_cache()
        return True

    def _create_scheduler(self, config: SchedulerConfig, first_microbatch_id: int = 0) -> Scheduler:
        # B of chunk_size: auto's plan (see engine_decode_batch for which figure).
        b = None
        if config.chunk_size == "auto":
            b = engine_decode_batch(
                self.config.cache, self.stage_memory, self.num_kv_blocks, self.block_size,
                self.max_model_len, config.max_num_seqs,
            )  # fmt: skip
        return create_scheduler(
            config, self.num_kv_blocks, self.block_size, self.max_model_len,
            self.microbatches_in_flight,  # decode groups: not the one ahead
            b, first_microbatch_id, self.config.parallel.decode_microbatches_in_flight,
            self.config.cache.enable_prefix_caching,
        )  # fmt: skip

    def now(self) -> float:
        return self._clock()

    # --- requests ------------------------------------------------------------------------
    @property
    def default_sampling(self) -> dict[str, Any]:
        """The model folder's ``generation_config.json`` sampling defaults (``SamplingParams``
        field -> value; empty when it sets none): what a request that leaves a field out
        gets, as vLLM's ``--generation-config auto``."""
        return dict(self.checkpoint.generation.sampling)

    def default_sampling_params(self) -> SamplingParams:
        """vLLM's ``LLM.get_default_sampling_params``: ``SamplingParams()`` with the model
        folder's ``generation_config.json`` defaults."""
        return SamplingParams(**self.default_sampling)

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """``prompt``'s token ids (with the tokenizer's special tokens, e.g. BOS, unless
        ``add_special_tokens`` is false); ``ValueError`` without a tokenizer."""
        return self.inputs.tokenize(prompt, add_special_tokens)

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """``token_ids`` as text (special tokens skipped unless ``skip_special_tokens`` is
        false); ``""`` without a tokenizer."""
        d = self.outputs.detokenizer
        return d.decode(token_ids, skip_special_tokens) if d else ""

    def token_text(self, token_id: int) -> str | None:
        """One token's own text, special tokens included (as log-probabilities show each
        token); ``None`` without a tokenizer."""
        return self.outputs.token_text(token_id)

    def validate_prompt(self, token_ids: list[int], where: str = "prompt") -> None:
        """``ValueError`` naming ``where`` unless the prompt can run at all."""
        s = self.config.scheduler
        max_unchunked = None if self.scheduler.chunks_prompts else s.max_num_batched_tokens
        kv_capacity = self.num_kv_blocks * self.block_size
        self.inputs.validate(token_ids, where, kv_capacity, max_unchunked, s.policy)

    def add_requests(self, requests: Iterable[RequestInput]) -> list[ProcessedRequest]:
        """The front door: every request of the call checked (``InputProcessor.process``:
        chat rendering, tokenizing, truncation, validation), then all of them queued, or
        none: a bad one raises before any is added (``TypeError``, or a ``ValueError`` that
        names the request and, as ``.param``, its field), and a failure while adding
        (``QueueFullError``) takes back those added. A request of ``n > 1`` completions is a
        parent of ``n`` engine requests whose outputs ``step`` hands out merged
        (``engine/parallel_sampling.py``). Returns what was queued, in order."""
        processed = self.process_requests(requests)
        self.queue_requests(processed)
        return processed

    def process_requests(
        self, requests: Iterable[RequestInput], in_use: Callable[[str], bool] | None = None
    ) -> list[ProcessedRequest]:
        """``add_requests``' checks and processing, queuing nothing: ``TypeError`` or
        ``ValueError`` for a bad request or an id in use (here, or where ``in_use`` says)."""
        self._check_alive()
        requests = list(requests)
        ids = [r.request_id for r in requests]
        for request_id in ids:
            if not isinstance(request_id, str):
                raise TypeError(f"request ids are strings, got {request_id!r}")
            taken = self._in_use(request_id) or (in_use is not None and in_use(request_id))
            if ids.count(request_id) > 1 or taken:
                raise ValueError(f"request id {request_id!r} is already in use")
        now = self.now()
        return [self.inputs.process(r, self.validate_prompt, now) for r in requests]

    def queue_requests(self, processed: Iterable[ProcessedRequest]) -> None:
        """Queue requests ``process_requests`` gave, all or none (``add_requests``)."""
        self._check_alive()
        added: list[str] = []
        try:
            for req in processed:
                if req.params.n == 1:
                    self._add_sequence(req.request_id, req, req.params)
                    added.append(req.request_id)
                    continue
                parent = ParentRequest(req.request_id, req.params)
                for child_id, child_params in parent.children:
                    self._add_sequence(child_id, req, child_params)
                    added.append(child_id)
                    self._parents[child_id] = parent
                self._parent_ids[parent.request_id] = parent
        except BaseException:
            for request_id in added:  # nothing of the call outlives its failure
                self.abort(request_id)
            raise

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """vLLM's one-request call: ``add_requests`` with one request (``prompt_token_ids``
        given: those tokens, ``prompt`` their text)."""
        self.add_requests(
            [RequestInput.one(request_id, prompt, params, prompt_token_ids, arrival_time)]
        )

    def _in_use(self, request_id: str) -> bool:
        return request_id in self._requests or request_id in self._parent_ids

    def _add_sequence(self, request_id: str, req: ProcessedRequest, params: SamplingParams) -> None:
        self.scheduler.check_room()  # QueueFullError at scheduler.max_waiting
        seq_id = next(self._seq_ids)
        params = self.inputs.seeded(params, seq_id)
        seq = Sequence(
            seq_id, request_id, list(req.token_ids), params, req.arrival_time, prompt=req.text,
            cache_salt=req.cache_salt,
        )  # fmt: skip
        self._requests[request_id] = seq
        self.outputs.add(seq)
        self.observe.added(req.arrival_time)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """End the request (a parent of ``n > 1``: every completion); its final output
        (``finish_reason="abort"``) comes with the next ``step()``. Its blocks are freed at
        once, or when its micro-batch in flight is done."""
        parent = self._parent_ids.get(request_id)
        for child_id in parent.child_ids if parent is not None else [request_id]:
            seq = self._requests.get(child_id)
            if seq is not None and not seq.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED, self.now())
                self._aborted.append(self._output(seq))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._inflight)

    @property
    def num_inflight(self) -> int:
        """Micro-batches issued to the stages whose sampled tokens are not back yet."""
        return len(self._inflight)

    # --- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Issue what can be issued, wait for the oldest micro-batch, apply it. Whatever
        is raised (Ctrl-C included), the micro-batches in flight are abandoned and their
        sequences recomputed later: the engine stays consistent and usable. A lost
        pipeline (``StageError``) ends the engine: ``is_alive()`` turns false."""
        self._check_alive()
        try:
            self._issue()
            if not self._inflight:
                return _latest_per_parent(self._take_aborted())
            # Measured for the report (runtime_split.py): when the driver began waiting, and
            # whether the in-flight limit held back a micro-batch the scheduler had work for
            # (not full: every sequence that could run is in flight, or no KV block is free).
            wait = self.now()
            limit = self._inflight_limit(wait)
            full = len(self._inflight) >= limit and self.scheduler.has_ready_work(
                wait, ahead=self.schedule_ahead
            )
            microbatch, result = self.executor.wait_oldest()
            assert microbatch.microbatch_id == self._inflight[0].microbatch_id, microbatch
            with deferred_interrupts():
                outputs = self._apply(microbatch, result, wait, full)
                self._inflight.popleft()
        except BaseException as e:
            self._on_step_failure(e)  # re-raises unless a lost stage was replaced
            return _latest_per_parent(self._take_aborted())
        if not self.has_unfinished_requests():  # idle for want of work until the next request
            self.observe.idle(self.now(), IDLE_NO_WORK)
        return _latest_per_parent(self._take_aborted() + outputs)

    def issue(self) -> None:
        """Issue what can be issued now, without waiting (``step`` does it too): a router
        of replicas issues on every replica before it waits on one. A failure is handled
        as in ``step`` (re-raised unless a lost stage was replaced)."""
        self._check_alive()
        try:
            self._issue()
        except BaseException as e:
            self._on_step_failure(e)

    def oldest_ready(self, timeout_s: float = 0.0) -> bool:
        """Whether ``step`` would find its oldest micro-batch done, waiting at most
        ``timeout_s`` for it; true when the executor cannot tell."""
        ready = getattr(self.executor, "oldest_ready", None)
        return ready(timeout_s) if ready is not None else True

    @property
    def has_pending_outputs(self) -> bool:
        """Outputs the next ``step`` hands out without running anything (aborts)."""
        return bool(self._aborted)

    def settle(self) -> None:
        """Step while micro-batches are in flight and no request waits: scheduled ahead, a
        decode of a request that has since stopped may still be in flight; after this the
        engine is idle (its blocks freed, ``set_scheduler`` allowed)."""
        while self.num_inflight and not self.scheduler.has_unfinished():
            self.step()

    def _inflight_limit(self, now: float) -> int:
        """Micro-batches that may be in flight now: ``max_inflight``, or fewer while only
        decodes run (``Scheduler.microbatch_limit``: ``num_decode_microbatches_in_flight``)."""
        return self.scheduler.microbatch_limit(now) + int(self.schedule_ahead)

    def _take_aborted(self) -> list[RequestOutput]:
        aborted, self._aborted = self._aborted, []
        return aborted

    def _issue(self) -> None:
        """Issue every micro-batch the scheduler can, up to the in-flight limit."""
        while len(self._inflight) < self._inflight_limit(now := self.now()):
            # Ahead: decodes of the tokens micro-batches at least num_stages older than this
            # one are sampling (stage 0 reaches it about when the last stage has them).
            ring_upto = -1
            if self.schedule_ahead and len(self._inflight) >= self.num_stages:
                ring_upto = self._inflight[len(self._inflight) - self.num_stages].microbatch_id
            # Scheduled, tracked and handed to every stage, or none of it: a Ctrl-C between
            # two stages' submissions would leave one stage a micro-batch behind the other
            # on their activation channel (the next run's micro-batch would meet a stale one).
            with deferred_interrupts():
                self.observe.before_schedule(now, self.scheduler)
                microbatch = self.scheduler.schedule(now, ring_upto)
                if microbatch is None:
                    self.observe.idle(now, self.scheduler.idle_reason)
                    return
                self.observe.issued(microbatch, now, submit=self.now())
                self._inflight.append(microbatch)
                self.executor.submit(microbatch)
        # the in-flight limit holds the next micro-batch back
        self.observe.idle(self.now(), IDLE_DEPENDENCY)

    def _apply(
        self, microbatch: MicroBatch, result: MicroBatchResult, wait: float, full: bool
    ) -> list[RequestOutput]:
        now = self.now()
        self.observe.completed(microbatch, result, now, wait=wait, full=full)
        for seq_id, plp in result.prompt_logprobs.items():  # before the chunk's token
            if (seq := self.scheduler.seqs.get(seq_id)) is not None:
                seq.add_prompt_logprobs(plp.first, plp.tokens)
        updated = self.scheduler.on_step_done(
            microbatch, result.sampled, now, failed=result.errors.keys()
        )
        if result.logprobs:
            for got in updated:
                if (lp := result.logprobs.get(got.seq_id)) is not None:
                    got.output_logprobs.append(lp)
        outputs = []
        for seq_id, message in result.errors.items():
            seq = self.scheduler.seqs.get(seq_id)
            if seq is not None and not seq.is_finished:
                self._fail(seq, message, now)
                outputs.append(self._output(seq))
        for seq in updated:
            try:
                if (stop := self.outputs.check_stop(seq)) is not None:
                    self.scheduler.finish(seq, stop[0], now, stop[1])
            except Exception as e:  # noqa: BLE001 - one request's failure stays its own
                logger.exception("request %s failed", seq.request_id)
                self._fail(seq, f"{type(e).__name__}: {e}", now)
            outputs.append(self._output(seq))
        return outputs

    def _fail(self, seq: Sequence, message: str, now: float) -> None:
        seq.error = message
        self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR, now)

    def _output(self, seq: Sequence) -> RequestOutput:
        """``seq``'s output; for a child of a parent request, the parent's (merged)."""
        out = self.outputs.output(seq)
        if seq.is_finished:
            self._requests.pop(seq.request_id, None)
            self.observe.finished(out)
        parent = self._parents.get(seq.request_id)
        if parent is None:
            return out
        merged = parent.update(out)
        if parent.finished:
            for child_id in parent.child_ids:
                self._parents.pop(child_id, None)
            self._parent_ids.pop(parent.request_id, None)
        return merged

    # --- records -------------------------------------------------------------------------
    def start_run(self, run_dir: str | Path, overwrite: bool = False) -> None:
        """Record from now on into a new run dir (``config.yaml`` with the scheduler in
        force, a fresh event log), keeping the live stages: the serving benchmark gives
        each scheduler its own run dir. Only while no request is unfinished."""
        if self.has_unfinished_requests():
            raise RuntimeError("start_run needs an idle engine (requests are unfinished)")
        self.recorder.close()
        run = RunDir.check(run_dir, overwrite)
        recorder = RunRecorder(run, self.resolved_config, self.now(), overwrite, write_report)
        self.observe.observers[self.observe.observers.index(self.recorder)] = recorder
        self.recorder = recorder

    def write_run_records(self) -> dict[str, Any] | None:
        """Write the run dir's records (``requests.csv``, ``events.jsonl``) and rebuild the
        report files; the run's summary (``summary.json``), or ``None`` without a run dir."""
        return self.recorder.write(self.now())

    def shutdown(self) -> None:
        """Close the run dir's records and release the stages; a request or step after
        this raises ``EngineDeadError`` saying so (the stages' memory is gone)."""
        self.recorder.close()
        self.executor.shutdown()
        if self.dead_reason is None:
            self.dead_reason = "it was shut down (LLM.shutdown / LLMEngine.shutdown)"


def _latest_per_parent(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """``outputs`` with only the last of several outputs of one request (a parent's
    children may all have news in one step: the parent's last merged output has it all)."""
    last = {out.request_id: i for i, out in enumerate(outputs)}
    if len(last) == len(outputs):
        return outputs
    return [out for i, out in enumerate(outputs) if last[out.request_id] == i]
