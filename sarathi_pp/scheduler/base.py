"""What every policy shares: queues, admission, KV blocks, preemption, micro-batch bookkeeping.

A policy only decides which sequences and how many tokens of each go into the next
micro-batch (``_select``); this base turns the choice into a ``MicroBatch``.

Lifecycle: ``add`` -> ``schedule(now)`` (zero or more times, each micro-batch is in flight until)
-> ``on_step_done(microbatch, sampled, now)`` -> the engine checks stop conditions and calls
``finish``. Blocks of a finished sequence are freed once no micro-batch in flight holds it.

Scheduling ahead (``schedule(now, ring_upto=j)``): a sequence whose next token micro-batch
``<= j`` is still sampling may get that token's decode now, its input token marked
``RING_TOKEN`` (stage 0 takes it from the last stage's result: the token ring). Not when
that token ends the sequence by length (``max_tokens``, ``max_model_len``): the decode
would be wasted. When it ends it by a stop token or string, the ahead decode's token is
dropped (the sequence is finished when it comes back), as in vLLM's async scheduling.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Collection, Iterator

from sarathi_pp.config import SchedulerConfig
from sarathi_pp.microbatch import RING_TOKEN, MicroBatch, ScheduledChunk
from sarathi_pp.planner.memory import kv_decode_batch
from sarathi_pp.planner.tuner import ChunkTuner
from sarathi_pp.scheduler.block_manager import BlockManager, Lookup, blocks_for
from sarathi_pp.sequence import Sequence, SequenceStatus

# Why the scheduler had nothing to issue (recorded as bubble causes on stage 0).
IDLE_NO_WORK = "no_work"  # no request has arrived (or everything is finished)
IDLE_DEPENDENCY = "dependency"  # work exists but waits for sampled tokens or free KV blocks
IDLE_RECOVERY = "recovery"  # the engine is replacing a lost stage

Selection = list[tuple[Sequence, int]]  # (sequence, number of tokens to issue)


class QueueFullError(RuntimeError):
    """``scheduler.max_waiting`` requests are waiting already: the request is refused (an
    HTTP server answers 429)."""


# A request that ends this way shows the workload's P:D (an aborted or failed one does not).
_OBSERVED = (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH)


class Scheduler(ABC):
    @property
    def chunks_prompts(self) -> bool:
        """Whether the policy splits prompts by the ``chunk_size`` budget (vllm/orca: no;
        ``config.WHOLE_PROMPT_POLICIES``)."""
        return self.config.chunks_prompts

    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        num_microbatches_in_flight: int = 1,
        max_decode_batch: int | None = None,
        first_microbatch_id: int = 0,
        num_decode_microbatches_in_flight: int | None = None,
        enable_prefix_caching: bool = False,
    ) -> None:
        """``max_decode_batch``: B of ``chunk_size: auto``'s plan (the engine's figure from
        the stages' memory); ``None`` = what ``num_blocks`` holds (``kv_decode_batch``).
        ``first_microbatch_id``: the id of the first micro-batch (a scheduler that replaces
        another on the same stages continues its ids: they stay unique per run).
        ``num_decode_microbatches_in_flight``: the limit while only decodes run
        (``microbatch_limit``); ``None`` = ``num_microbatches_in_flight``.
        ``enable_prefix_caching``: prefills start from the blocks other requests computed
        already (``block_manager.py``; looked up when a prefill starts, ``_start_prefill``)."""
        self.config = config
        self.max_model_len = max_model_len
        self.num_microbatches_in_flight = num_microbatches_in_flight
        self.num_decode_microbatches_in_flight = min(
            num_decode_microbatches_in_flight or num_microbatches_in_flight,
            num_microbatches_in_flight,
        )
        self._decode_groups = num_microbatches_in_flight  # this schedule()'s limit
        self._num_inflight = 0  # micro-batches issued and not done (``_decode_share``)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()  # FCFS; preempted sequences go to the front
        self.running: list[Sequence] = []  # admitted, oldest admission first
        self.seqs: dict[int, Sequence] = {}  # every unfinished (or not yet freed) sequence
        self._admit_counter = itertools.count()
        self._next_microbatch_id = first_microbatch_id
        self._step = 0
        self.idle_reason: str | None = None
        self.num_preemptions = 0
        self._ring_upto = -1  # the newest micro-batch whose tokens may be used ahead
        self._ahead: set[int] = set()  # sequences offered a decode ahead in this schedule()
        self._released: list[int] = []  # penalized sequences freed: the next micro-batch says
        self._kv_failed: set[int] = set()  # sequences whose K/V a failed micro-batch left
        self.tuner: ChunkTuner | None = None  # set for ``chunk_size: auto``
        # Policies that run whole prompts ignore chunk_size, "auto" included (the configuration
        # guide: settings a policy does not use are accepted, so one config serves every policy).
        if config.chunk_size == "auto" and self.chunks_prompts:
            if max_decode_batch is None:
                max_decode_batch = kv_decode_batch(
                    num_blocks, block_size, max_model_len, config.max_num_seqs
                )
            self.tuner = ChunkTuner(
                config, max_decode_batch, num_microbatches_in_flight, max_model_len
            )

    @property
    def next_microbatch_id(self) -> int:
        return self._next_microbatch_id

    @property
    def chunk_size(self) -> int:
        """The token budget of the next micro-batch: fixed, or the tuner's current value
        (it changes only in ``add`` and ``finish``, never inside ``schedule``)."""
        if self.tuner is not None:
            return self.tuner.chunk_size
        assert isinstance(self.config.chunk_size, int), self.config.chunk_size
        return self.config.chunk_size

    # --- requests ------------------------------------------------------------------------
    def check_room(self) -> None:
        """``QueueFullError`` when ``max_waiting`` requests wait already."""
        limit = self.config.max_waiting
        if limit is not None and len(self.waiting) >= limit:
            raise QueueFullError(
                f"the waiting queue is full: {len(self.waiting)} requests wait "
                f"(scheduler.max_waiting={limit}); retry later"
            )

    def add(self, seq: Sequence) -> None:
        assert seq.seq_id not in self.seqs, seq
        self.check_room()
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)
        if self.tuner is not None:
            self.tuner.on_added(seq.num_prompt_tokens, seq.params.max_tokens)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_ready_work(self, now: float, ahead: bool = False) -> bool:
        """Whether a micro-batch could take something now, were the in-flight limit not
        reached: a running sequence whose next tokens are known and fit in the KV cache (a
        decode, the next chunk of a prompt or the whole rest of it for a policy that does
        not chunk; with ``ahead``, also a decode of a token a micro-batch in flight is
        sampling), or the first arrived request, with room to admit it and blocks for its
        whole prompt (every policy admits so). False: every sequence that could run is in
        flight already, or the KV cache has no room (the load's own share of a wait,
        ``report/runtime_split.py``). Preemption is not tried. The waiting request first (one
        look), then O(running), stopping at the first that is ready."""
        if self._can_admit():
            first = next(self._iter_arrived(now), None)
            hit = self._lookup(first) if first is not None else None
            if first is not None and hit is not None:
                bm = self.block_manager
                need = blocks_for(first.num_tokens, bm.block_size) - len(hit.blocks)
                if need + bm.num_new_blocks(hit) <= bm.num_free_blocks:
                    return True
        for s in self.running:
            if s.is_schedulable:
                need = 1 if self.chunks_prompts or s.is_decode else s.num_pending_tokens
            elif ahead and self._can_decode_ahead(s, any_microbatch=True):
                need = 1
            else:
                continue
            if self._fit_tokens(s, need) == need:
                return True
        return False

    def microbatch_limit(self, now: float) -> int:
        """How many micro-batches may be in flight now (the engine's limit; scheduling
        ahead adds its one on top): ``num_microbatches_in_flight``, or
        ``num_decode_microbatches_in_flight`` while every micro-batch would be decode-only
        (no prompt has tokens left to issue, no arrived request waits). The running decodes
        are shared out over as many micro-batches (``_decode_share``).

        Why fewer then: a decode-only micro-batch is memory-bound, each reads all of a
        stage's weights whatever its size, so a step's decodes spread over M micro-batches
        cost each stage M weight reads where P (the stages) keep every stage as busy. The
        micro-batches above P pay off while prompts remain: they hide the loop back to the
        driver behind the compute of prefill chunks. O(running) when the two limits
        differ, else nothing to look at."""
        n = self.num_decode_microbatches_in_flight
        if n < self.num_microbatches_in_flight and self._decode_only(now):
            return n
        return self.num_microbatches_in_flight

    def _decode_only(self, now: float) -> bool:
        """No arrived request waits and no admitted prompt has tokens left to issue."""
        return next(self._iter_arrived(now), None) is None and not self._partial_prefills()

    def finish(self, seq: Sequence, status: SequenceStatus, now: float, reason=None) -> None:
        """End ``seq``; its blocks are freed now, or when its last micro-batch in flight is done."""
        if seq.is_finished:
            return
        was = seq.status
        seq.finish(status, now, reason)
        if was is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif was is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._release_if_idle(seq)
        if self.tuner is not None and status in _OBSERVED:
            self.tuner.on_finished(seq.num_prompt_tokens, seq.num_output_tokens)

    def _release_if_idle(self, seq: Sequence) -> None:
        if seq.is_finished and seq.num_inflight == 0:
            self.block_manager.free(seq)
            self._kv_failed.discard(seq.seq_id)
            if self.seqs.pop(seq.seq_id, None) is not None and seq.params.keeps_tokens:
                self._released.append(seq.seq_id)

    # --- scheduling ----------------------------------------------------------------------
    def schedule(self, now: float, ring_upto: int = -1) -> MicroBatch | None:
        """The next micro-batch, or ``None`` (then ``idle_reason`` says why).
        ``ring_upto``: decodes may be scheduled ahead of the tokens micro-batches up to
        this id are sampling (-1: none; the engine's ``parallel.schedule_ahead``)."""
        self._ring_upto = ring_upto
        self._ahead = set()
        self._decode_groups = self.microbatch_limit(now)
        selection = self._select(now)
        if not selection:
            self.idle_reason = IDLE_DEPENDENCY if self._has_arrived_work(now) else IDLE_NO_WORK
            return None
        self.idle_reason = None
        return self._make_microbatch(selection, now)

    @abstractmethod
    def _select(self, now: float) -> Selection:
        """Pick (sequence, num_tokens) pairs; blocks for them must already be reserved."""

    def on_step_done(
        self,
        microbatch: MicroBatch,
        sampled: dict[int, int],
        now: float,
        failed: Collection[int] = (),
    ) -> list[Sequence]:
        """Account a finished micro-batch; returns the live sequences that received a token.
        ``failed``: sequences the micro-batch failed on (per-request isolation): the K/V of
        their chunks was not written, nor that of their chunks in the micro-batches behind
        (run without them), so none of their blocks is published from now on (an aborted
        sequence's chunks in flight still run: its failure is not only ``FINISHED_ERROR``)."""
        bm = self.block_manager
        self._num_inflight = max(0, self._num_inflight - 1)
        for chunk in microbatch.chunks:
            seq = self.seqs_by_id(chunk.seq_id)
            seq.num_inflight -= 1
            if seq.sampling_microbatch == microbatch.microbatch_id:
                seq.sampling_microbatch = -1
            if seq.seq_id in failed:
                self._kv_failed.add(seq.seq_id)
            if seq.seq_id not in self._kv_failed:
                bm.publish(seq, chunk.start + chunk.num_tokens)
        updated = []
        for seq_id, token in sampled.items():
            seq = self.seqs_by_id(seq_id)
            if not seq.is_finished:
                seq.append_token(token, now)
                updated.append(seq)
        for chunk in microbatch.chunks:
            self._release_if_idle(self.seqs_by_id(chunk.seq_id))
        return updated

    def on_microbatches_lost(self, microbatches: list[MicroBatch]) -> list[Sequence]:
        """Micro-batches issued whose results will never come (an interrupted step, a lost
        stage): ``microbatches`` must be every one in flight. Each sequence they hold is
        recomputed from its prompt and the tokens it has (preempted by recompute, so its
        output is unchanged); a finished one is freed. The sequences they told the last
        stage to forget (``released``) go with the next micro-batch instead: a stage that
        survived would otherwise keep their penalty state for good. Returns the sequences
        requeued."""
        self._num_inflight = 0  # ``microbatches`` is every one in flight
        lost_released = [i for mb in microbatches for i in mb.released]
        self._released[:0] = [i for i in lost_released if i not in self._released]
        ids = {c.seq_id for mb in microbatches for c in mb.chunks}
        held = {i: self.seqs[i] for i in sorted(ids) if i in self.seqs}  # freed ones are gone
        requeued = []
        for seq in held.values():
            seq.num_inflight = 0
            seq.sampling_microbatch = -1
            if seq.is_finished:
                self._release_if_idle(seq)
            elif seq.status is SequenceStatus.RUNNING:
                self._preempt(seq)
                requeued.append(seq)
        assert all(s.num_inflight == 0 for s in self.seqs.values()), "a micro-batch was missed"
        return requeued

    def on_kv_lost(self) -> list[Sequence]:
        """The stages' KV caches were replaced (a lost stage: new actors, empty caches), so
        every running sequence is recomputed from its prompt and the tokens it has
        (preempted by recompute, its output unchanged), not only those of the micro-batches
        lost with the stage: a sequence between two micro-batches (a decode waiting behind
        prefills, a prompt waiting for its next chunk) held KV there too. Call after
        ``on_microbatches_lost`` (nothing in flight). Returns the sequences requeued here."""
        assert all(s.num_inflight == 0 for s in self.seqs.values()), "micro-batches in flight"
        requeued = list(self.running)
        for seq in requeued:
            self._preempt(seq)
        self.block_manager.reset_prefix_cache()  # the new stages' caches are empty
        # Every preempted sequence (now, with the lost micro-batches, or before) is at the
        # front of the queue: there in admission order, ahead of those never admitted.
        front = []
        while self.waiting and self.waiting[0].admit_order >= 0:
            front.append(self.waiting.popleft())
        self.waiting.extendleft(sorted(front, key=lambda s: s.admit_order, reverse=True))
        return requeued

    def seqs_by_id(self, seq_id: int) -> Sequence:
        # Known until freed, even after ``finish``: a micro-batch in flight may still hold it.
        return self.seqs[seq_id]

    # --- helpers for policies ------------------------------------------------------------
    def _iter_arrived(self, now: float) -> Iterator[Sequence]:
        return (s for s in self.waiting if s.metrics.arrival_time <= now)

    def _arrived_waiting(self, now: float) -> list[Sequence]:
        """The waiting sequences a policy may admit in one micro-batch: the first arrived
        ones (FCFS), as many as could be admitted, plus the one that stops the admission.

        Why bounded: every policy admits in queue order and stops at the first sequence it
        cannot admit, and at most ``max_num_seqs - running`` can be admitted, so the rest
        of the queue is never looked at: ``schedule()`` costs the same with 100k waiting
        requests as with 10 (arrivals join the queue in time order).
        """
        room = max(0, self.config.max_num_seqs - len(self.running))
        return list(itertools.islice(self._iter_arrived(now), room + 1))

    def _has_arrived_work(self, now: float) -> bool:
        return bool(self.running) or next(self._iter_arrived(now), None) is not None

    def _decode_candidates(self) -> list[Sequence]:
        """Running sequences ready for one decode token, least recently scheduled first:
        those whose token is known and, when scheduling ahead, those whose token a
        micro-batch up to ``ring_upto`` is sampling (``_ahead``)."""
        if self._ring_upto < 0:
            ready = [s for s in self.running if s.is_decode]
        else:  # one pass over the running sequences (a simulator step's hot path)
            ready = []
            for s in self.running:
                if s.is_decode:
                    ready.append(s)
                elif self._can_decode_ahead(s):
                    ready.append(s)
                    self._ahead.add(s.seq_id)
        return sorted(ready, key=lambda s: (s.last_scheduled_step, s.admit_order))

    def _can_decode_ahead(self, seq: Sequence, any_microbatch: bool = False) -> bool:
        """Whether ``seq``'s next token, being sampled by a micro-batch up to
        ``ring_upto`` (any micro-batch with ``any_microbatch``; its only one in flight),
        may be decoded before it is known: not when that token ends the sequence by length."""
        return (
            seq.num_inflight == 1
            and seq.sampling_microbatch >= 0
            and (any_microbatch or seq.sampling_microbatch <= self._ring_upto)
            and seq.num_scheduled_tokens == len(seq.token_ids)
            and (
                seq.params.max_tokens is None
                or len(seq.output_token_ids) + 1 < seq.params.max_tokens
            )
            and len(seq.token_ids) + 1 < self.max_model_len
        )

    def _is_decode(self, seq: Sequence) -> bool:
        """One decode token next: a known one, or one scheduled ahead."""
        return seq.is_decode or seq.seq_id in self._ahead

    def _decode_share(self) -> int:
        """Most decodes one micro-batch takes: its share of the running sequences, so that
        the micro-batches in flight are alike instead of the first one holding every decode
        and the ones behind it none (the same rule for every policy).

        Balanced (``scheduler.balance_microbatches``): at most ``ceil(R / M)`` (R the
        running sequences past their prompt, M the limit in force) and at most the ready
        decodes r spread over the f micro-batches that may still be issued, ``ceil(r / f)``.
        Without the second bound, 5 decodes over 4 micro-batches went 2, 2, 1 and none;
        with it, 2, 1, 1, 1. Without the first, a limit that drops (``microbatch_limit``)
        would let one micro-batch take the decodes of several for good. O(running)."""
        if not self.config.balance_microbatches:
            return max(1, -(-len(self.running) // self._decode_groups))
        num_decoding = len(self.running) - len(self._partial_prefills())
        cap = -(-num_decoding // self._decode_groups)
        ahead = self._ring_upto >= 0
        num_ready = sum(
            1 for s in self.running if s.is_decode or (ahead and self._can_decode_ahead(s))
        )
        num_free = max(1, self._decode_groups - self._num_inflight)
        return max(1, min(cap, -(-num_ready // num_free)))

    def _partial_prefills(self) -> list[Sequence]:
        """Admitted sequences whose prompt (or recompute) is not fully issued yet."""
        return [s for s in self.running if s.is_schedulable and not s.is_decode]

    def _can_admit(self) -> bool:
        return len(self.running) < self.config.max_num_seqs

    def _lookup(self, seq: Sequence) -> Lookup | None:
        """The cached blocks a waiting sequence's prefill may start from, or ``None``: the
        block after them is being written by a micro-batch in flight (another request's
        prefill of the same prefix), so starting now would compute it twice; it is
        published when that micro-batch completes. A request that wants its prompt's
        logprobs computes its whole prompt (as in vLLM)."""
        if seq.wants_prompt_logprobs:
            return Lookup()
        hit = self.block_manager.lookup(seq)
        return None if hit.wait else hit

    def _start_prefill(self, seq: Sequence, now: float) -> bool | None:
        """Admit the waiting ``seq`` if every block of its prompt (or recompute) is free or
        cached, reserve them all, and start it after its cached prefix (``_lookup``).
        False: no room (FCFS stops here); ``None``: it waits for a prefix being written
        (the requests behind it may go first)."""
        if not self._can_admit():
            return False
        hit = self._lookup(seq)
        if hit is None:
            return None
        bm = self.block_manager
        need = blocks_for(seq.num_tokens, bm.block_size) - len(hit.blocks)
        if need + bm.num_new_blocks(hit) > bm.num_free_blocks:
            return False
        self._admit(seq, now)
        cached = 0
        if bm.enable_prefix_caching and not seq.wants_prompt_logprobs:
            cached = bm.take_hit(seq, hit)
            if seq.metrics.num_cached_tokens is None:  # the first lookup's, as vLLM's
                seq.metrics.num_cached_tokens = cached
        seq.num_scheduled_tokens = cached
        bm.grow(seq, seq.num_tokens)
        bm.expect(seq)
        return True

    def _admit(self, seq: Sequence, now: float) -> None:
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        seq.admit_order = next(self._admit_counter)
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = now
        self.running.append(seq)

    def _fit_tokens(self, seq: Sequence, num_tokens: int) -> int:
        """How many of ``num_tokens`` next tokens of ``seq`` fit in its blocks + free ones."""
        bm = self.block_manager
        slots = (len(seq.block_table) + bm.num_free_blocks) * bm.block_size
        return max(0, min(num_tokens, slots - seq.num_scheduled_tokens))

    def _reserve(self, seq: Sequence, num_tokens: int, protected: set[int]) -> bool:
        """Blocks for the next ``num_tokens`` tokens of ``seq``, preempting if needed.

        Victims are the most recently admitted running sequences that no micro-batch in flight
        holds and that are not already in this micro-batch (``protected``); possibly ``seq``
        itself, which then is not scheduled.
        """
        end = seq.num_scheduled_tokens + num_tokens
        while not self.block_manager.can_grow(seq, end):
            victim = self._pick_victim(protected)
            if victim is None:
                return False
            self._preempt(victim)
            if victim is seq:
                return False
        self.block_manager.grow(seq, end)
        return True

    def _pick_victim(self, protected: set[int]) -> Sequence | None:
        candidates = [s for s in self.running if s.num_inflight == 0 and s.seq_id not in protected]
        return max(candidates, key=lambda s: s.admit_order, default=None)

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: drop the KV, keep the tokens, requeue at the front."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        self._kv_failed.discard(seq.seq_id)
        seq.num_scheduled_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _trim_to_tile(self, selection: Selection) -> Selection:
        """Round the rows down to a multiple of ``tile_size`` by trimming prefill chunks
        from the end; never below one prefill token (then nothing is trimmed)."""
        tile = self.config.tile_size
        excess = sum(n for _, n in selection) % tile
        prefill_rows = sum(n for s, n in selection if not self._is_decode(s))
        if excess == 0 or prefill_rows <= excess:
            return selection
        out = list(selection)
        for i in range(len(out) - 1, -1, -1):
            seq, n = out[i]
            if self._is_decode(seq) or excess == 0:
                continue
            cut = min(n, excess)
            excess -= cut
            out[i] = (seq, n - cut)
        return [(s, n) for s, n in out if n > 0]

    def _make_microbatch(self, selection: Selection, now: float) -> MicroBatch:
        self._step += 1
        prefills = [(s, n) for s, n in selection if not self._is_decode(s)]
        decodes = [(s, n) for s, n in selection if self._is_decode(s)]
        chunks = []
        for seq, n in prefills + decodes:  # layout: prefill rows first, then decode rows
            chunks.append(self._issue(seq, n))
        microbatch = MicroBatch(self._next_microbatch_id, tuple(chunks), tuple(self._released))
        self._released.clear()
        self._next_microbatch_id += 1
        self._num_inflight += 1
        return microbatch

    def _issue(self, seq: Sequence, n: int) -> ScheduledChunk:
        start = seq.num_scheduled_tokens
        assert len(seq.block_table) * self.block_manager.block_size >= start + n, seq
        token_ids: tuple[int, ...]
        if seq.seq_id in self._ahead:  # the token micro-batch ``ring_from`` is sampling
            assert n == 1 and start == seq.num_tokens, (seq, n)
            token_ids, ring_from = (RING_TOKEN,), seq.sampling_microbatch
            num_output_tokens = seq.num_output_tokens + 1
        else:
            assert 0 < n <= seq.num_pending_tokens, (seq, n)
            token_ids, ring_from = tuple(seq.token_ids[start : start + n]), -1
            num_output_tokens = seq.num_output_tokens
        is_prefill = not self._is_decode(seq)
        seq.num_scheduled_tokens += n
        seq.num_inflight += 1
        seq.last_scheduled_step = self._step
        reaches_end = seq.num_scheduled_tokens >= seq.num_tokens
        history: tuple[int, ...] = ()
        targets: tuple[int, ...] = ()
        if is_prefill and seq.wants_prompt_logprobs:  # none past the prompt
            targets = tuple(seq.prompt_token_ids[start + 1 : start + n + 1])
        if reaches_end:
            seq.sampling_microbatch = self._next_microbatch_id
            if is_prefill and seq.params.keeps_tokens:  # stages/worker/penalties.py
                history = tuple(seq.token_ids[:start])
        return ScheduledChunk(
            seq_id=seq.seq_id,
            start=start,
            token_ids=token_ids,
            is_prefill=is_prefill,
            block_table=tuple(seq.block_table),
            sampling_params=seq.params if reaches_end else None,
            num_output_tokens=num_output_tokens,
            ring_from=ring_from,
            history=history,
            prompt_targets=targets,
            prompt_logprobs=(seq.params.prompt_logprobs or 0) if targets else 0,
        )
