"""What prefix caching buys, with it on and off on the same pipeline (one run).

Two workloads, each served with ``cache.enable_prefix_caching`` on and off in turn on the
same live stages (``LLMEngine.set_prefix_caching``: an empty cache at the start of every
run), the two settings interleaved ``--repeats`` times:

* **the demo**: ``make demo``'s workload (SmolLM2-135M over 2 pipeline stages,
  ``configs/smollm2-pp2.yaml``: 16 chat questions about one ~330-token article, all sent
  at once, 40 tokens each). Reports TTFT p50 and generated tokens/s of each setting (the
  medians over the repeats), their ratios, and whether the tokens are identical.
* **a shared system prompt under Poisson arrivals**
  (``configs/workloads/shared-system-prompt-poisson.yaml`` on the embedded tiny model): the
  capacity search (``sarathi_pp/bench/capacity.py``) for the highest rate whose TBT P99
  (and P50 scheduling delay) meet the SLO, with caching on and off.

With PP=2 the two stage processes take this machine's two cores and the driver competes
with them: compare the ratios, not the absolute figures.

Run from the repository root: ``python benchmarks/prefix_caching.py [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py

from common import is_busy, load_average  # noqa: E402
from results import Run, add_record_flag  # noqa: E402

from sarathi_pp import LLM, SamplingParams  # noqa: E402
from sarathi_pp.bench.capacity import CapacityResult, Slo, search_capacity  # noqa: E402
from sarathi_pp.bench.runner import serve_run  # noqa: E402
from sarathi_pp.bench.workload import load_workload  # noqa: E402
from sarathi_pp.report.request_metrics import percentile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = ROOT / "configs" / "smollm2-pp2.yaml"
DEMO_SYSTEM = ROOT / "configs" / "demo-system.txt"
DEMO_PROMPTS = ROOT / "configs" / "demo-prompts-chat.txt"
SHARED_WORKLOAD = ROOT / "configs" / "workloads" / "shared-system-prompt-poisson.yaml"
SHARED_CONFIG = ROOT / "configs" / "tiny-llama.yaml"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs of each setting")
    p.add_argument("--quick", action="store_true", help="1 repeat, 8 questions, 24 requests")
    p.add_argument("--skip-demo", action="store_true", help="only the Poisson workload")
    p.add_argument("--skip-capacity", action="store_true", help="only the demo's workload")
    p.add_argument("--slo-tbt-p99", type=float, default=0.5, metavar="S")
    p.add_argument("--slo-sched-delay-p50", type=float, default=2.0, metavar="S")
    add_record_flag(p)
    args = p.parse_args(argv)
    if args.quick:
        args.repeats = 1
    return args


def _stats(outs) -> tuple[float, float, list[list[int]], int]:
    """TTFT p50 (s), generated tokens/s (first arrival to last finish), the token ids,
    prompt tokens read from the cache."""
    ttfts = sorted(o.metrics.ttft for o in outs if o.metrics.ttft is not None)
    start = min(o.metrics.arrival_time for o in outs)
    end = max(o.metrics.finished_time for o in outs if o.metrics.finished_time is not None)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    cached = sum(o.num_cached_tokens or 0 for o in outs)
    return percentile(ttfts, 50), sum(map(len, tokens)) / (end - start), tokens, cached


def demo(run: Run, args: argparse.Namespace) -> None:
    questions = [q for q in DEMO_PROMPTS.read_text().splitlines() if q.strip()]
    if args.quick:
        questions = questions[:8]
    system = DEMO_SYSTEM.read_text().strip()
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
             for q in questions]  # fmt: skip
    params = SamplingParams(max_tokens=40, temperature=0.0)
    got: dict[bool, list] = {True: [], False: []}
    with LLM.from_config(DEMO_CONFIG) as llm:
        llm.chat(chats[:2], params, use_tqdm=False)  # warm-up (first touches, kernels)
        for _ in range(args.repeats):
            for on in (False, True):
                llm.engine.set_prefix_caching(on)
                got[on].append(_stats(llm.chat(chats, params, use_tqdm=False)))
    med = {on: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
           for on, rs in got.items()}  # fmt: skip
    same = all(r[2] == got[False][0][2] for rs in got.values() for r in rs)
    cached = got[True][0][3]
    print(f"demo ({len(chats)} chat requests at once, PP=2 Ray, {args.repeats} repeats):")
    for on in (False, True):
        ttft, tps = med[on]
        print(
            f"  caching {'on ' if on else 'off'}: TTFT p50 {ttft * 1e3:8.1f} ms, {tps:7.1f} tokens/s"
        )
    print(f"  TTFT p50 {med[False][0] / med[True][0]:.2f}x lower, throughput "
          f"{med[True][1] / med[False][1]:.2f}x; {cached} prompt tokens read from the cache; "
          f"tokens identical: {same}")  # fmt: skip
    run.measure("demo TTFT p50, caching on", med[True][0] * 1e3, "ms",
                baseline=med[False][0] * 1e3, baseline_label="caching off", better="lower",
                headline="prefix caching: demo TTFT p50")  # fmt: skip
    run.measure("demo tokens/s, caching on", med[True][1], "tokens/s", baseline=med[False][1],
                baseline_label="caching off", better="higher",
                headline="prefix caching: demo throughput")  # fmt: skip
    run.check("demo: tokens identical with caching on and off", same)
    run.settings.update(demo_requests=len(chats), demo_repeats=args.repeats)


def floor_note(res: CapacityResult) -> str:
    """What the headline says of a capacity that is only a lower bound."""
    if res.bound != "lower":
        return ""
    return " (a floor: every probe met it)" if res.failed is None else " (a floor)"


def capacity(run: Run, args: argparse.Namespace) -> None:
    workload = load_workload(SHARED_WORKLOAD)
    if args.quick:
        workload = workload.with_num_requests(24)
    slo = Slo(args.slo_tbt_p99, args.slo_sched_delay_p50)
    found = {}
    out_dir = ROOT / "runs" / "prefix-caching-bench"
    slo_text = f"TBT p99 <= {slo.tbt_p99_s} s, sched delay p50 <= {slo.scheduling_delay_p50_s} s"
    print(f"{workload.describe()}; SLO: {slo_text}")
    with LLM.from_config(SHARED_CONFIG) as llm:
        engine = llm.engine
        for on in (False, True):

            def probe(rate: float, on: bool = on) -> dict:
                reqs = workload.with_rate(rate).requests(engine.spec.vocab_size)
                engine.set_prefix_caching(on)  # an empty cache for every probe
                d = out_dir / f"caching-{'on' if on else 'off'}" / f"rate-{rate:.4g}"
                return serve_run(engine, reqs, d)["requests"]

            res = search_capacity(probe, slo, workload.rate or 1.0,
                                  max_probes=6 if args.quick else 8)  # fmt: skip
            found[on] = res
            print(f"  caching {'on ' if on else 'off'}: {res.describe()}")
    on, off = found[True].capacity, found[False].capacity
    ratio = on / off if on and off else None
    print(f"  capacity with caching {ratio:.2f}x" if ratio else "  capacity: not comparable")
    run.measure("shared-prompt capacity, caching on", on, "req/s", baseline=off,
                baseline_label="caching off", better="higher",
                headline="prefix caching: capacity under the TBT SLO" + floor_note(found[True]),
                detail=f"{slo_text}; {found[True].describe()} / {found[False].describe()}")  # fmt: skip
    run.settings.update(workload=workload.describe(), slo=slo_text)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run = Run("prefix_caching", argv, quick=args.quick, enabled=not args.no_record)
    if not args.skip_demo:
        demo(run, args)
    if not args.skip_capacity:
        capacity(run, args)
    busy = " (busy: above the CPU count, rerun on a quiet machine)" if is_busy() else ""
    print(f"load avg (1 min) at the end: {load_average()}{busy}")
    run.note("Caching on and off interleaved on the same live stages, an empty cache at the "
             "start of every run; with PP=2 the two stages take both cores and the driver "
             "competes with them.")  # fmt: skip
    run.write()


if __name__ == "__main__":
    main()
