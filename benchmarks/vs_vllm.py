"""sarathi-pp against vLLM, at PP=1 and PP=2: throughput, latency and token agreement.

For each PP size this is ``sarathi-pp bench --config configs/tiny-llama[-pp2].yaml
--workload configs/workloads/mixed.yaml --peer vllm --run-dir DIR/ppN``: the reference
mixed workload (32 requests at t=0, token-id prompts of 128/512/1024 tokens, 64 output
tokens each, greedy, EOS ignored; ``--quick``: its first 8 requests) through our engine
(SARATHI, 256-token chunks), then through vLLM's ``LLMEngine`` from the peer venv (``make
peer-vllm``) on the same model folder, dtype, PP size and cores (PP=2: one rank per core
set, ``VLLM_CPU_OMP_THREADS_BIND``), with vLLM's own token budget and block size.

Recorded per PP size: generated tokens/s (ours, vLLM's as the baseline: the ratio is ours
over vLLM's), TTFT p50 and TBT p99 likewise, and how many requests generated identical
greedy tokens. Both sides are timed from their request metrics (first arrival to last
token); the machine's load average goes in the record (other processes move the ratio).

Run from the repository root: ``python benchmarks/vs_vllm.py [--quick] [--pp 1,2]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/results.py

from results import Run, add_record_flag, cores_note  # noqa: E402

from sarathi_pp.bench.suite import Bench, BenchOptions, PeerFailed  # noqa: E402
from sarathi_pp.bench.workload import load_workload  # noqa: E402
from sarathi_pp.config_file import load_config, parse_set_value  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ROOT / "configs" / "workloads" / "mixed.yaml"
CONFIGS = {1: ROOT / "configs" / "tiny-llama.yaml", 2: ROOT / "configs" / "tiny-llama-pp2.yaml"}
QUICK_REQUESTS = 8


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"the first {QUICK_REQUESTS} requests")
    p.add_argument("--pp", default="1,2", help="PP sizes, comma-separated (default 1,2)")
    p.add_argument("--run-dir", default=None, help="keep the bench run dirs here (DIR/ppN)")
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="sarathi-pp settings on top of the configs (repeatable), e.g. the defaults "
        "before balanced micro-batches: --set scheduler.balance_microbatches=false "
        "--set parallel.num_microbatches_in_flight=null",
    )  # fmt: skip
    add_record_flag(p)
    return p.parse_args(argv)


def overrides(items: list[str]) -> dict[str, Any]:
    """``--set`` items as ``section.key`` overrides."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise SystemExit(f"error: --set expects SECTION.KEY=VALUE, got {item!r}")
        out[key] = parse_set_value(value)
    return out


def bench_one(pp: int, workload: Any, run_dir: Path, sets: dict[str, Any]) -> dict[str, Any]:
    config = load_config(CONFIGS[pp]).replace(**sets)
    options = BenchOptions(
        schedulers=(config.scheduler.policy,), run_dir=run_dir, peers=("vllm",),
        overwrite=True, progress=False,
    )  # fmt: skip
    bench = Bench(config, workload, options)
    bench.start()
    try:
        comparison = bench.run()
    except PeerFailed as e:
        raise SystemExit(f"error: PP={pp}: {e} (records in {run_dir})") from None
    print(f"--- PP={pp} ---\n{bench.table(comparison)}")
    return comparison


def record(run: Run, pp: int, comparison: dict[str, Any]) -> None:
    ours, peer = comparison["runs"]
    detail = f"ours {ours['name']}; {peer['note']}"
    for name, path, better in (
        ("generated tokens/s", ("generated_tokens_per_s",), "higher"),
        ("TTFT p50", ("ttft_s", "p50"), "lower"),
        ("TBT p99", ("tbt_s", "p99"), "lower"),
    ):
        value, base = ours["requests"], peer["requests"]
        for key in path:
            value, base = value[key], base[key]
        unit = "tok/s" if name == "generated tokens/s" else "s"
        headline = f"throughput vs vLLM (PP={pp})" if unit == "tok/s" else None
        run.measure(
            f"{name}, PP={pp}", value, unit, baseline=base, baseline_label="vLLM",
            better=better, headline=headline, detail=detail if unit == "tok/s" else None,
        )  # fmt: skip
    agreement = peer["token_agreement"]
    run.measure(
        f"requests identical to vLLM token for token, PP={pp}", agreement["num_identical"],
        f"of {agreement['num_compared']}", better="higher",
    )  # fmt: skip
    run.note(cores_note(pp))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run = Run("vs_vllm", argv, quick=args.quick, enabled=not args.no_record)
    workload = load_workload(WORKLOAD)
    if args.quick:
        workload = workload.with_num_requests(QUICK_REQUESTS)
    pps = [int(x) for x in args.pp.split(",")]
    if any(pp not in CONFIGS for pp in pps):
        raise SystemExit(f"error: --pp: sizes {sorted(CONFIGS)} only, got {args.pp}")
    sets = overrides(args.set)
    for pp in pps:  # a bad --set fails here, before any run
        try:
            load_config(CONFIGS[pp]).replace(**sets)
        except (ValueError, TypeError) as e:
            raise SystemExit(f"error: --set: {e}") from None
    print(f"workload: {workload.describe()}")
    with tempfile.TemporaryDirectory(prefix="vs-vllm-") as tmp:
        base = Path(args.run_dir) if args.run_dir else Path(tmp)
        for pp in pps:
            record(run, pp, bench_one(pp, workload, base / f"pp{pp}", sets))
    run.settings.update(
        workload=workload.describe(), pp=pps, ours="SARATHI, chunk 256, block 16", sets=args.set,
        vllm="its defaults: max_num_batched_tokens, block_size; KV sized for the workload",
    )  # fmt: skip
    run.note("Both engines one after the other, each timed from its request metrics (first "
             "arrival to last token); vLLM from its own venv (make peer-vllm).")  # fmt: skip
    run.write()


if __name__ == "__main__":
    main()
