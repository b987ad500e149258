"""Time one pipeline stage's forward on the machine at hand (``sarathi-pp profile``).

The stage is built as the engine builds it (the placement's layer partition, device, dtype,
CPU threads and KV block size) as a lone ``ModelRunner``, and each configuration of the
grid is timed through ``ModelRunner.execute`` on a hand-made micro-batch: the exact path of a run
(micro-batch -> metadata -> layers -> sampler on the last stage), as ``benchmarks/piggyback.py``
times it. A stage after the first gets random hidden states in place of its predecessor's.

The KV cache is filled with random values instead of by prefills of every context
(minutes): attention costs the same whatever the values, but not whatever the memory. On
CPU the cache's zeros are a fresh anonymous mapping, and a page never written reads from
the kernel's one shared zero page, always in cache: attention over it would look cheaper
than over a context a run wrote. Every sequence of a micro-batch gets blocks of its own,
so decodes read as much memory as in a run.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from sarathi_pp.microbatch import MicroBatch, ScheduledChunk
from sarathi_pp.model_spec import ModelSpec
from sarathi_pp.placement import Placement
from sarathi_pp.placement.partition import partition_layers, stage_costs
from sarathi_pp.planner.profile_analysis import GridPoint, ProfileRow
from sarathi_pp.sampling_params import SamplingParams
from sarathi_pp.stages.worker.model_runner import ModelRunner, StageSpec

# Decodes sample every step (one lm_head row each on the last stage), as in a run. A
# prefill chunk samples only once per prompt, on its last chunk: left out of every row, so
# a chunked and an unchunked prefill compare their forwards alone.
GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class StageSetup:
    """The stage to profile and how it runs."""

    stage: StageSpec
    block_size: int
    threads: int | None  # torch intra-op threads on CPU; None on CUDA
    threads_source: str  # where that number comes from, for the report


def binding_stage(spec: ModelSpec, num_stages: int) -> int:
    """The stage the partition's cost model finds most expensive (the last of equals):
    the one that sets the pipeline's pace."""
    costs = stage_costs(spec, partition_layers(spec, num_stages))
    return max(range(num_stages), key=lambda k: (costs[k], k))


def stage_setup(placement: Placement, stage_idx: int, prefault: bool = False) -> StageSetup:
    """Stage ``stage_idx`` of the pipeline ``placement`` describes, as the executors run it
    (``prefault``: ``cache.prefault``)."""
    num_stages = placement.num_stages
    if not 0 <= stage_idx < num_stages:
        raise ValueError(
            f"--stage {stage_idx} is not a stage of pipeline_parallel_size={num_stages} "
            f"(stages 0..{num_stages - 1})"
        )
    threads, source = placement.num_threads, placement.threads_source
    if placement.device == "cpu" and threads is None:  # one stage keeps torch's default
        threads = torch.get_num_threads()
    spec = StageSpec.of(placement, stage_idx, prefault=prefault)
    return StageSetup(spec, placement.block_size, threads, source)


class StageProfiler:
    """One stage's layers and a KV cache big enough for every configuration of a grid."""

    def __init__(
        self,
        spec: ModelSpec,
        model_dir: str | Path,
        setup: StageSetup,
        max_model_len: int,
        points: list[GridPoint],
        seed: int = 0,
    ) -> None:
        if setup.threads is not None:
            torch.set_num_threads(setup.threads)
        self.setup = setup
        self.spec = spec
        self.runner = ModelRunner(spec, model_dir, setup.stage, max_model_len)
        self.runner.load_model()
        self.runner.init_kv_cache(max(self._blocks(pt) for pt in points), setup.block_size)
        generator = torch.Generator(self.runner.device).manual_seed(seed)
        for cache in (*self.runner.kv.k, *self.runner.kv.v):
            cache.normal_(generator=generator)  # writes every page (module docstring)
        self._rng = random.Random(seed)
        self._hidden_pool = None
        if not setup.stage.is_first:  # what the previous stage would send: any values do
            w = self.runner
            num_rows = max(pt.prefill_tokens + pt.decode_tokens for pt in points)
            hidden = torch.randn(num_rows, spec.hidden_size, generator=generator, device=w.device)
            self._hidden_pool = hidden.to(w.dtype)  # [rows, hidden]

    def _blocks(self, pt: GridPoint) -> int:
        """KV blocks ``pt`` needs: the prefill sequence's and each decode's own."""
        bs = self.setup.block_size
        prefill = -(-(pt.context_len + pt.prefill_tokens) // bs) if pt.prefill_tokens else 0
        decode = -(-(pt.context_len + 1) // bs)  # + 1: the decode token's own slot
        return prefill + pt.decode_tokens * decode

    def microbatch(self, pt: GridPoint, microbatch_id: int = 0) -> MicroBatch:
        """The micro-batch of ``pt``: seq 0 prefills ``[x, x + p)``, seqs 1..d decode at x."""
        bs, x = self.setup.block_size, pt.context_len
        next_block = 0

        def table(num_tokens: int) -> tuple[int, ...]:
            nonlocal next_block
            n = -(-num_tokens // bs)
            next_block += n
            return tuple(range(next_block - n, next_block))

        chunks = []
        if pt.prefill_tokens:
            tokens = self._tokens(pt.prefill_tokens)
            chunks.append(ScheduledChunk(0, x, tokens, True, table(x + pt.prefill_tokens)))
        for seq_id in range(1, pt.decode_tokens + 1):
            chunks.append(
                ScheduledChunk(seq_id, x, self._tokens(1), False, table(x + 1), GREEDY, 1)
            )
        return MicroBatch(microbatch_id, tuple(chunks))

    def _tokens(self, n: int) -> tuple[int, ...]:
        return tuple(self._rng.randrange(self.spec.vocab_size) for _ in range(n))

    def _hidden(self, num_tokens: int) -> torch.Tensor | None:
        """The stage's input hidden states ``[num_tokens, hidden]``; ``None`` on the first."""
        return None if self._hidden_pool is None else self._hidden_pool[:num_tokens]

    def time_once(self, microbatch: MicroBatch, hidden: torch.Tensor | None) -> float:
        """Wall seconds of one forward (CUDA: synchronized; CPU work is synchronous)."""
        is_cuda = self.runner.device.type == "cuda"
        if is_cuda:
            torch.cuda.synchronize(self.runner.device)
        t0 = time.perf_counter()
        self.runner.execute(microbatch, hidden)
        if is_cuda:
            torch.cuda.synchronize(self.runner.device)
        return time.perf_counter() - t0

    def measure(
        self,
        points: list[GridPoint],
        repeats: int,
        warmup: int = 1,
        on_pass: Callable[[int, int], None] | None = None,
    ) -> list[ProfileRow]:
        """One row per point: the median (and min) of ``repeats`` timed runs after
        ``warmup`` untimed ones. Each pass runs every point once, so a slow spell on a
        shared machine spreads over all points instead of spoiling one.
        ``on_pass(done, total)`` is called after every pass."""
        if repeats < 1 or warmup < 0:
            raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
        inputs = [
            (self.microbatch(pt, i), self._hidden(pt.prefill_tokens + pt.decode_tokens))
            for i, pt in enumerate(points)
        ]
        times: list[list[float]] = [[] for _ in points]
        total = warmup + repeats
        for pass_idx in range(total):
            for ts, (microbatch, hidden) in zip(times, inputs):
                t = self.time_once(microbatch, hidden)
                if pass_idx >= warmup:
                    ts.append(t)
            if on_pass is not None:
                on_pass(pass_idx + 1, total)
        return [self._row(pt, ts) for pt, ts in zip(points, times)]

    def _row(self, pt: GridPoint, times: list[float]) -> ProfileRow:
        s = self.setup
        return ProfileRow(
            stage=s.stage.stage_idx,
            prefill_tokens=pt.prefill_tokens,
            decode_tokens=pt.decode_tokens,
            context_len=pt.context_len,
            seconds=statistics.median(times),
            min_seconds=min(times),
            repeats=len(times),
            num_layers=s.stage.layer_end - s.stage.layer_start,
            threads=s.threads,
            dtype=s.stage.dtype,
            device=s.stage.device,
        )
