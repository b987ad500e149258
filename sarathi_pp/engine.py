"""``LLMEngine``: the online loop in vLLM's shape (``add_request`` / ``step`` / ``abort``).

One ``step()`` issues every micro-batch the scheduler can issue (up to the in-flight limit:
the number of pipeline stages by default), waits for the oldest in flight, applies its
sampled tokens, checks the stop conditions and returns the outputs it updated.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sarathi_pp.config import EngineConfig, SchedulerConfig
from sarathi_pp.events import EventLog
from sarathi_pp.executor import Executor, StageError, StepResult, create_executor
from sarathi_pp.memory import num_kv_blocks
from sarathi_pp.model_path import resolve_model_path
from sarathi_pp.model_spec import ModelSpec, load_model_spec
from sarathi_pp.outputs import CompletionOutput, RequestOutput
from sarathi_pp.microbatch import MicroBatch
from sarathi_pp.run_dir import prepare_run_dir, write_config
from sarathi_pp.sampling_params import SamplingParams
from sarathi_pp.scheduler import Scheduler, create_scheduler
from sarathi_pp.scheduler.base import IDLE_DEPENDENCY, IDLE_NO_WORK
from sarathi_pp.scheduler.chunk_tuner import engine_decode_batch
from sarathi_pp.sequence import Sequence, SequenceStatus
from sarathi_pp.tokenizer import Detokenizer, has_tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _TextState:
    stream: Any
    text: str = ""


def resolve_max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    limit = spec.max_position_embeddings
    max_len = config.model.max_model_len or limit
    if max_len > limit:
        raise ValueError(
            f"max_model_len={max_len} exceeds the checkpoint's limit "
            f"(max_position_embeddings={limit})"
        )
    if spec.sliding_window is not None and spec.sliding_window < max_len:
        raise ValueError(
            f"the checkpoint uses sliding-window attention (window {spec.sliding_window}) "
            f"shorter than max_model_len={max_len}; sliding windows are not supported: "
            f"set max_model_len <= {spec.sliding_window}"
        )
    return max_len


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: str | None = None) -> None:
        self.run_dir = None
        if config.run.run_dir is not None:  # refuse a used run dir before any work
            self.run_dir = prepare_run_dir(config.run.run_dir, config.run.overwrite)
        self.config = config
        self.model_dir = resolve_model_path(config.model.path)
        self.spec = load_model_spec(self.model_dir)
        self.max_model_len = resolve_max_model_len(config, self.spec)
        tok_dir = config.model.tokenizer or self.model_dir
        if config.model.tokenizer is not None and not has_tokenizer(tok_dir):
            raise FileNotFoundError(f"tokenizer folder {tok_dir!r} has no tokenizer files")
        self.tokenizer = load_tokenizer(tok_dir) if has_tokenizer(tok_dir) else None
        self.detokenizer = Detokenizer(self.tokenizer) if self.tokenizer is not None else None
        num_stages = config.parallel.pipeline_parallel_size
        if num_stages > self.spec.num_layers:
            raise ValueError(
                f"pipeline_parallel_size={num_stages} exceeds the model's "
                f"{self.spec.num_layers} layers: every stage needs at least one"
            )
        self.executor: Executor = create_executor(
            executor or config.parallel.executor_name,
            config,
            self.spec,
            self.model_dir,
            self.max_model_len,
        )
        try:
            self._init_cache_and_scheduler(config)
        except BaseException:
            self.executor.shutdown()
            raise
        self._inflight: deque[MicroBatch] = deque()
        self._seq_ids = itertools.count()
        self._requests: dict[str, Sequence] = {}
        self._text: dict[int, _TextState] = {}
        self.eos_token_ids = self._eos_ids()
        # The event log behind the bubble report: recorded only for a run dir.
        self.events: EventLog | None = None
        if self.run_dir is not None:
            self._open_records()

    def _init_cache_and_scheduler(self, config: EngineConfig) -> None:
        self.stage_memory = self.executor.load_model()
        self.block_size = config.cache.block_size or self.executor.preferred_block_size()
        self.num_kv_blocks = num_kv_blocks(
            config.cache,
            self.stage_memory,
            self.block_size,
            self.max_model_len,
            config.scheduler.max_num_seqs,
        )
        self.executor.init_kv_cache(self.num_kv_blocks, self.block_size)
        self.max_inflight = config.parallel.microbatches_in_flight
        self.scheduler = self._create_scheduler(config.scheduler)
        self.resolved_config = config.replace(
            max_model_len=self.max_model_len, block_size=self.block_size
        )

    def set_scheduler(self, **overrides: Any) -> None:
        """Switch scheduler settings (``policy``, ``chunk_size``, ...) between workloads,
        keeping the loaded stages and their KV cache: comparing policies on one pipeline
        costs no new stage processes. Only while no request is unfinished."""
        if self.has_unfinished_requests():
            raise RuntimeError("set_scheduler needs an idle engine (requests are unfinished)")
        config = self.config.replace(**{f"scheduler.{k}": v for k, v in overrides.items()})
        old = self.scheduler
        self.scheduler = self._create_scheduler(config.scheduler)
        self.scheduler._next_microbatch_id = old._next_microbatch_id  # ids stay unique per run
        self.config = config

    def _create_scheduler(self, config: SchedulerConfig) -> Scheduler:
        # B of chunk_size: auto's plan (see engine_decode_batch for which figure).
        max_decode_batch = None
        if config.chunk_size == "auto":
            max_decode_batch = engine_decode_batch(
                self.config.cache,
                self.stage_memory,
                self.num_kv_blocks,
                self.block_size,
                self.max_model_len,
                config.max_num_seqs,
            )
        return create_scheduler(
            config,
            self.num_kv_blocks,
            self.block_size,
            self.max_model_len,
            self.max_inflight,
            max_decode_batch,
        )

    def _eos_ids(self) -> set[int]:
        ids = set(self.spec.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    @staticmethod
    def now() -> float:
        return time.monotonic()

    # --- requests ------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(
                f"model folder {self.model_dir!r} has no tokenizer: pass prompt_token_ids instead"
            )
        return self.tokenizer.encode(prompt)

    def validate_prompt(self, token_ids: list[int], where: str = "prompt") -> None:
        """``ValueError`` naming ``where`` unless the prompt can run at all."""
        if len(token_ids) == 0:
            raise ValueError(f"{where} is empty")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.spec.vocab_size]
        if bad:
            raise ValueError(
                f"{where} has token ids outside [0, {self.spec.vocab_size}): {bad[:5]}"
            )
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"{where} has {len(token_ids)} tokens, more than max_model_len={self.max_model_len}"
            )
        capacity = self.num_kv_blocks * self.block_size
        if len(token_ids) + 1 > capacity:
            raise ValueError(
                f"{where} has {len(token_ids)} tokens; the whole KV cache holds {capacity}"
            )
        cap = self.config.scheduler.max_num_batched_tokens
        if (
            cap is not None
            and self.config.scheduler.policy in ("vllm", "orca")
            and len(token_ids) > cap
        ):
            raise ValueError(
                f"{where} has {len(token_ids)} tokens, more than max_num_batched_tokens={cap} "
                f"(scheduler {self.config.scheduler.policy!r} does not chunk prompts)"
            )

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
    ) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise TypeError(f"request {request_id!r}: prompt must be a string, got {prompt!r}")
            prompt_token_ids = self.tokenize(prompt) if prompt else []
        self.validate_prompt(list(prompt_token_ids), f"request {request_id!r}")
        seq = Sequence(
            next(self._seq_ids),
            request_id,
            list(prompt_token_ids),
            params,
            self.now() if arrival_time is None else arrival_time,
            prompt=prompt,
        )
        self._requests[request_id] = seq
        stream = self.detokenizer.new_stream() if self.detokenizer else None
        self._text[seq.seq_id] = _TextState(stream)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        seq = self._requests.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED, self.now())
            self._text.pop(seq.seq_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._inflight)

    @property
    def num_inflight(self) -> int:
        """Micro-batches issued to the stages whose sampled tokens are not back yet."""
        return len(self._inflight)

    # --- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._issue()
        if not self._inflight:
            return []
        try:
            microbatch, result = self.executor.wait_oldest()
        except StageError:
            self.shutdown()  # the pipeline is broken: release the stages, then report
            raise
        expected = self._inflight.popleft()
        assert microbatch.microbatch_id == expected.microbatch_id, (microbatch, expected)
        return self._apply(microbatch, result)

    def _issue(self) -> None:
        """Issue every micro-batch the scheduler can, up to the in-flight limit."""
        while len(self._inflight) < self.max_inflight:
            now = self.now()
            self._log_chunk_size(now)
            microbatch = self.scheduler.schedule(now)
            if microbatch is None:
                if self.events is not None:
                    self.events.idle(now, self.scheduler.idle_reason)
                return
            if self.events is not None:
                self.events.issue(
                    microbatch.microbatch_id,
                    now,
                    microbatch.kind,
                    microbatch.num_prefill_tokens,
                    microbatch.num_decode_tokens,
                )
            self.executor.submit(microbatch)
            self._inflight.append(microbatch)
        if self.events is not None:  # the in-flight limit holds the next micro-batch back
            self.events.idle(self.now(), IDLE_DEPENDENCY)

    def _log_chunk_size(self, now: float) -> None:
        """The budget in force before each scheduling attempt: the log records it the first
        time and whenever it changed (``chunk_size: auto`` re-plans on add and finish)."""
        if self.events is not None and self.scheduler.chunks_prompts:
            self.events.chunk_size(now, self.scheduler.chunk_size)

    def _apply(self, microbatch: MicroBatch, result: StepResult) -> list[RequestOutput]:
        now = self.now()
        if self.events is not None:
            self.events.done(microbatch.microbatch_id, now)
            for e in result.events:
                self.events.stage(e)
        updated = self.scheduler.on_step_done(microbatch, result.sampled, now)
        outputs = []
        for seq_id, message in result.errors.items():
            seq = self.scheduler.seqs.get(seq_id)
            if seq is not None and not seq.is_finished:
                seq.error = message
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR, now)
                outputs.append(self._output(seq))
        for seq in updated:
            try:
                self._check_stop(seq, now)
            except Exception as e:  # noqa: BLE001 - one request's failure stays its own
                logger.exception("request %s failed", seq.request_id)
                seq.error = f"{type(e).__name__}: {e}"
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR, now)
            outputs.append(self._output(seq))
        return outputs

    def _check_stop(self, seq: Sequence, now: float) -> None:
        token = seq.output_token_ids[-1]
        p = seq.params
        state = self._text[seq.seq_id]
        if self.detokenizer is not None:
            state.text += self._new_text(seq, state)
        if not p.ignore_eos and token in self.eos_token_ids or token in p.stop_token_ids:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED, now, token)
        elif p.stop and self._hit_stop_string(seq, state):
            pass
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH, now)

    def _new_text(self, seq: Sequence, state: _TextState) -> str:
        if state.stream is not None:
            return self.detokenizer.step(state.stream, seq.output_token_ids)
        full = self.detokenizer.decode(seq.output_token_ids)
        return full[len(state.text) :]

    def _hit_stop_string(self, seq: Sequence, state: _TextState) -> bool:
        # Only the tail can hold a new match: the text before it was checked already.
        longest = max(len(s) for s in seq.params.stop)
        tail_from = max(0, len(state.text) - longest - 16)
        for s in seq.params.stop:
            i = state.text.find(s, tail_from)
            if i >= 0:
                state.text = state.text[:i]  # as vLLM: the stop string is not in the output
                self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED, self.now(), s)
                return True
        return False

    def _output(self, seq: Sequence) -> RequestOutput:
        state = self._text.get(seq.seq_id)
        text = state.text if state is not None else ""
        if seq.is_finished:
            self._text.pop(seq.seq_id, None)
            self._requests.pop(seq.request_id, None)
            if self.detokenizer is not None and not isinstance(seq.stop_reason, str):
                # The stream holds back an incomplete UTF-8 tail; the final text has it all.
                text = self.detokenizer.decode(seq.output_token_ids)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.status.finish_reason,
            stop_reason=seq.stop_reason,
            error=seq.error,
        )
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=list(seq.prompt_token_ids),
            outputs=[completion],
            finished=seq.is_finished,
            metrics=seq.metrics,
            error=seq.error,
        )

    def start_run(self, run_dir: str | Path, overwrite: bool = False) -> None:
        """Record from now on into a new run dir (``config.yaml`` with the scheduler in
        force, a fresh event log), keeping the live stages: the serving benchmark gives
        each scheduler its own run dir. Only while no request is unfinished."""
        if self.has_unfinished_requests():
            raise RuntimeError("start_run needs an idle engine (requests are unfinished)")
        self.run_dir = prepare_run_dir(run_dir, overwrite)
        self._open_records()

    def _open_records(self) -> None:
        """``config.yaml`` (the config in force, resolved) and a fresh event log for
        ``self.run_dir``."""
        assert self.run_dir is not None
        config = self.config.replace(max_model_len=self.max_model_len, block_size=self.block_size)
        write_config(self.run_dir, config)
        num_stages = config.parallel.pipeline_parallel_size
        self.events = EventLog(num_stages, self.now(), config.to_dict())

    def write_run_records(self) -> dict[str, Any] | None:
        """Write ``events.jsonl`` and rebuild the report files in the run dir (if any);
        the run's summary (``summary.json``), or ``None`` without a run dir."""
        if self.run_dir is None or self.events is None:
            return None
        now = self.now()
        self.events.end_idle(now)
        self.events.write(self.run_dir / "events.jsonl")
        # Until the next request the engine has no work: a later generate() call's log then
        # shows the gap as no_work, not as a scheduling bubble.
        self.events.idle(now, IDLE_NO_WORK)
        from sarathi_pp.report import write_report

        return write_report(self.run_dir)

    def shutdown(self) -> None:
        self.executor.shutdown()
