"""Soak: many requests through one engine with Poisson arrivals, aborts, poisoned requests
and a KV cache small enough to preempt often; then the checks a long-running server needs.

    python benchmarks/soak.py                 # 1000 requests (~5 min on 2 cores)
    python benchmarks/soak.py --quick         # 150 requests (< 1 min): what CI runs
    python benchmarks/soak.py --pp 2          # the same through two Ray stage actors
    python benchmarks/soak.py --pp 2 --kill-stages 3   # ... and three stage actors killed

A small random Llama is built into a temp folder (the point is the engine's bookkeeping,
not the model). Every request is greedy with ``ignore_eos``; a tenth are aborted a random
number of steps after they arrive; a few are poisoned (``parallel.inject_fault``: the stage
raises whenever a micro-batch holds them); with ``--kill-stages N`` (PP >= 2) a random
stage actor is killed N times over the run (``parallel.max_stage_restarts`` = N), each at a
random step. Checks, each printed with its figure:

- every request that was neither aborted nor poisoned finishes with ``length`` and exactly
  the tokens of a clean reference run (the same prompts, one ``generate`` call, a big cache);
- every poisoned request finishes with ``error``, every aborted one with ``abort``;
- with ``--kill-stages N``: N stages lost, N times replaced, the engine alive (a lost stage
  costs recomputation, never a request: the first check covers their outputs);
- all KV blocks are free once the engine is idle;
- resident memory grows by less than 5% from the first fifth of the run to its end;
- ``schedule()`` with 10k waiting requests: p99 under 2 ms.
Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results import Run, add_record_flag, cores_note  # noqa: E402

from sarathi_pp import LLM, LLMEngine, SamplingParams, load_config  # noqa: E402
from sarathi_pp.cli.common import parse_set_items  # noqa: E402
from sarathi_pp.config import SchedulerConfig  # noqa: E402
from sarathi_pp.scheduler import create_scheduler  # noqa: E402
from sarathi_pp.sequence import Sequence  # noqa: E402

SMALL_LLAMA = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3,
)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--rate", type=float, default=200.0, help="Poisson arrivals per second")
    p.add_argument("--abort-fraction", type=float, default=0.1)
    p.add_argument("--poisoned", type=int, default=3, help="requests that make a stage raise")
    p.add_argument("--num-kv-blocks", type=int, default=24, help="16-token blocks: small")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (2: Ray actors)")
    p.add_argument(
        "--kill-stages", type=int, default=0,
        help="kill a random stage actor this many times at random steps (PP >= 2)",
    )  # fmt: skip
    p.add_argument("--scheduler", default="sarathi", help="the policy (sarathi, vllm, ...)")
    p.add_argument(
        "--set", dest="set_items", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="any other config key, as sarathi-pp's --set (e.g. parallel.executor=ray_compiled)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="150 requests: the CI version")
    add_record_flag(p)
    args = p.parse_args(argv)
    if args.quick:
        args.requests = min(args.requests, 150)
    if args.requests < 10 or not 0 <= args.abort_fraction < 1 or args.rate <= 0:
        p.error("--requests >= 10, --abort-fraction in [0, 1), --rate > 0")
    if args.poisoned >= args.requests // 2:
        p.error("--poisoned must be well below --requests")
    try:
        args.overrides = parse_set_items(args.set_items)
    except ValueError as e:
        p.error(str(e))
    if args.kill_stages < 0 or (args.kill_stages and args.pp < 2):
        p.error("--kill-stages needs --pp 2 or more (stage actors to kill) and is >= 0")
    return args


def rss_mb() -> float:
    """Resident memory now (Linux /proc), else the peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Workload:
    def __init__(self, args: argparse.Namespace) -> None:
        rng = random.Random(args.seed)
        n = args.requests
        self.prompts = [
            [rng.randrange(3, 250) for _ in range(rng.randint(8, 120))] for _ in range(n)
        ]
        self.max_tokens = [rng.randint(4, 40) for _ in range(n)]
        t, self.arrivals = 0.0, []
        for _ in range(n):
            t += rng.expovariate(args.rate)
            self.arrivals.append(t)
        others = list(range(n))
        self.poisoned = set(rng.sample(others, args.poisoned))
        rest = [i for i in others if i not in self.poisoned]
        num_aborts = int(n * args.abort_fraction)
        self.abort_after = {i: rng.randint(0, 30) for i in rng.sample(rest, num_aborts)}
        # the k-th kill after the request (index kills[k]) has arrived, a random stage
        self.kills = sorted(rng.sample(range(n // 10, n - n // 10), args.kill_stages))
        self.kill_stage = [rng.randrange(args.pp) for _ in range(args.kill_stages)]
        self.kill_delay = [rng.randint(0, 20) for _ in range(args.kill_stages)]  # steps

    def params(self, i: int) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens[i], temperature=0.0, ignore_eos=True)


def kill_stage(engine: LLMEngine, stage_idx: int) -> None:
    """Kill stage ``stage_idx``'s Ray actor, as a crash would (no clean exit)."""
    import ray

    ray.kill(engine.executor.actors[stage_idx])


def serve(engine: LLMEngine, w: Workload) -> tuple[dict, list[float], float, int]:
    """Add each request at its arrival, abort the chosen ones some steps later, kill the
    chosen stages; the final outputs, RSS samples, the wall time and the kills done."""
    n = len(w.prompts)
    finished: dict[str, object] = {}
    steps_since: dict[int, int] = {}
    next_idx, start, rss = 0, time.monotonic(), []
    kills, kill_steps = 0, -1  # kills done; steps until the next one (-1: not armed)
    while len(finished) < n:
        # armed once the request has arrived and the last kill's stages are replaced
        replaced = engine.num_stage_restarts == kills
        if kills < len(w.kills) and kill_steps < 0 and next_idx > w.kills[kills] and replaced:
            kill_steps = w.kill_delay[kills]
        if kill_steps == 0:
            kill_stage(engine, w.kill_stage[kills])
            kills += 1
        if kill_steps >= 0:  # counting down to the next kill (-1 after it: not armed)
            kill_steps -= 1
        now = time.monotonic() - start
        while next_idx < n and w.arrivals[next_idx] <= now:
            engine.add_request(str(next_idx), None, w.params(next_idx),
                               prompt_token_ids=w.prompts[next_idx])  # fmt: skip
            if next_idx in w.abort_after:
                steps_since[next_idx] = 0
            next_idx += 1
        for i in list(steps_since):
            steps_since[i] += 1
            if steps_since[i] > w.abort_after[i]:
                engine.abort(str(i))
                del steps_since[i]
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
                if len(finished) % max(1, n // 20) == 0:
                    rss.append(rss_mb())
        if engine.num_inflight == 0 and not engine.has_unfinished_requests() and next_idx < n:
            time.sleep(min(0.01, max(0.0, w.arrivals[next_idx] - now)))
    return finished, rss, time.monotonic() - start, kills


def schedule_p99_ms(num_waiting: int = 10_000) -> tuple[float, float]:
    """``schedule()`` with ``num_waiting`` requests queued: (p50, p99) in ms."""
    sched = create_scheduler(SchedulerConfig(chunk_size=256, max_num_seqs=64), 4096, 16, 2048, 2)
    for i in range(num_waiting):
        sched.add(Sequence(i, str(i), [1] * 100, SamplingParams(max_tokens=4), 0.0))
    times = []
    for k in range(300):
        t = time.perf_counter()
        mb = sched.schedule(1.0)
        times.append((time.perf_counter() - t) * 1e3)
        if mb is not None and k % 2:
            sched.on_step_done(mb, {c.seq_id: 5 for c in mb.chunks if c.do_sample}, 1.0)
    times.sort()
    return statistics.median(times), times[int(0.99 * len(times)) - 1]


def main(argv: list[str] | None = None) -> int:
    from sarathi_pp.stages.loader.builtin import build_tiny_llama_dir

    args = parse_args(argv)
    run = Run("soak", argv, quick=args.quick, enabled=not args.no_record)
    w = Workload(args)
    with tempfile.TemporaryDirectory() as tmp:
        layers = {**SMALL_LLAMA, "num_hidden_layers": max(2, args.pp)}  # a layer per stage
        model = str(build_tiny_llama_dir(Path(tmp) / "model", seed=args.seed, **layers))
        faults = ";".join(f"raise@stage={args.pp - 1},seq={i}" for i in sorted(w.poisoned))
        config = load_config(
            None, model=model, max_model_len=192, num_kv_blocks=args.num_kv_blocks,
            block_size=16, max_num_seqs=16, chunk_size=64, pipeline_parallel_size=args.pp,
            num_threads_per_stage=1, scheduler=args.scheduler,
            **{"parallel.inject_fault": faults or None,
               "parallel.max_stage_restarts": args.kill_stages, **args.overrides},
        )  # fmt: skip
        engine = LLMEngine(config)
        try:
            finished, rss, wall, kills = serve(engine, w)
            bm = engine.scheduler.block_manager
            blocks_free = (bm.num_free_blocks, bm.num_blocks)
            preemptions = engine.scheduler.num_preemptions
            restarts, alive = engine.num_stage_restarts, engine.is_alive()
        finally:
            engine.shutdown()
        clean = [i for i in range(len(w.prompts)) if i not in w.poisoned and i not in w.abort_after]
        with LLM(model, max_model_len=192, dtype="float32") as ref_llm:
            ref = ref_llm.generate([w.prompts[i] for i in clean],
                                   [w.params(i) for i in clean], use_tqdm=False)  # fmt: skip
    reasons = {k: o.outputs[0].finish_reason for k, o in finished.items()}
    mismatched = [i for i, r in zip(clean, ref, strict=True)
                  if finished[str(i)].outputs[0].token_ids != r.outputs[0].token_ids]  # fmt: skip
    growth = (rss[-1] - rss[1]) / rss[1] if len(rss) > 2 else 0.0
    p50, p99 = schedule_p99_ms()
    checks = [
        (f"{len(clean)} clean requests: 'length' and the reference's tokens "
         f"({len(mismatched)} differ)",
         not mismatched and all(reasons[str(i)] == "length" for i in clean)),
        (f"{len(w.poisoned)} poisoned requests end with 'error'",
         all(reasons[str(i)] == "error" for i in w.poisoned)),
        (f"{len(w.abort_after)} aborted requests end with 'abort' (or finished first)",
         all(reasons[str(i)] in ("abort", "length") for i in w.abort_after)),
        (f"KV blocks free at idle: {blocks_free[0]} of {blocks_free[1]}",
         blocks_free[0] == blocks_free[1]),
        (f"RSS growth {growth:+.1%} ({rss[1]:.0f} -> {rss[-1]:.0f} MB)" if len(rss) > 2
         else "RSS: too few samples", growth < 0.05),
        (f"schedule() at 10k waiting: p50 {p50:.3f} ms, p99 {p99:.3f} ms", p99 < 2.0),
    ]  # fmt: skip
    if args.kill_stages:
        checks.append((
            f"{kills} of {args.kill_stages} stage kills done, {restarts} stages replaced, "
            f"engine {'alive' if alive else 'dead'}",
            kills == restarts == args.kill_stages and alive,
        ))  # fmt: skip
    settings = "".join(f", {k}={v}" for k, v in args.overrides.items())
    print(f"soak: {len(w.prompts)} requests at {args.rate:g}/s, {args.scheduler}, "
          f"PP={args.pp}{settings}, "
          f"{args.num_kv_blocks} KV blocks x 16; {wall:.1f} s; {preemptions} preemptions; "
          f"{sum(r == 'abort' for r in reasons.values())} aborted")  # fmt: skip
    for what, ok in checks:
        print(f"  {'ok  ' if ok else 'FAIL'} {what}")
        run.check(what, ok)
    where = f"{len(w.prompts)} requests at {args.rate:g}/s, PP={args.pp}{settings}"
    run.settings.update(scheduler=args.scheduler, num_kv_blocks=args.num_kv_blocks,
                        kill_stages=args.kill_stages, seed=args.seed)  # fmt: skip
    run.measure(f"wall, {where}", wall, "s", better="lower")
    run.measure(f"preemptions, {where}", preemptions, "", detail=f"{args.num_kv_blocks} KV blocks")
    if len(rss) > 2:
        run.measure(f"RSS growth, {where}", 100 * growth, "%", better="lower",
                    detail="first fifth of the run to its end")  # fmt: skip
    run.measure("schedule() with 10k waiting, p50", p50, "ms", better="lower")
    run.measure("schedule() with 10k waiting, p99", p99, "ms", better="lower")
    run.note(cores_note(args.pp) if args.pp > 1 else None)
    run.write()
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
