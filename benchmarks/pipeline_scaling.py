"""Pipeline scaling on CPU: PP=1 vs PP=2 stages, one thread per stage, same workload.

A prefill-heavy mixed workload (``--workload``, default
``configs/workloads/pipeline-scaling.yaml``: 24 requests, random token-id prompts of
256/512/1024 tokens, 32 output tokens each; greedy, EOS ignored, all submitted at once)
runs through ``LLM.generate`` twice in one process, one after the other, on the embedded
default model with the SARATHI scheduler (chunk 256):

* PP=1: the single-process executor; torch limited to ``--threads-per-stage`` (1) threads
  in this process, so it is the per-core baseline; one micro-batch in flight whatever
  ``--microbatches-in-flight`` says (Note [PP=1 at M=1]);
* PP=2: two Ray stage actors, ``num_threads_per_stage`` = ``--threads-per-stage`` each,
  ``num_microbatches_in_flight`` the library's default (``auto``) unless
  ``--microbatches-in-flight`` (``stages``: the default before ``auto``); the scheduler's
  ``balance_microbatches`` on unless ``--no-balance`` (both flags: the old defaults),
  ``prefill_pacing`` off unless ``--prefill-pacing``;
  ``--executor ray_compiled`` drives them through a Ray Compiled Graph (no recv/send
  spans then: the graph's channels carry the hidden states).

Only the ``generate`` call is timed, after the engine is built and a small warm-up
``generate`` has run. Both engines map their KV caches at start-up (``cache.prefault``;
``--no-prefault``: as the engine's default, as the run first writes each page): a fresh
engine's first run otherwise pays every cache page's first touch inside its steps, 15% of
the run on this project's VMs (host memory backed on demand), in PP=1 and in each stage.
Printed: wall time, generated tokens/s, prompt + generated tokens/s, the PP=2 / PP=1
throughput ratio and the pipeline efficiency = PP=1 wall / (stages x PP=2
wall) (1.0 = perfect scaling), and the ratio's ceiling on this machine: PP=1's wall over
the least time the PP=2 stages' measured compute allows (``least_wall_s``: every stage
busy from the pipeline's fill to its drain, no time of the runtime's own). The compute
itself is the machine's and the workload's: a decode-only micro-batch reads all of a
stage's weights whatever its size, so the decode-only tail (the last prompts' decodes, with
no prefill left to ride on) runs no faster on two stages than on one.

``--side-by-side`` (Note [side by side]) adds, after each pair, two PP=1 engines in two
processes running the whole workload at once: the throughput two cores give with no
pipeline, i.e. the machine's bound for any split of the work over two cores (shared caches,
memory bus and the hypervisor included, the runtime excluded).

The cores' bound (Note [the cores' bound]): PP=1's wall over the least time the PP=2 run's
work could take on the usable cores, i.e. everything the machine did in that run (busy
core-seconds from ``/proc/stat``: the stages, the driver, Ray, the kernel) over the number of
cores, however it was scheduled. Where PP=2 comes close to it, the gap to 2x is work done,
not cores left idle.

Note [the two phases]: each run's wall cut where the last micro-batch holding prompt tokens
leaves the last stage (``phases:``), with each phase's ratio. The prompts' phase splits the
chunks' compute over the stages; the decode-only tail (the decodes left when the prompts are
done: 31 steps of the last prompt's) does not scale: each step waits for the one before it
to pass every stage and come back through the driver, and a sequence decodes at most once
per micro-batch in flight while prompts remain, so PP=2 at M=3 leaves 516 decodes to its
tail where PP=1 leaves 207. On a CPU those decodes are not free riders either: above ~8 rows
a decode micro-batch is compute-bound (``sarathi-pp profile --decode-sweep``: the embedded
model's 8 layers take ~19 ms for 1-8 decode rows, 40 ms for 16, 60 ms for 24). 2026-12-04 on
the EPYC VM, M=3: prompts 1.92-1.99x, the tail 0.48-0.63x (1.05-1.76 s against 0.65-0.85 s).

Where the machine's CPU time went in each run (``/proc``, Linux): the stages' compute (their
threads' CPU time inside ``execute``, also per micro-batch kind beside its wall time: wall
minus CPU is time the compute thread was off its core), the driver's process, everything
else (the stage processes outside ``execute``, Ray's own processes, the kernel), idle, and
``steal``: time the hypervisor gave a vCPU with work to another guest. Steal slows whichever
run it falls in, so a pair's ratio moves with it; each pair's line shows both runs' steal.

Where the time goes (Note [probes]): the script wraps, on instances only (no library file
is changed), ``ModelRunner.execute`` (metadata + layers + sampler: the stage's compute),
and inside the stage actors also ``StageTransport.recv`` / ``send``, recording
``time.monotonic()`` spans (one clock for every process on a Linux machine). Per stage it
prints compute time, busy fraction = compute / generate wall, receive wait, and the median
gap between one micro-batch's compute and the next (Ray dispatch, recv, Python). The
driver's time is split the same way: ``scheduler.schedule``, ``executor.submit`` (Ray
call issue), ``executor.wait_oldest`` (blocked on the stages) and applying results.

Ray is started here as the library starts one for its run (``start_local_ray``; Note [a
Ray of its own] in ``executors/ray.py``): worker niceness 0, since at Ray's default of 15 the
stage actors lose the cores to any other process and PP=1 (in this process) does not; Ray's
own per-task bookkeeping off.

``--repeat N`` alternates the two runs N times and prints every pair's ratio with their
median and range (the tables are the last pair's): on a noisy machine one pair's ratio can be
off by 10% either way, so compare medians of alternated runs, not single runs.

Note [PP=1 at M=1]: the single-process executor computes each micro-batch as it is
submitted, so more than one in flight hides nothing there; it only shares the running
decodes out over that many micro-batches (the scheduler's decode groups) and holds each
sequence's next decode until its micro-batch is applied: fewer decodes ride on each prefill
chunk and more are left for the decode-only tail (at M=3: 516 decode tokens in the tail's 31
micro-batches against 207 at M=1). The baseline is PP=1 as the engine's default runs it,
M=1. Before 2026-12-04 (13:30 UTC) ``--microbatches-in-flight`` applied to PP=1 too; on the
wall it made no difference beyond the noise (five alternated pairs on the 2-core EPYC VM,
PP=1 at M=1 against M=3: median 29.83 against 29.89 s, ranges 29.2-31.6 and 29.3-32.3 s), so
the ratios measured so stand.

Run from the repository root: ``python benchmarks/pipeline_scaling.py [--quick] [--repeat N]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py

import torch  # noqa: E402
from common import (  # noqa: E402
    add_scheduling_flags,
    load_args_workload,
    load_average,
    machine_line,
    random_prompts,
)
from results import Run, add_record_flag, cores_note  # noqa: E402

from sarathi_pp import LLM, SamplingParams  # noqa: E402
from sarathi_pp.bench.workload import BenchRequest  # noqa: E402

WORKLOAD = "configs/workloads/pipeline-scaling.yaml"
QUICK_WORKLOAD = "configs/workloads/short.yaml"
BLOCK_SIZE = 16  # tokens per KV block (the CPU default)
NUM_BYTE_TOKENS = 256  # prompts use byte ids of the builtin tokenizer (valid in any vocab >= 256)
Span = tuple[float, float]  # (start, end) in time.monotonic() seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:tiny-llama")
    p.add_argument("--num-stages", type=int, default=2, help="stages of the pipelined run")
    p.add_argument("--threads-per-stage", type=int, default=1, help="torch threads per stage")
    add_scheduling_flags(
        p,
        runs="both runs",
        in_flight_of="the pipelined run's: ",
        in_flight_note="; PP=1 runs one (Note [PP=1 at M=1])",
    )
    p.add_argument("--scheduler", default="sarathi")
    p.add_argument("--executor", default="ray", choices=["ray", "ray_compiled"],
                   help="the pipelined run's executor")  # fmt: skip
    p.add_argument(
        "--schedule-ahead",
        default="auto",
        choices=["auto", "true", "false"],
        help="the pipelined run's parallel.schedule_ahead (the token ring: ray)",
    )
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument(
        "--prefault",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="cache.prefault in both runs: map the KV caches at start-up, so no timed step "
        "pays a page's first touch (in VMs whose host backs memory on demand, 15%% of a "
        "fresh engine's first run here); --no-prefault: the engine's default",
    )
    p.add_argument("--workload", default=None, help=f"workload YAML (default {WORKLOAD})")
    p.add_argument("--num-requests", type=int, default=None, help="default: the workload's")
    p.add_argument(
        "--quick", action="store_true", help=f"workload {QUICK_WORKLOAD}: checks the script"
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="PP=1 and the pipelined run alternated this many times: each pair's ratio, "
        "their median and range (the tables are the last pair's)",
    )
    p.add_argument(
        "--side-by-side",
        action="store_true",
        help="also run two PP=1 engines at once in two processes (each the whole workload, "
        "one thread each), after each pair: the throughput two cores give with no pipeline "
        "at all, i.e. this machine's bound for any split of the work over two cores",
    )
    add_record_flag(p)
    args = p.parse_args(argv)
    args.schedule_ahead = {"true": True, "false": False}.get(args.schedule_ahead, "auto")
    for name in ("num_stages", "threads_per_stage", "chunk_size", "repeat"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    return args


# --- probes ----------------------------------------------------------------------------------
# Note [probes]: each wrapper replaces a bound method on one object (an instance attribute),
# so it touches only this benchmark's engine. Inside a Ray actor the probes are installed
# through ``actor.__ray_call__`` (runs a function on the actor instance, queued after its
# earlier calls); the actor's own ``run`` is looked up on the class by Ray, but what it calls
# (``self.runner.execute``, ``self.transport.recv/send``) goes through the instances.
def _wrap(obj: object, name: str, spans: list[Span], cpu: list[Span] | None = None) -> None:
    """Record each call's ``time.monotonic()`` span in ``spans``, and its calling thread's
    CPU time span (``time.thread_time()``) in ``cpu`` if given: wall minus CPU is the time
    the thread was off a core (preempted, or blocked)."""
    inner = getattr(obj, name)

    def timed(*args, **kwargs):
        t0, c0 = time.monotonic(), time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            if cpu is not None:
                cpu.append((c0, time.thread_time()))
            spans.append((t0, time.monotonic()))

    setattr(obj, name, timed)


def install_stage_probes(stage) -> tuple[int, int]:
    """Runs inside a ``PipelineStage`` actor: time execute/recv/send; returns its torch
    threads and its niceness."""
    stage._bench_spans = {"execute": [], "execute_cpu": [], "recv": [], "send": []}
    _wrap(stage.runner, "execute", stage._bench_spans["execute"], stage._bench_spans["execute_cpu"])
    if stage.transport is not None:  # none under ray_compiled: the graph's channels
        if not stage.stage.is_first:
            _wrap(stage.transport, "recv", stage._bench_spans["recv"])
        if not stage.stage.is_last:
            _wrap(stage.transport, "send", stage._bench_spans["send"])
    return torch.get_num_threads(), os.nice(0)


def take_stage_spans(stage) -> dict[str, list[Span]]:
    """Runs inside a ``PipelineStage`` actor: the spans recorded so far, then clears them."""
    spans = {k: list(v) for k, v in stage._bench_spans.items()}
    for v in stage._bench_spans.values():
        v.clear()
    return spans


def _ticks_per_s() -> int:
    """The kernel's clock ticks per second (``/proc``'s CPU times are in ticks)."""
    return os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_stat() -> dict[str, float]:
    """The machine's CPU seconds so far by kind, summed over CPUs (``/proc/stat``'s first
    line; ``steal``: time the hypervisor ran something else while a vCPU had work). Empty
    where there is no ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:9]
    except OSError:
        return {}
    hz = _ticks_per_s()
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    return {n: int(v) / hz for n, v in zip(names, fields, strict=True)}


def thread_cpu() -> dict[tuple[int, int], tuple[str, str, float]]:
    """Every thread's CPU seconds so far (``/proc/*/task/*/stat``: user + system), by (pid,
    tid), with its process's and its own name (``comm``). Empty without ``/proc``."""
    hz = _ticks_per_s()
    out = {}
    for task in Path("/proc").glob("[0-9]*/task/[0-9]*"):
        try:
            stat = (task / "stat").read_text()
            proc = (task.parent.parent / "comm").read_text().strip()
        except OSError:  # gone meanwhile
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
        fields = rest.split()  # from field 3 (state); utime, stime are fields 14, 15
        out[(int(task.parent.parent.name), int(task.name))] = (
            proc, name, (int(fields[11]) + int(fields[12])) / hz,
        )  # fmt: skip
    return out


def thread_cpu_delta(before, after) -> dict[tuple[str, str], float]:
    """CPU seconds per (process name, thread name) between two ``thread_cpu()`` snapshots
    (threads born in between count from zero)."""
    delta: dict[tuple[str, str], float] = {}
    for key, (proc, name, cpu) in after.items():
        d = cpu - (before[key][2] if key in before else 0.0)
        if d > 0:
            delta[(proc, name)] = delta.get((proc, name), 0.0) + d
    return delta


@dataclass
class RunResult:
    name: str
    wall_s: float = 0.0
    window: Span = (0.0, 0.0)
    tokens: list[list[int]] = field(default_factory=list)
    stage_threads: list[int] = field(default_factory=list)
    stage_nice: list[int] = field(default_factory=list)
    stage_spans: list[dict[str, list[Span]]] = field(default_factory=list)  # per stage
    driver_spans: dict[str, list[Span]] = field(default_factory=dict)
    microbatches: list[tuple[str, int]] = field(
        default_factory=list
    )  # (kind, num_tokens) per micro-batch
    machine_cpu: dict[str, float] = field(default_factory=dict)  # proc_stat() over generate
    driver_cpu_s: float = 0.0  # this process's CPU time over generate (all its threads)
    threads_cpu: dict[tuple[str, str], float] = field(default_factory=dict)  # thread_cpu_delta


def install_driver_probes(llm: LLM, result: RunResult) -> None:
    """Time the engine loop's parts, and note every micro-batch submitted: each stage runs the
    same micro-batches in the same order, so a stage's i-th execute span is micro-batch i."""
    engine = llm.engine
    spans = result.driver_spans = {"schedule": [], "submit": [], "wait": [], "apply": []}
    _wrap(engine.scheduler, "schedule", spans["schedule"])
    _wrap(engine.executor, "submit", spans["submit"])
    _wrap(engine.executor, "wait_oldest", spans["wait"])
    _wrap(engine, "_apply", spans["apply"])
    submit = engine.executor.submit

    def noted(microbatch):
        result.microbatches.append((microbatch.kind, microbatch.num_tokens))
        return submit(microbatch)

    engine.executor.submit = noted


# --- runs ------------------------------------------------------------------------------------
def num_kv_blocks_for(requests: list[BenchRequest]) -> int:
    """Enough KV blocks for every request at once (no preemption), +1 block each of slack;
    the default would size each stage's cache from a 4 GiB budget, 3 such processes here."""
    return sum(-(-seq_len(r) // BLOCK_SIZE) + 1 for r in requests)


def seq_len(r: BenchRequest) -> int:
    return len(r.prompt_token_ids) + r.output_tokens


def build_llm(
    args: argparse.Namespace, num_stages: int, num_blocks: int, max_model_len: int
) -> LLM:
    return LLM(
        model=args.model,
        dtype="float32",
        device="cpu",
        scheduler=args.scheduler,
        chunk_size=args.chunk_size,
        pipeline_parallel_size=num_stages,
        num_threads_per_stage=args.threads_per_stage,
        # PP=1 always one (Note [PP=1 at M=1]); the pipelined run as asked
        num_microbatches_in_flight=args.microbatches_in_flight if num_stages > 1 else 1,
        balance_microbatches=args.balance,
        prefill_pacing=args.prefill_pacing,
        executor=args.executor if num_stages > 1 else "uniproc",
        schedule_ahead=args.schedule_ahead if num_stages > 1 else False,
        block_size=BLOCK_SIZE,
        num_kv_blocks=num_blocks,
        max_model_len=max_model_len,  # the cache must hold one sequence of this length
        prefault_kv_cache=args.prefault,  # not timed: before the warm-up
    )


def start_local_ray() -> bool:
    """Start Ray here (unless ``RAY_ADDRESS`` names a cluster) as the library starts one
    for its run (``executors.ray.start_ray``, Note [a Ray of its own]: a fresh local Ray,
    its workers at nice 0 like the PP=1 run in this process, Ray's own bookkeeping off);
    returns whether we did (``run_one`` then stops it after the run: each pipelined run gets
    a fresh Ray)."""
    from sarathi_pp.executors.ray import start_ray

    return start_ray()


def run_one(args: argparse.Namespace, num_stages: int, requests, warm) -> RunResult:
    if num_stages == 1:  # the single-process executor runs in this process
        torch.set_num_threads(args.threads_per_stage)
    started_ray = num_stages > 1 and start_local_ray()
    try:
        return _run_one(args, num_stages, requests, warm)
    finally:
        if started_ray:
            import ray

            ray.shutdown()


def warmed_llm(
    args: argparse.Namespace, num_stages: int, requests: list[BenchRequest], warm
) -> LLM:
    """The engine for ``requests`` (its KV cache sized to them), after a small warm-up
    ``generate`` of ``warm``."""
    max_len = max(seq_len(r) for r in requests)
    llm = build_llm(args, num_stages, num_kv_blocks_for(requests), max_len)
    try:
        warm_params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        llm.generate(warm, warm_params, use_tqdm=False)
    except BaseException:
        llm.shutdown()
        raise
    return llm


def timed_inputs(requests: list[BenchRequest]) -> tuple[list[list[int]], list[SamplingParams]]:
    """The timed ``generate``'s prompts and parameters: greedy, EOS ignored, each request's
    output length."""
    prompts = [list(r.prompt_token_ids) for r in requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_tokens, ignore_eos=True)
        for r in requests
    ]
    return prompts, params


def _run_one(
    args: argparse.Namespace, num_stages: int, requests: list[BenchRequest], warm
) -> RunResult:
    llm = warmed_llm(args, num_stages, requests, warm)
    try:
        result = RunResult(f"PP={num_stages}")
        actors = getattr(llm.engine.executor, "actors", None)
        if actors:
            import ray

            calls = [a.__ray_call__.remote(install_stage_probes) for a in actors]
            result.stage_threads, result.stage_nice = map(list, zip(*ray.get(calls)))
        else:
            sp = {"execute": [], "execute_cpu": [], "recv": [], "send": []}
            result.stage_spans = [sp]
            _wrap(llm.engine.executor.runner, "execute", sp["execute"], sp["execute_cpu"])
            result.stage_threads, result.stage_nice = [torch.get_num_threads()], [os.nice(0)]
        install_driver_probes(llm, result)
        prompts, params = timed_inputs(requests)
        threads0 = thread_cpu()
        stat0, p0, t0 = proc_stat(), time.process_time(), time.monotonic()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        t1, p1, stat1 = time.monotonic(), time.process_time(), proc_stat()
        result.threads_cpu = thread_cpu_delta(threads0, thread_cpu())
        result.wall_s, result.window = t1 - t0, (t0, t1)
        result.driver_cpu_s = p1 - p0
        result.machine_cpu = {k: stat1[k] - stat0[k] for k in stat0}
        result.tokens = [o.outputs[0].token_ids for o in outputs]
        if actors:
            result.stage_spans = ray.get([a.__ray_call__.remote(take_stage_spans) for a in actors])
        return result
    finally:
        llm.shutdown()


# Note [side by side]: two PP=1 engines in two processes, each running the whole workload
# at once, one thread each. Their combined throughput over one PP=1 run's is what two cores
# give when nothing is shared but the machine (memory bus, caches, the hypervisor's other
# tenants): no driver between them, no transfers, no pipeline fill or drain. A PP=2 run
# splits the same work over the same two cores and adds a driver on top, so its ratio
# stays below this bound; how far below is the runtime's share. Both processes build and
# warm their engine, meet at a barrier, then time ``generate``; the window runs from the
# first start to the last end (``time.monotonic()``: one clock for every process).
def _side_by_side_worker(args, requests, warm, barrier, queue) -> None:
    torch.set_num_threads(args.threads_per_stage)
    llm = warmed_llm(args, 1, requests, warm)
    try:
        spans: list[Span] = []
        _wrap(llm.engine.executor.runner, "execute", spans)
        prompts, params = timed_inputs(requests)
        barrier.wait()
        t0 = time.monotonic()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        t1 = time.monotonic()
        queue.put((t0, t1, total(spans), [o.outputs[0].token_ids for o in outputs]))
    finally:
        llm.shutdown()


@dataclass
class SideBySide:
    walls: list[float]  # each process's generate wall
    window_s: float  # first start to last end
    compute_s: list[float]  # each process's execute spans summed
    tokens: list[list[list[int]]]  # per process, per request

    def ratio(self, base: RunResult) -> float:
        """Two runs' throughput over one PP=1 run's (``base``, run alone in this process)."""
        return 2 * base.wall_s / self.window_s


def run_side_by_side(args: argparse.Namespace, requests, warm) -> SideBySide:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # no fork of this process's torch threads or Ray state
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=_side_by_side_worker, args=(args, requests, warm, barrier, queue))
        for _ in range(2)
    ]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=3600) for _ in procs]
    for proc in procs:
        proc.join()
        if proc.exitcode:
            raise SystemExit(f"side-by-side PP=1 process exited with {proc.exitcode}")
    return SideBySide(
        walls=[t1 - t0 for t0, t1, _, _ in results],
        window_s=max(r[1] for r in results) - min(r[0] for r in results),
        compute_s=[r[2] for r in results],
        tokens=[r[3] for r in results],
    )


def print_side_by_side(pairs: list[list[RunResult]], sides: list[SideBySide]) -> None:
    for pair, side in zip(pairs, sides, strict=True):
        base, pp = pair
        same = all(t == base.tokens for t in side.tokens)
        ratio, bound = throughput_ratio(pair), side.ratio(base)
        print(
            f"2 x PP=1 side by side: walls {', '.join(f'{w:.2f}' for w in side.walls)} s "
            f"(alone {base.wall_s:.2f} s), compute {', '.join(f'{c:.2f}' for c in side.compute_s)} s "
            f"(alone {total(base.stage_spans[0]['execute']):.2f} s): {bound:.2f}x "
            f"PP=1's throughput (the two-core bound); {pp.name} {ratio:.2f}x = "
            f"{ratio / bound:.0%} of it; outputs "
            + ("identical to PP=1's" if same else "DIFFER from PP=1's")
        )
    if len(sides) > 1:
        bounds = [s.ratio(p[0]) for p, s in zip(pairs, sides, strict=True)]
        print(
            f"two-core bound over {len(sides)} runs: median {statistics.median(bounds):.2f}x, "
            f"range {min(bounds):.2f}-{max(bounds):.2f}x"
        )


# --- report ----------------------------------------------------------------------------------
def total(spans: list[Span]) -> float:
    return sum(e - s for s, e in spans)


def median_gap_ms(spans: list[Span]) -> float:
    """Median time from the end of one span to the start of the next (ms)."""
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:])]
    return 1e3 * statistics.median(gaps) if gaps else float("nan")


def throughput_ratio(runs: list[RunResult]) -> float:
    """PP=N's throughput over PP=1's for one pair of runs of the same work."""
    base, pp = runs
    return base.wall_s / pp.wall_s


def least_wall_s(stage_spans: list[list[Span]]) -> float:
    """The least wall time a pipeline could take with these compute spans (one list per
    stage, in micro-batch order): no idle time but its fill and drain, the transfers and
    the runtime's own time taken as zero. Stage k computes every micro-batch, after the
    stages before it computed the first one and before the stages after it compute the
    last: max over k of (first spans of stages < k) + (all of stage k) + (last spans of
    stages > k). Every real run with these spans takes at least this long."""

    def length(span: Span) -> float:
        return span[1] - span[0]

    return max(
        sum(length(sp[0]) for sp in stage_spans[:k] if sp)
        + total(spans)
        + sum(length(sp[-1]) for sp in stage_spans[k + 1 :] if sp)
        for k, spans in enumerate(stage_spans)
    )


def ceiling_ratio(runs: list[RunResult]) -> float:
    """PP=1's wall over the least PP=N wall its stages' compute allows (``least_wall_s``):
    the throughput ratio a runtime with no cost of its own would reach on this machine."""
    base, pp = runs
    return base.wall_s / least_wall_s([sp["execute"] for sp in pp.stage_spans])


def print_throughput(runs: list[RunResult], num_prompt_tokens: int, num_gen_tokens: int) -> None:
    print(f"{'':<6} {'threads':>8} {'nice':>6} {'wall s':>8} {'gen tok/s':>10} {'all tok/s':>10}")
    for r in runs:
        threads = "+".join(str(t) for t in r.stage_threads)
        nice = "+".join(str(t) for t in r.stage_nice)  # of the process(es) computing
        print(
            f"{r.name:<6} {threads:>8} {nice:>6} {r.wall_s:>8.2f} {num_gen_tokens / r.wall_s:>10.1f} "
            f"{(num_prompt_tokens + num_gen_tokens) / r.wall_s:>10.1f}"
        )
    base, pp = runs
    num_stages = len(pp.stage_spans)
    print(
        f"throughput ratio {pp.name} / {base.name}: {throughput_ratio(runs):.2f}x "
        f"(ideal {num_stages}x); pipeline efficiency = {base.name} wall / ({num_stages} x "
        f"{pp.name} wall) = {base.wall_s / (num_stages * pp.wall_s):.1%}"
    )
    least = least_wall_s([sp["execute"] for sp in pp.stage_spans])
    print(
        f"ceiling with these compute times: {pp.name} could take {least:.2f} s at the least "
        f"(every stage busy from the fill to the drain, the runtime's own time zero): "
        f"{ceiling_ratio(runs):.2f}x; the rest, {pp.wall_s - least:.2f} s, is the runtime's "
        f"and the machine's other work"
    )


def print_stages(runs: list[RunResult]) -> None:
    """Compute, busy fraction and waits per stage (Note [probes])."""
    print(
        f"{'stage':<10} {'micro-b.':>8} {'compute s':>10} {'busy':>6} {'recv s':>7} "
        f"{'send s':>7} {'ms/mb':>6} {'gap ms':>7}"
    )
    for r in runs:
        for i, sp in enumerate(r.stage_spans):
            ex = sp["execute"]
            n = len(ex)
            print(
                f"{r.name + f' s{i}':<10} {n:>8} {total(ex):>10.2f} {total(ex) / r.wall_s:>6.1%} "
                f"{total(sp['recv']):>7.2f} {total(sp['send']):>7.2f} "
                f"{1e3 * total(ex) / max(n, 1):>6.1f} {median_gap_ms(ex):>7.2f}"
            )
    base, pp = runs
    pp_compute = [total(sp["execute"]) for sp in pp.stage_spans]
    print(
        f"{pp.name} compute: sum over stages {sum(pp_compute):.2f} s vs {base.name} "
        f"{total(base.stage_spans[0]['execute']):.2f} s (the same tokens; by kind below: "
        f"a decode-only step runs as one micro-batch per stage, each reading all of a "
        f"stage's weights); slowest stage {max(pp_compute):.2f} s = the least "
        f"{pp.name} wall possible"
    )


def print_kinds(runs: list[RunResult]) -> None:
    """Micro-batches by kind, with each stage's compute on them: more in-flight micro-batches split
    the same decodes over more micro-batches (a sequence is in at most one micro-batch at a time)."""
    print(
        f"{'micro-batches':<6} {'kind':<8} {'count':>6} {'tokens':>7}  compute s per stage "
        "(ms/micro-batch) and the computing thread's CPU s in it"
    )
    for r in runs:
        for kind in ("prefill", "hybrid", "decode"):
            idx = [i for i, (k, _) in enumerate(r.microbatches) if k == kind]
            if not idx:
                continue
            per_stage = []
            for sp in r.stage_spans:
                ex, cpu = sp["execute"], sp.get("execute_cpu", [])
                secs = sum(ex[i][1] - ex[i][0] for i in idx if i < len(ex))
                cpu_s = sum(cpu[i][1] - cpu[i][0] for i in idx if i < len(cpu))
                per_stage.append(f"{secs:7.2f} ({1e3 * secs / len(idx):6.1f}) cpu {cpu_s:6.2f}")
            tokens = sum(r.microbatches[i][1] for i in idx)
            print(f"{r.name:<6} {kind:<8} {len(idx):>6} {tokens:>7}  " + "  ".join(per_stage))


def phases(r: RunResult) -> tuple[float, float]:
    """Note [the two phases]: ``r``'s wall split where the last micro-batch holding prompt
    tokens leaves the last stage: (the prompts' phase, the decode-only tail)."""
    last = max((i for i, (k, _) in enumerate(r.microbatches) if k != "decode"), default=-1)
    ex = r.stage_spans[-1]["execute"] if r.stage_spans else []
    if last < 0 or last >= len(ex):
        return r.wall_s, 0.0
    cut = min(max(ex[last][1], r.window[0]), r.window[1])
    return cut - r.window[0], r.window[1] - cut


def print_phases(runs: list[RunResult]) -> None:
    """Note [the two phases]: the prompts' phase scales with the stages (the chunks'
    compute splits); the decode-only tail does not: each step of it waits for the step
    before to go through every stage, and more micro-batches in flight leave more decodes to
    it (a sequence decodes at most once per micro-batches in flight while prompts remain)."""
    (b1, b2), (p1, p2) = (phases(r) for r in runs)
    base, pp = runs
    ratio = lambda a, b: f"{a / b:.2f}x" if b > 0 else "-"  # noqa: E731
    tail_tokens = [sum(n for k, n in r.microbatches if k == "decode") for r in runs]
    print(
        f"phases: prompts {base.name} {b1:.2f} s, {pp.name} {p1:.2f} s ({ratio(b1, p1)}); "
        f"decode-only tail {base.name} {b2:.2f} s ({tail_tokens[0]} decodes), {pp.name} "
        f"{p2:.2f} s ({tail_tokens[1]} decodes) ({ratio(b2, p2)})"
    )


def print_driver(runs: list[RunResult]) -> None:
    print(
        f"{'driver':<6} {'schedule s':>10} {'submit s':>9} {'wait s':>7} {'apply s':>8} "
        f"{'other s':>8} {'submits':>8}"
    )
    for r in runs:
        d = {k: total(v) for k, v in r.driver_spans.items()}
        other = r.wall_s - sum(d.values())
        print(
            f"{r.name:<6} {d['schedule']:>10.2f} {d['submit']:>9.2f} {d['wait']:>7.2f} "
            f"{d['apply']:>8.2f} {other:>8.2f} {len(r.driver_spans['submit']):>8}"
        )


def busy_core_s(r: RunResult) -> float:
    """CPU seconds the whole machine was busy over ``r``'s timed ``generate`` (``/proc/stat``:
    user, nice, system, irq, softirq; every process, the kernel's own work included)."""
    return sum(r.machine_cpu.get(k, 0.0) for k in ("user", "nice", "system", "irq", "softirq"))


def cores_ratio(runs: list[RunResult], cores: int | None = None) -> float:
    """Note [the cores' bound]: the throughput ratio if the pipelined run's work had been
    packed onto the usable cores with no core ever idle: PP=1's wall over (the machine's busy
    CPU seconds in the pipelined run / the cores). Whatever the schedule, the same work takes
    at least that long; it counts the driver, Ray and the kernel beside the stages, so it
    says how much of the gap to the ideal is work done (the stages' extra compute, the
    runtime's and the machine's processes) rather than cores left idle (fill, drain, waits)."""
    base, pp = runs
    least = busy_core_s(pp) / (cores or len(os.sched_getaffinity(0)))
    return base.wall_s / least if least > 0 else float("nan")


def print_cpu(runs: list[RunResult]) -> None:
    """Where the machine's CPU time went over each timed ``generate`` (``/proc/stat``): the
    stages' compute (their threads' CPU time inside ``execute``), the driver's process
    (under PP=1 the compute too), everything else (the stage processes outside
    ``execute``, Ray's processes, the OS), idle, and the hypervisor's steal."""
    if not all(r.machine_cpu for r in runs):
        return
    print(
        f"{'cpu s':<6} {'window':>7} {'busy':>7} {'compute':>8} {'driver':>7} {'other':>7} "
        f"{'idle':>7} {'steal':>7}"
    )
    for r in runs:
        m = r.machine_cpu
        busy = busy_core_s(r)
        compute = sum(total(sp.get("execute_cpu", [])) for sp in r.stage_spans)
        in_driver = compute if len(r.stage_spans) == 1 else 0.0  # PP=1 computes in-process
        driver = r.driver_cpu_s - in_driver
        print(
            f"{r.name:<6} {len(os.sched_getaffinity(0)) * r.wall_s:>7.2f} {busy:>7.2f} "
            f"{compute:>8.2f} {driver:>7.2f} {busy - compute - driver:>7.2f} "
            f"{m['idle'] + m['iowait']:>7.2f} {m['steal']:>7.2f}"
        )
    cores = len(os.sched_getaffinity(0))
    pp = runs[1]
    compute = sum(total(sp.get("execute_cpu", [])) for sp in pp.stage_spans)
    print(
        f"the cores' bound (Note [the cores' bound]): {pp.name}'s {busy_core_s(pp):.2f} busy core-s "
        f"need {busy_core_s(pp) / cores:.2f} s on {cores} cores at the least, whatever the "
        f"schedule: {cores_ratio(runs):.2f}x ({pp.name} reached "
        f"{runs[0].wall_s / pp.wall_s / cores_ratio(runs):.0%} of it); its stages' compute alone "
        f"({compute:.2f} core-s): {runs[0].wall_s / (compute / cores):.2f}x"
    )
    for r in runs:  # the threads that took the most, as the kernel counts (1/100 s ticks)
        top = sorted(r.threads_cpu.items(), key=lambda kv: -kv[1])[:8]
        print(
            f"{r.name} busiest threads (process/thread: CPU s): "
            + ", ".join(f"{p}/{t}: {c:.2f}" for (p, t), c in top)
        )


def check_outputs(runs: list[RunResult], requests: list[BenchRequest]) -> None:
    expected = [r.output_tokens for r in requests]
    num_ok = sum([len(t) for t in r.tokens] == expected for r in runs)
    same = sum(a == b for a, b in zip(runs[0].tokens, runs[1].tokens, strict=True))
    print(
        f"outputs: lengths as requested in {num_ok}/{len(runs)} runs; {same}/{len(runs[0].tokens)} "
        f"requests identical in {runs[0].name} and {runs[1].name}"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run = Run("pipeline_scaling", argv, quick=args.quick, enabled=not args.no_record)
    cores = len(os.sched_getaffinity(0))
    print(machine_line(args.threads_per_stage) + f"; usable cores (affinity) {cores}")
    if cores < args.num_stages * args.threads_per_stage:
        print(
            f"WARNING: {cores} usable core(s) < {args.num_stages} stages x "
            f"{args.threads_per_stage} thread(s): the stages cannot all run at once"
        )
    run.note(cores_note(args.num_stages, args.threads_per_stage))
    if os.getloadavg()[0] > 1.0:
        print("WARNING: load average > 1: other processes compete for the cores; times are noisy")
    workload = load_args_workload(args, WORKLOAD, QUICK_WORKLOAD)
    requests = workload.requests(NUM_BYTE_TOKENS)
    num_prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    num_output_tokens = sum(r.output_tokens for r in requests)
    # warm-up prompts unlike the timed ones (seed 1): nothing of them is reused
    warm = random_prompts([min(len(r.prompt_token_ids) for r in requests)] * 2, NUM_BYTE_TOKENS, 1)
    print(
        f"workload: {workload.describe()} ({num_prompt_tokens} prompt tokens, "
        f"{num_output_tokens} output tokens), greedy, EOS ignored; "
        f"{args.scheduler} scheduler, chunk {args.chunk_size}; PP={args.num_stages}: executor "
        f"{args.executor}, schedule_ahead {args.schedule_ahead}; KV caches "
        + ("mapped at start-up (--prefault)" if args.prefault else "mapped as first written")
    )
    pairs, sides = [], []
    for i in range(args.repeat):  # alternated: a slow spell of the machine hits both sides
        pairs.append([run_one(args, n, requests, warm) for n in (1, args.num_stages)])
        if args.side_by_side:
            sides.append(run_side_by_side(args, requests, warm))
        if args.repeat > 1:
            base, pp = pairs[-1]
            print(f"pair {i + 1}/{args.repeat}: {base.name} {base.wall_s:.2f} s, {pp.name} "
                  f"{pp.wall_s:.2f} s: {throughput_ratio(pairs[-1]):.2f}x (ceiling "
                  f"{ceiling_ratio(pairs[-1]):.2f}x, cores {cores_ratio(pairs[-1]):.2f}x); "
                  f"steal {base.machine_cpu.get('steal', 0):.2f} / "
                  f"{pp.machine_cpu.get('steal', 0):.2f} s", flush=True)  # fmt: skip
    runs = pairs[-1]
    print_throughput(runs, num_prompt_tokens, num_output_tokens)
    print_stages(runs)
    print_kinds(runs)
    print_phases(runs)
    print_driver(runs)
    print_cpu(runs)
    for pair in pairs:
        check_outputs(pair, requests)
    if args.repeat > 1:
        print_repeats(pairs)
    if sides:
        print_side_by_side(pairs, sides)
    print(f"load avg (1 min) at the end: {load_average()}")
    run.settings.update(
        workload=workload.describe(), scheduler=args.scheduler, chunk_size=args.chunk_size,
        num_stages=args.num_stages, threads_per_stage=args.threads_per_stage,
        executor=args.executor, schedule_ahead=args.schedule_ahead,
        microbatches_in_flight=args.microbatches_in_flight, prefault=args.prefault,
        balance_microbatches=args.balance, prefill_pacing=args.prefill_pacing,
        repeat=args.repeat,
    )  # fmt: skip
    record(run, pairs, sides, num_output_tokens)
    for i, pair in enumerate(pairs, 1):
        same = all(a == b for a, b in zip(pair[0].tokens, pair[1].tokens, strict=True))
        run.check(f"pair {i}: {pair[1].name}'s outputs identical to PP=1's", same)
    run.write()


def record(
    run: Run, pairs: list[list[RunResult]], sides: list[SideBySide], num_gen_tokens: int
) -> None:
    """The throughput of PP=N against PP=1 (median walls over the alternated pairs), the
    pipeline efficiency, the ceiling and the cores' bound (medians), the two phases (the last
    pair), the two-core bound (with --side-by-side)."""
    med = statistics.median
    base_wall, pp_wall = med(p[0].wall_s for p in pairs), med(p[1].wall_s for p in pairs)
    pp = pairs[-1][1]
    n = len(pp.stage_spans)
    over = f"median of {len(pairs)} alternated pairs" if len(pairs) > 1 else "one pair"
    ratios = ", ".join(f"{throughput_ratio(p):.2f}" for p in pairs)
    run.measure(
        f"generated tokens/s, {pp.name}", num_gen_tokens / pp_wall, "tok/s",
        baseline=num_gen_tokens / base_wall, baseline_label="PP=1", better="higher",
        headline=f"{pp.name} / PP=1 throughput (one core per stage)",
        detail=f"{over}; pair ratios {ratios}",
    )  # fmt: skip
    run.measure(f"pipeline efficiency, {pp.name}", 100 * base_wall / (n * pp_wall), "%",
                better="higher", detail=f"PP=1 wall / ({n} x {pp.name} wall)")  # fmt: skip
    run.measure(
        f"throughput ratio's ceiling, {pp.name}", med(ceiling_ratio(p) for p in pairs), "x",
        better="higher", detail="the stages' measured compute, the runtime's own time zero",
    )  # fmt: skip
    if all(p[1].machine_cpu for p in pairs):
        run.measure(f"the cores' bound, {pp.name}", med(cores_ratio(p) for p in pairs), "x",
                    detail="the run's busy core-seconds packed onto the cores")  # fmt: skip
    (b1, b2), (p1, p2) = (phases(r) for r in pairs[-1])
    run.measure(f"prompts' phase wall, {pp.name}", p1, "s", baseline=b1,
                baseline_label="PP=1", better="lower", detail="the last pair")  # fmt: skip
    run.measure(f"decode-only tail wall, {pp.name}", p2, "s", baseline=b2,
                baseline_label="PP=1", better="lower", detail="the last pair")  # fmt: skip
    if sides:
        run.measure("two PP=1 side by side over one", med(sd.ratio(p[0]) for p, sd in
                    zip(pairs, sides, strict=True)), "x",
                    detail="the two-core bound with no pipeline")  # fmt: skip


def print_repeats(pairs: list[list[RunResult]]) -> None:
    """The throughput ratio of every alternated pair, with their median and range: on a
    noisy machine one pair can be off by 10% and more either way."""
    ratios = [throughput_ratio(pair) for pair in pairs]
    ceilings = [ceiling_ratio(pair) for pair in pairs]
    cores = [cores_ratio(pair) for pair in pairs]
    name, base_name = pairs[0][1].name, pairs[0][0].name
    print(
        f"throughput ratio {name} / {base_name} over {len(pairs)} alternated pairs: median "
        f"{statistics.median(ratios):.2f}x, range {min(ratios):.2f}-{max(ratios):.2f}x "
        f"({', '.join(f'{r:.2f}' for r in ratios)}); ceiling with each pair's compute times: "
        f"median {statistics.median(ceilings):.2f}x, range {min(ceilings):.2f}-"
        f"{max(ceilings):.2f}x; the cores' bound: median {statistics.median(cores):.2f}x, range "
        f"{min(cores):.2f}-{max(cores):.2f}x"
    )


if __name__ == "__main__":
    main()
