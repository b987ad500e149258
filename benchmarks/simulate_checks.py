"""The simulator's checks: simulated against measured on this machine, the SARATHI paper's
setups on simulated GPUs, and the simulator's own speed. Prints markdown tables.

    python benchmarks/simulate_checks.py --out runs/simchecks                 # everything
    python benchmarks/simulate_checks.py --out runs/simchecks --parts paper,gpt3,speed
    python benchmarks/simulate_checks.py --out runs/simchecks --parts machine --repeats 3

Parts:
- ``machine``: ``sarathi-pp profile`` of the stage of configs/tiny-llama.yaml (PP=1) and
  of configs/tiny-llama-pp2.yaml (PP=2), ``sarathi-pp bench`` of bubbles.yaml and
  pipeline-scaling.yaml per scheduler (``--repeats`` runs, the median kept), and
  ``sarathi-pp simulate --profile`` with the runtime's overheads measured on the first
  measured run's events (driver, dispatch, send, token return: medians per micro-batch).
- ``paper``: LLaMA-13B on one A6000 (1K/2K/3K tokens, batch 6, P:D 50, chunk 256) and
  LLaMA-33B on one A100 (batch 10/5/3 at 1K/2K/3K), sarathi vs orca: decode and
  end-to-end throughput.
- ``gpt3``: GPT-3 175B TP8-PP8 on A100s (configs/workloads/gpt3-paper.yaml, at most 27
  requests in the system, chunk 256), sarathi vs orca, and 8 replicas of TP8 (11
  requests each at most, round-robin): bubble time per request, throughput, TBT.
- ``speed``: 10,000 requests through 8 stages (configs/workloads/sim-speed.yaml), wall
  time of ``sarathi-pp simulate`` including summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from results import Run, add_record_flag

from sarathi_pp.report import load_log

CLI = [sys.executable, "-m", "sarathi_pp"]
SCHEDULERS = ("sarathi", "vllm", "orca")


def sh(args: list[str], log: Path) -> float:
    """Run a ``sarathi-pp`` command, its output in ``log``; the wall seconds."""
    t = time.perf_counter()
    with open(log, "w") as f:
        subprocess.run(CLI + args, check=True, stdout=f, stderr=subprocess.STDOUT)
    return time.perf_counter() - t


def load() -> str:
    a, b, c = os.getloadavg()
    return f"load avg {a:.2f} {b:.2f} {c:.2f}"


def comparison(d: Path) -> dict[str, dict[str, Any]]:
    c = json.loads((d / "comparison.json").read_text())
    return {r["name"]: r for r in c["runs"]}


def figures(run: dict[str, Any]) -> dict[str, float | None]:
    r, o = run["requests"], run["overall"]
    return {
        "tokens_per_s": r["generated_tokens_per_s"],
        "tbt_p50_ms": _ms(r["tbt_s"]["p50"]),
        "tbt_p99_ms": _ms(r["tbt_s"]["p99"]),
        "bubble_fraction": o["bubble_fraction"],
        "bubble_time_p50_ms": _ms(r["bubble_time_s"]["p50"]),
        "bubble_time_p90_ms": _ms(r["bubble_time_s"]["p90"]),
    }


def _ms(x: float | None) -> float | None:
    return None if x is None else 1e3 * x


def _median(xs: list[Any]) -> Any:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def measured_overheads(run_dir: Path) -> dict[str, float]:
    """The runtime's own time per micro-batch in a measured run, medians: driver (the
    tokens of j are back -> the next issue), dispatch (issue -> stage 0 has it), send
    (stage s ended -> stage s+1 has it), return (the last stage ended -> tokens back)."""
    log = load_log(run_dir / "events.jsonl")
    issue = {i.mb: i.t for i in log.issues}
    first, last = log.by_mb(0), log.by_mb(log.num_stages - 1)
    dispatch = [first[m].input_ready - t for m, t in issue.items() if m in first]
    ret = [t - last[m].send_end for m, t in log.dones if m in last]
    sends = [
        log.by_mb(s)[m].input_ready - log.by_mb(s - 1)[m].compute_end
        for s in range(1, log.num_stages)
        for m in log.by_mb(s)
    ]
    issues = sorted(issue.values())
    driver = []
    for _, t in log.dones:  # the next issue after each return of tokens
        k = next((x for x in issues if x >= t), None)
        if k is not None and k - t < 0.5:
            driver.append(k - t)
    med = lambda xs: max(0.0, statistics.median(xs)) if xs else 0.0  # noqa: E731
    return {"driver_s": med(driver), "dispatch_s": med(dispatch), "send_s": med(sends),
            "return_s": med(ret)}  # fmt: skip


# --- this machine -----------------------------------------------------------------------------
def _written(path: Path) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(path.stat().st_mtime))


def machine(
    run: Run, out: Path, repeats: int, num_requests: int | None, cached: bool = False
) -> list[str]:
    """Profiles and measured runs already in ``out`` are reused (an interrupted run resumes),
    and the output names each one reused with when it was written: figures measured at
    another time (another load) are not silently mixed with fresh ones."""
    reused: list[str] = []
    lines = [f"### This machine (profiled model), {load()} at the start", ""]
    lines += ["| PP | workload | scheduler | tokens/s meas / sim | TBT p50 ms meas / sim | "
              "TBT p99 ms meas / sim | bubble frac meas / sim |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for pp, config in ((1, "configs/tiny-llama.yaml"), (2, "configs/tiny-llama-pp2.yaml")):
        csv = out / f"profile-pp{pp}.csv"
        if cached and not csv.exists():
            continue
        if csv.exists():
            reused.append(f"{csv.name} ({_written(csv)})")
        else:
            sh(["profile", "--config", config, "--output", str(csv)], out / f"profile-pp{pp}.log")
        for wl in ("bubbles", "pipeline-scaling"):
            extra = ["--num-requests", str(num_requests)] if num_requests else []
            meas = []
            for k in range(repeats):
                d = out / f"meas-pp{pp}-{wl}-{k}"
                if cached and not (d / "comparison.json").exists():
                    break
                if (d / "comparison.json").exists():
                    reused.append(f"{d.name} ({_written(d / 'comparison.json')})")
                else:
                    sh(["bench", "--config", config, "--workload", f"configs/workloads/{wl}.yaml",
                        "--schedulers", ",".join(SCHEDULERS), "--run-dir", str(d), "--overwrite",
                        "--no-progress", *extra], out / f"{d.name}.log")  # fmt: skip
                meas.append(comparison(d))
            if not meas:
                continue
            oh = measured_overheads(out / f"meas-pp{pp}-{wl}-0" / "sarathi")
            d = out / f"sim-pp{pp}-{wl}"
            sh(["simulate", "--config", config, "--profile", str(csv), "--workload",
                f"configs/workloads/{wl}.yaml", "--schedulers", ",".join(SCHEDULERS),
                "--run-dir", str(d), "--overwrite", "--no-progress", *extra]
               + [a for k, v in oh.items() for a in (f"--{k[:-2].replace('_', '-')}-s", f"{v:.6f}")],
               out / f"{d.name}.log")  # fmt: skip
            sim = comparison(d)
            for s in SCHEDULERS:
                m = {k: _median([figures(r[s])[k] for r in meas]) for k in figures(sim[s])}
                f = figures(sim[s])
                for key, unit in (("tokens_per_s", "tok/s"), ("tbt_p50_ms", "ms")):
                    run.measure(f"PP={pp}, {wl}, {s}: {key} simulated", f[key], unit,
                                baseline=m[key], baseline_label=f"measured (median of {len(meas)})")  # fmt: skip
                run.measure(f"PP={pp}, {wl}, {s}: bubble fraction simulated",
                            100 * f["bubble_fraction"], "%",
                            baseline=100 * m["bubble_fraction"] if m["bubble_fraction"] is not None else None,
                            baseline_label="measured")  # fmt: skip
                lines.append(
                    f"| {pp} | {wl} | {s} | {m['tokens_per_s']:.1f} / {f['tokens_per_s']:.1f} | "
                    f"{m['tbt_p50_ms']:.1f} / {f['tbt_p50_ms']:.1f} | {m['tbt_p99_ms']:.1f} / "
                    f"{f['tbt_p99_ms']:.1f} | {m['bubble_fraction']:.3f} / {f['bubble_fraction']:.3f} |"
                )
            lines.append(
                f"|  | {wl} overheads (ms) |  | driver {1e3 * oh['driver_s']:.2f}, dispatch "
                f"{1e3 * oh['dispatch_s']:.2f}, send {1e3 * oh['send_s']:.2f}, return "
                f"{1e3 * oh['return_s']:.2f} |  |  |  |"
            )
    if reused:
        run.note(f"machine: reused from {out}, not measured by this run: {', '.join(reused)}")
        lines += ["", f"Reused from {out}, not measured by this run: {', '.join(reused)} "
                  "(delete them or pass another --out to measure again)."]  # fmt: skip
    return [*lines, "", f"({load()} at the end)"]


# --- the paper's single-GPU setups ------------------------------------------------------------
def workload_file(out: Path, name: str, total: int, batch: int, pd: int, n: int) -> Path:
    prompt = round(total * pd / (pd + 1))
    f = out / f"{name}.yaml"
    f.write_text(
        f"name: {name}\nnum_requests: {n}\nseed: 0\nprompt_tokens: {prompt}\n"
        f"output_tokens: {total - prompt}\narrivals: {{kind: all_at_once}}\n"
    )
    return f


def paper(run: Run, out: Path) -> list[str]:
    lines = ["### The paper's single-GPU setups (analytic model)", "",
             "| model, GPU | seq len | batch | decode tok/s orca / sarathi (x) | "
             "e2e tok/s orca / sarathi (x) | TBT p99 ms orca / sarathi |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    setups = [("llama-13b", "a6000", [(1024, 6), (2048, 6), (3072, 6)], 0.9),
              ("llama-33b", "a100-80gb", [(1024, 10), (2048, 5), (3072, 3)], 0.95)]  # fmt: skip
    for model, hw, points, util in setups:
        for total, batch in points:
            wf = workload_file(out, f"{model}-{total}", total, batch, 50, batch * 8)
            d = out / f"paper-{model}-{total}"
            sh(["simulate", "--model", f"configs/models/{model}", "--hardware", hw,
                "--workload", str(wf), "--schedulers", "orca,sarathi", "--chunk-size", "256",
                "--set", f"scheduler.max_num_seqs={batch}", "--set",
                f"cache.gpu_memory_utilization={util}", "--run-dir", str(d), "--overwrite",
                "--no-progress"], out / f"{d.name}.log")  # fmt: skip
            runs = comparison(d)
            dec = {s: decode_throughput(d / s) for s in ("orca", "sarathi")}
            e2e = {s: e2e_throughput(d / s, total) for s in ("orca", "sarathi")}
            p99 = {s: runs[s]["requests"]["tbt_s"]["p99"] * 1e3 for s in ("orca", "sarathi")}
            where = f"{model}, {hw}, {total} tokens, batch {batch}"
            run.measure(f"{where}: decode tok/s, sarathi", dec["sarathi"], "tok/s",
                        baseline=dec["orca"], baseline_label="orca", better="higher")  # fmt: skip
            run.measure(f"{where}: end-to-end tok/s, sarathi", e2e["sarathi"], "tok/s",
                        baseline=e2e["orca"], baseline_label="orca", better="higher")  # fmt: skip
            lines.append(
                f"| {model}, {hw} | {total} | {batch} | {dec['orca']:.0f} / {dec['sarathi']:.0f} "
                f"({dec['sarathi'] / dec['orca']:.2f}x) | {e2e['orca']:.0f} / {e2e['sarathi']:.0f} "
                f"({e2e['sarathi'] / e2e['orca']:.2f}x) | {p99['orca']:.1f} / {p99['sarathi']:.1f} |"
            )
    return lines


def decode_throughput(run: Path) -> float:
    """Decode tokens per second of decode work, as the paper counts it: a decode-only
    micro-batch's time is decode time; in a hybrid one the decodes cost the difference
    from a prefill-only micro-batch of the same chunk, estimated from the run's own
    prefill-only micro-batches (time per prefill token)."""
    log = load_log(run / "events.jsonl")
    events = log.stages[0]
    pre = [(e.compute_end - e.compute_start) / e.num_prefill_tokens for e in events
           if e.kind == "prefill"]  # fmt: skip
    per_prefill_token = statistics.median(pre) if pre else 0.0
    time_s, tokens = 0.0, 0
    for e in events:
        d = e.compute_end - e.compute_start
        if e.kind == "decode":
            time_s, tokens = time_s + d, tokens + e.num_decode_tokens
        elif e.kind == "hybrid":
            time_s += max(0.0, d - per_prefill_token * e.num_prefill_tokens)
            tokens += e.num_decode_tokens
    return tokens / time_s if time_s else float("nan")


def e2e_throughput(run: Path, total: int) -> float:
    s = json.loads((run / "summary.json").read_text())["requests"]
    return s["num_requests"] * total / s["duration_s"]


# --- GPT-3 --------------------------------------------------------------------------------------
def gpt3(run: Run, out: Path, num_requests: int) -> list[str]:
    common = ["--model", "configs/models/gpt3-175b", "--hardware", "a100-80gb", "--tp", "8",
              "--workload", "configs/workloads/gpt3-paper.yaml", "--num-requests",
              str(num_requests), "--chunk-size", "256", "--overwrite", "--no-progress"]  # fmt: skip
    runs = {}
    t = sh(["simulate", *common, "--pp", "8", "--schedulers", "sarathi,orca",
            "--set", "scheduler.max_num_seqs=27", "--run-dir", str(out / "gpt3-pp8")],
           out / "gpt3-pp8.log")  # fmt: skip
    for s, r in comparison(out / "gpt3-pp8").items():
        runs[f"{s}, TP8-PP8"] = r
    t += sh(["simulate", *common, "--replicas", "8", "--routing", "round_robin",
             "--schedulers", "orca,sarathi", "--set", "scheduler.max_num_seqs=11",
             "--run-dir", str(out / "gpt3-replicas")], out / "gpt3-replicas.log")  # fmt: skip
    for s, r in comparison(out / "gpt3-replicas").items():
        runs[f"{s}, 8 x TP8"] = r
    lines = [f"### GPT-3 175B on 64 simulated A100s ({num_requests} requests, simulated in "
             f"{t:.0f} s)", "",
             "| deployment | bubble time p50 / p90 (s) | req/s | tokens/s | TBT p50 / p99 (ms) |"
             " bubble frac |", "|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in runs.items():
        q = r["requests"]
        where = f"GPT-3 175B, {name}, {num_requests} requests"
        run.measure(f"{where}: bubble time per request p50", q["bubble_time_s"]["p50"], "s",
                    better="lower")  # fmt: skip
        run.measure(f"{where}: generated tokens/s", q["generated_tokens_per_s"], "tok/s",
                    better="higher")  # fmt: skip
        run.measure(f"{where}: TBT p99", q["tbt_s"]["p99"] * 1e3, "ms", better="lower")
        lines.append(
            f"| {name} | {q['bubble_time_s']['p50']:.2f} / {q['bubble_time_s']['p90']:.2f} | "
            f"{q['requests_per_s']:.2f} | {q['generated_tokens_per_s']:.0f} | "
            f"{q['tbt_s']['p50'] * 1e3:.0f} / {q['tbt_s']['p99'] * 1e3:.0f} | "
            f"{r['overall']['bubble_fraction']:.3f} |"
        )
    return lines


def speed(run: Run, out: Path) -> list[str]:
    before = load()
    t = sh(["simulate", "--model", "configs/models/llama-13b", "--hardware", "a100-80gb",
            "--pp", "8", "--pp-link", "nvlink", "--workload", "configs/workloads/sim-speed.yaml",
            "--schedulers", "sarathi", "--run-dir", str(out / "speed"), "--overwrite",
            "--no-progress"], out / "speed.log")  # fmt: skip
    s = json.loads((out / "speed" / "sarathi" / "summary.json").read_text())
    run.measure("simulate: 10,000 requests through 8 stages, wall", t, "s", better="lower",
                headline="simulator: 10,000 requests through 8 stages",
                detail=f"{s['overall']['num_microbatches']} micro-batches; simulation, "
                "summary.json, trace and timeline")  # fmt: skip
    return [f"### Speed: 10,000 requests through 8 stages: {t:.1f} s wall "
            f"({s['overall']['num_microbatches']} micro-batches, simulation + summary.json + "
            f"trace + timeline; {before} before, {load()} after)"]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/simchecks")
    p.add_argument("--parts", default="speed,paper,gpt3,machine")
    p.add_argument("--repeats", type=int, default=3, help="measured runs per point (median)")
    p.add_argument("--num-requests", type=int, default=None, help="machine: fewer requests")
    p.add_argument("--gpt3-requests", type=int, default=10000)
    p.add_argument(
        "--cached", action="store_true", help="machine: only the measured runs already on disk"
    )
    add_record_flag(p)
    args = p.parse_args(argv)
    run = Run("simulate_checks", argv, enabled=not args.no_record)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = {
        "speed": lambda: speed(run, out),
        "paper": lambda: paper(run, out),
        "gpt3": lambda: gpt3(run, out, args.gpt3_requests),
        "machine": lambda: machine(run, out, args.repeats, args.num_requests, args.cached),
    }
    for name in args.parts.split(","):
        lines = parts[name]()
        print("\n".join(lines) + "\n", flush=True)
    run.settings.update(parts=args.parts, repeats=args.repeats, num_requests=args.num_requests,
                        gpt3_requests=args.gpt3_requests)  # fmt: skip
    run.note("paper, gpt3: simulated GPUs (the analytic cost model), not measurements; "
             "machine: simulated against measured on this machine, ratio = simulated / "
             "measured; speed: the simulator's own wall time here.")  # fmt: skip
    run.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
