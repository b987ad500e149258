"""Load test of ``sarathi-pp serve`` with a real load generator (locust, headless).

    python benchmarks/serve_load.py                     # make serve-bench: SmolLM2, 60 s
    python benchmarks/serve_load.py --quick             # 20 s on a small random model (CI)
    python benchmarks/serve_load.py --pp 2 --users 16   # two Ray stage actors

Starts the server as a user would (``python -m sarathi_pp serve ... --port P``), waits for
``/health``, runs ``locust`` headless against it (``benchmarks/load/locustfile.py``:
streamed completions, greedy, ``ignore_eos``; locust lets each user finish its request at
the end, ``--stop-timeout``), then stops the server with SIGINT. Prints the client's
requests/s, TTFT and time-between-chunks percentiles (locust's), and the server's own
``/metrics`` deltas over the run; checks that they agree: every request the client
completed is one the server finished (``length``), the server's TTFT observations and
generated tokens match, no request failed. Exit status 1 if a check fails.

On this 2-core machine the server (engine thread + HTTP) and locust share the cores: read
the figures as this machine's, not the runtime's ceiling.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from results import Run, add_record_flag, cores_note  # noqa: E402

LOCUSTFILE = ROOT / "benchmarks" / "load" / "locustfile.py"
SERVED_NAME = "bench"
PERCENTILES = (50, 90, 99)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except OSError as e:  # connection refused while starting, or an HTTP error
        return getattr(e, "code", 0) or 0, ""


def metric_sums(text: str) -> dict[str, float]:
    """``name{labels} value`` lines summed per name (labels kept for finish reasons)."""
    out: dict[str, float] = {}
    for m in re.finditer(r"^(sarathi_pp_\w+)(\{[^}]*\})? (\S+)$", text, re.M):
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "sarathi_pp_requests_total":
            name += labels
        out[name] = out.get(name, 0.0) + value
    return out


def small_model(root: Path) -> str:
    """A small random Llama (byte tokenizer) for the quick run: seconds to build."""
    from sarathi_pp.stages.loader.builtin import build_tiny_llama_dir

    dims = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4)
    dims.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return str(build_tiny_llama_dir(root / "small-llama", **dims))


def start_server(args: argparse.Namespace, model: str, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sarathi_pp", "serve", "--model", model, "--port", str(port)]
    cmd += ["--served-model-name", SERVED_NAME, "--pipeline-parallel-size", str(args.pp)]
    for item in args.set:
        cmd += ["--set", item]
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + args.start_timeout
    while get(f"http://127.0.0.1:{port}/health")[0] != 200:
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise SystemExit(f"the server did not start; its log:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return server


def run_locust(args: argparse.Namespace, url: str, prompts: Path, out: Path) -> int:
    env = dict(os.environ, SARATHI_PP_MODEL=SERVED_NAME, SARATHI_PP_PROMPTS=str(prompts))
    env["SARATHI_PP_RESULTS"] = str(out)
    env.update(SARATHI_PP_MAX_TOKENS=str(args.max_tokens), SARATHI_PP_CHAT=str(int(args.chat)))
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", url]
    cmd += ["-u", str(args.users), "-r", str(args.spawn_rate), "-t", f"{args.duration}s"]
    cmd += ["--stop-timeout", "300", "--only-summary", "--loglevel", "WARNING"]
    return subprocess.run(cmd, env=env, cwd=ROOT).returncode


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100); nan for no values."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs) + 0.5) - 1))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (Ray actors when > 1)")
    p.add_argument("--users", type=int, default=8, help="concurrent locust users")
    p.add_argument("--spawn-rate", type=float, default=4.0, help="users started per second")
    p.add_argument("--duration", type=int, default=60, help="seconds of load")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompts-file", default=str(ROOT / "configs" / "demo-prompts-chat.txt"))
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds for /health")
    p.add_argument("--quick", action="store_true", help="20 s, 4 users, a small random model")
    add_record_flag(p)
    args = p.parse_args()
    run = Run("serve_load", quick=args.quick, enabled=not args.no_record)

    with tempfile.TemporaryDirectory(prefix="serve-load-") as tmp:
        tmp_dir = Path(tmp)
        model = args.model
        if args.quick:  # a random byte-level model: plain prompts (it has no chat template)
            model = small_model(tmp_dir)
            args.duration, args.users, args.spawn_rate, args.max_tokens = 20, 4, 4.0, 16
            args.chat = False
            args.set = [*args.set, "model.max_model_len=512"]
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        print(f"server: {model} PP={args.pp} on {url} (log {tmp_dir / 'server.log'})", flush=True)
        server = start_server(args, model, port, tmp_dir / "server.log")
        try:
            before = metric_sums(get(url + "/metrics")[1])
            t = time.monotonic()
            results_path = tmp_dir / "results.json"
            rc = run_locust(args, url, Path(args.prompts_file), results_path)
            wall = time.monotonic() - t
            after = metric_sums(get(url + "/metrics")[1])
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
        results = json.loads(results_path.read_text()) if results_path.exists() else []
    run.settings.update(model="a small random Llama" if args.quick else model, pp=args.pp,
                        users=args.users, duration_s=args.duration,
                        max_tokens=args.max_tokens, chat=args.chat, set=args.set)  # fmt: skip
    return report(args, results, before, after, wall, rc, run)


def report(
    args: argparse.Namespace,
    results: list[dict],
    before: dict[str, float],
    after: dict[str, float],
    wall: float,
    locust_rc: int,
    run: Run,
) -> int:
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    num_ok = len(results)
    tokens = sum(r["tokens"] or 0 for r in results)
    print(f"\n{args.users} users, {args.duration} s of load ({wall:.1f} s with the last "
          f"requests finishing), max_tokens {args.max_tokens}, PP={args.pp}")  # fmt: skip
    print(f"client (locust): {num_ok} requests completed, {num_ok / wall:.2f} requests/s, "
          f"{tokens / wall:.1f} tokens/s; locust exit status {locust_rc}")  # fmt: skip
    print(f"{'(ms)':<16}" + "".join(f"{'p' + str(q):>10}" for q in PERCENTILES) + f"{'count':>10}")
    series = {
        "ttft": [r["ttft"] for r in results if r["ttft"] is not None],
        "between chunks": [g for r in results for g in r["gaps"]],
        "end to end": [r["e2e"] for r in results],
    }
    for label, xs in series.items():
        cells = "".join(f"{1000 * percentile(xs, q):>10.1f}" for q in PERCENTILES)
        print(f"{label:<16}{cells}{len(xs):>10}")
    server_finished = delta('sarathi_pp_requests_total{finish_reason="length"}')
    server_all = sum(
        after[k] - before.get(k, 0.0) for k in after if k.startswith("sarathi_pp_requests_total")
    )
    server_ttft = delta("sarathi_pp_time_to_first_token_seconds_count")
    server_tokens = delta("sarathi_pp_generation_tokens_total")
    print(f"server (/metrics): {server_all:.0f} requests finished ({server_finished:.0f} by "
          f"length), {server_ttft:.0f} TTFT observations, {server_tokens:.0f} tokens")  # fmt: skip
    checks = [
        ("locust saw no failure", locust_rc == 0),
        ("the client completed some requests", num_ok > 0),
        ("server finished (all by length) == client completed", server_all == server_finished == num_ok),
        ("server TTFT observations == client completed", server_ttft == num_ok),
        ("server tokens == client tokens == completed x max_tokens",
         server_tokens == tokens == num_ok * args.max_tokens),
    ]  # fmt: skip
    for what, ok in checks:
        print(f"  [{'ok' if ok else 'FAIL'}] {what}")
    record(run, args, num_ok / wall, tokens / wall, series, checks)
    return 0 if all(ok for _, ok in checks) else 1


def record(run: Run, args: argparse.Namespace, req_rate: float, tok_rate: float,
           series: dict[str, list[float]], checks: list[tuple[str, bool]]) -> None:  # fmt: skip
    """The client's rates and percentiles (ms), and the checks against /metrics."""
    where = f"PP={args.pp}, {args.users} users"
    run.measure(f"{where}: streamed tokens/s", tok_rate, "tok/s", better="higher",
                headline="serving: streamed tokens/s (locust, OpenAI API)",
                detail=f"max_tokens {args.max_tokens}, {args.duration} s of load")  # fmt: skip
    run.measure(f"{where}: requests/s", req_rate, "req/s", better="higher")
    for label, xs in series.items():
        for q in (50, 99):
            run.measure(f"{where}: {label} p{q}", 1000 * percentile(xs, q), "ms", better="lower")
    for what, ok in checks:
        run.check(what, ok)
    run.note(cores_note(args.pp) if args.pp > 1 else None)
    run.note("The server (engine thread + HTTP) and locust share the machine's cores: these "
             "are this machine's figures, not the runtime's ceiling.")  # fmt: skip
    run.write()


if __name__ == "__main__":
    sys.exit(main())
