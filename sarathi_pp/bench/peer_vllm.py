"""The vLLM peer of the serving benchmark: the same requests, arrivals and model folder
through vLLM's ``LLMEngine`` at the same PP size, in a subprocess of the peer venv's python
(``make peer-vllm``), so the project's environment never imports vLLM.

The two sides speak a small versioned JSON protocol (``vllm_peer_main.py``'s docstring):
the workload and settings in a file, one JSON line per finished request out, appended as
they finish. The run's records are the HF peer's (``PeerResult``): a request the peer never
finished (it died, or refused) is a failed output, so the records and the comparison are
written all the same, and ``PeerResult.error`` says what went wrong.

Note [vLLM preloads]: vLLM's CPU backend asks for tcmalloc (``libtcmalloc_minimal.so.4``,
Debian ``libtcmalloc-minimal4``) and Intel OpenMP (``libiomp5.so``, in the venv) in
``LD_PRELOAD``: the allocator and the OpenMP runtime its kernels were tuned with. The peer
runs with whichever of the two are found (``preloads``). With PP > 1 each rank gets its
own cores (``VLLM_CPU_OMP_THREADS_BIND``, ``"0|1"``) unless the caller set that already;
with no thread count given, the rank(s) share every core this process may use (vLLM's own
``auto`` keeps one core back for its front end, ours does not).

Note [vLLM KV space]: on CPU vLLM reserves ``gpu_memory_utilization`` (0.92) of the
machine's memory unless the KV cache is sized explicitly, and refuses to start when less is
free (a shared machine). The peer sizes it (``kv_cache_memory_bytes``) to hold every request
of the workload at once, as the HF peer does: ``kv_cache_bytes``. ``VLLM_CPU_KVCACHE_SPACE``
(GiB), when set, wins (vLLM reads it).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sarathi_pp.bench.peer_hf import PeerResult, _check_model_dir, _check_requests
from sarathi_pp.outputs import CompletionOutput, RequestMetrics, RequestOutput
from sarathi_pp.records.run_dir import PEER_IN_FILE, PEER_LINES_FILE, PEER_LOG_FILE

if TYPE_CHECKING:
    from sarathi_pp.bench.workload import BenchRequest

PROTOCOL_VERSION = 1  # vllm_peer_main.PROTOCOL_VERSION must agree (a test checks)
PYTHON_ENV = "SARATHI_PP_VLLM_PYTHON"  # another venv's python (or a stub, in tests)
DEFAULT_VENV = ".venv-vllm"
PEER_SCRIPT = Path(__file__).with_name("vllm_peer_main.py")
TCMALLOC = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
)
POLL_S = 0.2
MIN_KV_BYTES = 64 << 20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LOG_TAIL_CHARS = 2000
SETTING_NAMES = (
    "pipeline_parallel_size", "dtype", "max_num_batched_tokens", "block_size",
    "kv_cache_memory_bytes", "enable_prefix_caching",
)  # fmt: skip


class PeerError(RuntimeError):
    """The peer could not run or finish: the message says why, for the user."""


def peer_python() -> Path:
    """The peer venv's python: ``$SARATHI_PP_VLLM_PYTHON``, else ``.venv-vllm/bin/python``
    in the current folder or the project's checkout; ``FileNotFoundError`` naming the
    paths looked at and ``make peer-vllm`` otherwise."""
    if os.environ.get(PYTHON_ENV):
        path = Path(os.environ[PYTHON_ENV]).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"${PYTHON_ENV} is {str(path)!r}: no such file")
        return path
    roots = [Path.cwd(), Path(__file__).resolve().parents[2]]
    looked = [root / DEFAULT_VENV / "bin" / "python" for root in dict.fromkeys(roots)]
    for path in looked:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the vLLM peer needs its own venv: run `make peer-vllm` in the sarathi-pp checkout "
        f"(looked for {', '.join(str(p) for p in looked)}), or point ${PYTHON_ENV} at the "
        f"python of a venv that has vLLM"
    )


def check_peer() -> None:
    """Before any model loads: the peer's python is there (``FileNotFoundError``)."""
    peer_python()


def preloads(python: Path) -> list[str]:
    """The libraries vLLM's CPU backend wants preloaded (note [vLLM preloads]) that exist."""
    venv = python.parent.parent
    found = [p for p in TCMALLOC if Path(p).is_file()][:1]
    found += [str(p) for p in sorted((venv / "lib").glob("libiomp5.so"))][:1]
    return found


def peer_env(python: Path, num_stages: int, num_threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    libs = preloads(python) + [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    if libs:
        env["LD_PRELOAD"] = ":".join(dict.fromkeys(libs))
    if "VLLM_CPU_OMP_THREADS_BIND" not in env:
        env["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind(num_stages, num_threads)
    return env


def threads_bind(num_stages: int, num_threads: int | None, cores: list[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND``: ``num_threads`` (default: every usable core) split
    evenly over the ranks, each its own cores (``"0|1"``, ``"0,1,2,3|4,5,6,7"``)."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    per_rank = max(1, (num_threads or len(cores)) // num_stages)
    ranks = []
    for rank in range(num_stages):
        ids = [cores[(rank * per_rank + k) % len(cores)] for k in range(per_rank)]
        ranks.append(",".join(str(i) for i in ids))
    return "|".join(ranks)


def kv_cache_bytes(model_dir: Path, requests: list[BenchRequest], dtype: str) -> int:
    """A KV cache that holds every request at once (note [vLLM KV space]): 2 (K and V) x
    layers x KV heads x head dim x the dtype's bytes per token, x 1.25 slack for blocks and
    the warm-up; at least 64 MiB."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg.get("num_attention_heads") or 1
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or (cfg.get("hidden_size") or 0) // heads
    per_token = 2 * (cfg.get("num_hidden_layers") or 0) * kv_heads * head_dim
    per_token *= DTYPE_BYTES.get(dtype, 4)
    tokens = sum(len(r.prompt_token_ids) + r.output_tokens for r in requests)
    return max(MIN_KV_BYTES, int(per_token * tokens * 1.25))


def workload_message(
    model_dir: Path,
    requests: list[BenchRequest],
    *,
    num_stages: int,
    dtype: str,
    max_num_batched_tokens: int | None = None,
    block_size: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    enable_prefix_caching: bool = False,
) -> dict[str, Any]:
    return {
        "version": PROTOCOL_VERSION,
        "settings": {
            "model": str(model_dir),
            "pipeline_parallel_size": num_stages,
            "dtype": dtype,
            "max_num_batched_tokens": max_num_batched_tokens,
            "block_size": block_size,
            "max_model_len": None,
            "kv_cache_memory_bytes": kv_cache_memory_bytes,
            "enable_prefix_caching": enable_prefix_caching,
            "seed": 0,
        },
        "requests": [
            {
                "request_id": r.request_id,
                "arrival_s": r.arrival_s,
                "prompt_token_ids": list(r.prompt_token_ids),
                "max_tokens": r.output_tokens,
            }
            for r in requests
        ],
    }


def read_records(path: Path) -> list[dict[str, Any]]:
    """The peer's output lines so far (a torn last line, from a peer killed mid-write, is
    left out)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def run_vllm_peer(
    model_dir: str | Path,
    requests: list[BenchRequest],
    *,
    dtype: str = "float32",
    num_threads: int | None = None,
    num_stages: int = 1,
    progress: Callable[[int], None] | None = None,
    log_dir: Path | None = None,
    max_num_batched_tokens: int | None = None,
    block_size: int | None = None,
    enable_prefix_caching: bool = False,
) -> PeerResult:
    """Serve ``requests`` with vLLM at PP=``num_stages``; greedy, EOS ignored. vLLM's own
    token budget and block size unless given; prefix caching as ours (the bench passes
    ``cache.enable_prefix_caching``). ``log_dir`` gets the peer's output
    (``peer.log``) and its protocol lines (``peer.jsonl``). A setting vLLM refuses, a
    protocol mismatch or a peer that dies: ``PeerResult.error`` (the finished requests kept)."""
    path = _check_model_dir(model_dir)
    _check_requests(requests)
    python = peer_python()
    message = workload_message(
        path, requests, num_stages=num_stages, dtype=dtype,
        max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
        kv_cache_memory_bytes=kv_cache_bytes(path, requests, dtype),
        enable_prefix_caching=enable_prefix_caching,
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="sarathi-vllm-peer-") as tmp:
        where = Path(log_dir) if log_dir is not None else Path(tmp)
        in_path, out_path = where / PEER_IN_FILE, where / PEER_LINES_FILE
        log_path = where / PEER_LOG_FILE
        in_path.write_text(json.dumps(message))
        out_path.unlink(missing_ok=True)
        # The peer's times are seconds since its own start: any base keeps every interval.
        start = time.monotonic()
        rc = _run(python, in_path, out_path, log_path, num_stages, num_threads, progress)
        records = read_records(out_path)
        log = log_path.read_text(errors="replace")
        log_tail = log[-LOG_TAIL_CHARS:] + _root_cause(log)
        in_path.unlink()
    bind = peer_env(python, num_stages, num_threads)["VLLM_CPU_OMP_THREADS_BIND"]
    return _result(requests, records, rc, log_tail, start, message["settings"], bind)


def _run(
    python: Path,
    in_path: Path,
    out_path: Path,
    log_path: Path,
    num_stages: int,
    num_threads: int | None,
    progress: Callable[[int], None] | None,
) -> int:
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [str(python), str(PEER_SCRIPT), str(in_path), str(out_path)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env=peer_env(python, num_stages, num_threads),
        )  # fmt: skip
        try:
            while proc.poll() is None:
                time.sleep(POLL_S)
                if progress is not None:
                    progress(sum(r.get("type") == "request" for r in read_records(out_path)))
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    return proc.returncode


def _root_cause(log: str) -> str:
    """vLLM's engine fails in its worker processes and re-raises "see root cause above":
    the first ``...Error: ...`` line its workers logged (with a newline before), or ''."""
    m = re.search(r"^.*? ERROR .*?\] (\w*(?:Error|Exception): .*)$", log, re.MULTILINE)
    return "" if m is None else "\n" + m.group(1)


def _result(
    requests: list[BenchRequest],
    records: list[dict[str, Any]],
    rc: int,
    log_tail: str,
    start: float,
    settings: dict[str, Any],
    bind: str,
) -> PeerResult:
    hello = next((r for r in records if r.get("type") == "hello"), None)
    done = next((r for r in records if r.get("type") == "done"), None)
    failure = next((r for r in records if r.get("type") == "error"), None)
    finished = {r["request_id"]: r for r in records if r.get("type") == "request"}
    error = _error(hello, done, failure, rc, log_tail, settings, len(finished), len(requests))
    outputs = [
        _request_output(r, finished[r.request_id], start)
        if r.request_id in finished
        else _failed_output(r, start, error or "the vLLM peer returned no result")
        for r in requests
    ]
    num_failed = sum(o.error is not None for o in outputs)
    version = hello["vllm"] if hello else "?"
    threads = f"cores {bind} (VLLM_CPU_OMP_THREADS_BIND)"
    budget = settings["max_num_batched_tokens"] or "vLLM's default"
    block = settings["block_size"] or "vLLM's default"
    note = (
        f"vLLM {version} LLMEngine ({len(requests)} requests added at their arrival times), "
        f"PP={settings['pipeline_parallel_size']}, max_num_batched_tokens {budget}, block "
        f"{block}, {settings['dtype']}, {threads}, prefix caching "
        f"{'on' if settings.get('enable_prefix_caching') else 'off'}"
    )
    if num_failed:
        note += f"; {num_failed} requests failed"
    return PeerResult(outputs, "llm_engine", num_failed == 0, note, error=error)


def _error(
    hello: dict | None,
    done: dict | None,
    failure: dict | None,
    rc: int,
    log_tail: str,
    settings: dict[str, Any],
    num_finished: int,
    num_requests: int,
) -> str | None:
    """What went wrong, for the user, or ``None``."""
    if failure is not None and failure.get("kind") == "version":
        return f"the vLLM peer speaks another protocol: {failure['message']}"
    if failure is not None and failure.get("kind") == "setting":
        cause = log_tail.rpartition("\n")[2] if "root cause" in failure["message"] else ""
        message = f"{failure['message']} {cause}".strip()
        named = [k for k in SETTING_NAMES if k in message]
        which = ", ".join(f"{k}={settings[k]!r}" for k in (named or SETTING_NAMES))
        return f"vLLM refused the settings ({which}): {message}"
    if hello is not None and hello.get("version") != PROTOCOL_VERSION:
        return (
            f"the vLLM peer answered protocol version {hello.get('version')!r}, expected "
            f"{PROTOCOL_VERSION}"
        )
    if failure is not None:
        return f"the vLLM peer failed after {num_finished}/{num_requests} requests: {failure['message']}"
    if done is None or rc != 0:
        tail = log_tail.strip().splitlines()[-5:]
        return (
            f"the vLLM peer died (exit status {rc}) after {num_finished}/{num_requests} "
            f"requests; the end of its log:\n  " + "\n  ".join(tail or ["(empty)"])
        )
    if num_finished != num_requests:
        return f"the vLLM peer finished {num_finished}/{num_requests} requests"
    return None


def _request_output(r: BenchRequest, record: dict[str, Any], start: float) -> RequestOutput:
    tokens = [int(t) for t in record["token_ids"]]
    times = [start + t for t in record["token_times_s"]]
    if len(tokens) != r.output_tokens or len(times) != len(tokens):
        reason = f"vLLM peer: {len(tokens)} tokens ({len(times)} times) for {r.output_tokens} asked"
        return _failed_output(r, start, reason)
    metrics = RequestMetrics(
        arrival_time=start + r.arrival_s,
        first_token_time=times[0],
        finished_time=times[-1],
        token_times=times,
    )
    completion = CompletionOutput(0, "", tokens, finish_reason=record.get("finish_reason"))
    return RequestOutput(r.request_id, None, list(r.prompt_token_ids), [completion], True, metrics)


def _failed_output(r: BenchRequest, start: float, reason: str) -> RequestOutput:
    completion = CompletionOutput(0, "", [], finish_reason="error", error=reason)
    metrics = RequestMetrics(arrival_time=start + r.arrival_s)
    return RequestOutput(
        r.request_id, None, list(r.prompt_token_ids), [completion], True, metrics, error=reason
    )
