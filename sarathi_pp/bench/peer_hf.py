"""The Hugging Face peer of the serving benchmark: the same requests through transformers'
continuous batching (paged KV cache, its own FIFO scheduler) on the same model folder.

Two modes:

* ``generate_batch``: every request arrives at 0 and all want the same number of tokens:
  ``model.generate_batch`` takes them all at once (it has one ``max_new_tokens`` for all).
* ``manager``: otherwise. The continuous-batching manager (``init_continuous_batching``)
  runs its loop in a background thread while a feeder thread ``add_request``\\ s each
  request at its arrival time, each with its own ``max_new_tokens``; the caller's thread
  collects results (and drives ``progress``).

Both honour the arrivals, so ``latency_comparable`` is True unless a request fails.

Note [clocks]: transformers stamps tokens (``record_timestamps=True``), lifespans and
creation times with ``time.perf_counter()``. The outputs use ``time.monotonic()`` like our
engine's ``RequestMetrics``; a perf_counter time ``t`` becomes ``t + offset``, with the
offset read once, bracketed by two ``monotonic()`` reads (on Linux both clocks are
CLOCK_MONOTONIC: the offset is about 0, and its error at most half the time between the two
reads, far below ``CLOCK_TOLERANCE_S``).

Note [EOS]: ``eos_token_id=-1`` is transformers' "no EOS" (``None`` falls back to the model
config's EOS), so each request generates exactly ``output_tokens`` tokens, as our engine
with ``ignore_eos=True``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sarathi_pp.outputs import CompletionOutput, RequestMetrics, RequestOutput

if TYPE_CHECKING:
    from sarathi_pp.bench.workload import BenchRequest

DTYPES = ("float32", "bfloat16", "float16")
PAGE_SIZE = 256  # transformers' default page (block) size, in tokens
DEFAULT_MAX_BATCH_TOKENS = 8192  # transformers' default token budget per step
NUM_WARMUP_TOKENS = 2
WARMUP_PROMPT_LEN = 32
CLOCK_TOLERANCE_S = 1e-4  # slack for the perf_counter -> monotonic conversion (note [clocks])
RESULT_POLL_S = 0.5
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


@dataclass(frozen=True)
class PeerResult:
    outputs: list[RequestOutput]  # in the order of the requests; metrics on time.monotonic()
    mode: str  # "generate_batch" or "manager"
    latency_comparable: bool  # False: the runner marks the peer's latency columns
    note: str  # one line: what ran
    error: str | None = None  # the peer could not run or finish: why (the outputs kept)


@dataclass(frozen=True)
class _HF:
    """The transformers parts the peer needs (imported lazily: see ``_import_hf``)."""

    version: str
    auto_model: Any
    generation_config: Any
    cb_config: Any


def run_hf_peer(
    model_dir: str | Path,
    requests: list[BenchRequest],
    *,
    dtype: str = "float32",
    num_threads: int | None = None,
    device: str = "cpu",
    progress: Callable[[int], None] | None = None,
    attn_implementation: str = "sdpa",
    max_batch_tokens: int | None = None,
) -> PeerResult:
    """Serve ``requests`` with transformers' continuous batching; greedy, EOS ignored.

    ``max_batch_tokens`` (transformers' per-step token budget) defaults to 8192, its own
    default, lowered to what the whole workload's prefill needs when that is smaller: the
    same steps, without an attention-mask buffer sized for 8192 tokens. The timed run follows a
    warm-up of two short requests on the same manager.
    """
    path = _check_model_dir(model_dir)
    _check_requests(requests)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; valid: {', '.join(DTYPES)}")
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    batch_tokens = _batch_tokens(requests, max_batch_tokens)
    hf = _import_hf()
    import torch

    threads_before = torch.get_num_threads()
    try:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        with _quiet_cb_logger():
            model = _load_model(hf, path, dtype, device, attn_implementation, progress is not None)
            cb = _cb_config(hf, requests, batch_tokens)
            gen = hf.generation_config(do_sample=False, eos_token_id=-1)  # note [EOS]
            run = _run_generate_batch if _is_all_at_once(requests) else _run_manager
            mode, start, results, errors = run(model, requests, gen, cb, progress)
        offset = _perf_to_monotonic_offset()
        outputs = _to_outputs(requests, results, errors, start, offset)
        how = "all at t=0" if mode == "generate_batch" else "added at their arrival times"
        note = (
            f"transformers {hf.version} continuous batching, {mode} ({len(requests)} requests "
            f"{how}), attn "
            f"{attn_implementation} (paged, page {PAGE_SIZE}, {cb.num_blocks} blocks, "
            f"max_batch_tokens {batch_tokens}), {dtype}, {torch.get_num_threads()} threads, "
            f"{device}"
        )
    finally:
        torch.set_num_threads(threads_before)
    num_failed = sum(o.error is not None for o in outputs)
    if num_failed:
        note += f"; {num_failed} requests failed"
    return PeerResult(outputs, mode, latency_comparable=num_failed == 0, note=note)


# --- checks ----------------------------------------------------------------------------------
def _check_model_dir(model_dir: str | Path) -> Path:
    path = Path(model_dir).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model folder {str(path)!r} has no config.json")
    if not any(any(path.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        raise FileNotFoundError(
            f"model folder {str(path)!r} has no weights ({' or '.join(WEIGHT_PATTERNS)})"
        )
    return path


def _check_requests(requests: list[BenchRequest]) -> None:
    if not requests:
        raise ValueError("requests is empty: the peer needs at least one request")
    seen: set[str] = set()
    for r in requests:
        if r.request_id in seen:
            raise ValueError(f"request_id {r.request_id!r} appears twice")
        seen.add(r.request_id)
        if r.arrival_s < 0:
            raise ValueError(f"request {r.request_id!r}: arrival_s {r.arrival_s} is negative")
        if r.output_tokens < 1:
            raise ValueError(f"request {r.request_id!r}: output_tokens {r.output_tokens} < 1")
        if not r.prompt_token_ids:
            raise ValueError(f"request {r.request_id!r}: prompt_token_ids is empty")


def _import_hf() -> _HF:
    try:
        import transformers
        from transformers import (
            AutoModelForCausalLM,
            ContinuousBatchingConfig,
            GenerationConfig,
        )
    except ImportError as e:
        raise RuntimeError(
            f"the HF peer needs transformers with continuous batching "
            f"(AutoModelForCausalLM, GenerationConfig, ContinuousBatchingConfig): {e}"
        ) from e
    return _HF(
        transformers.__version__, AutoModelForCausalLM, GenerationConfig, ContinuousBatchingConfig
    )


# --- set-up ----------------------------------------------------------------------------------
@contextmanager
def _quiet_cb_logger() -> Iterator[None]:
    """Silence transformers' continuous-batching logger for the run (on CPU without psutil
    it logs an error about memory, and warns on every persistent ``generate_batch``)."""
    logger = logging.getLogger("ContinuousBatchingLogger")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _load_model(hf: _HF, path: Path, dtype: str, device: str, attn: str, bar: bool) -> Any:
    """``bar``: transformers' own progress bars (loading the weights) as they are; without,
    off while loading (the caller asked for no progress bar)."""
    import torch
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    if not bar:
        hf_logging.disable_progress_bar()
    try:
        model = hf.auto_model.from_pretrained(
            str(path), dtype=getattr(torch, dtype), attn_implementation=attn,
            trust_remote_code=False,
        )  # fmt: skip
    finally:
        if not bar and was_on:
            hf_logging.enable_progress_bar()
    return model.to(device).eval()


def _batch_tokens(requests: list[BenchRequest], max_batch_tokens: int | None) -> int:
    if max_batch_tokens is not None:
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        return max_batch_tokens
    # + 1 per request: a decode token may share the step with the last prefill token
    total = sum(len(r.prompt_token_ids) + 1 for r in requests)
    return min(DEFAULT_MAX_BATCH_TOKENS, max(total, WARMUP_PROMPT_LEN * 2))


def _cb_config(hf: _HF, requests: list[BenchRequest], batch_tokens: int) -> Any:
    """A cache that holds every request at once (on CPU without psutil transformers cannot
    size it from free memory) and no prefix sharing (our engine has none, and the warm-up
    must not prefill the timed prompts)."""
    pages = [-(-(len(r.prompt_token_ids) + r.output_tokens) // PAGE_SIZE) for r in requests]
    return hf.cb_config(
        page_size=PAGE_SIZE,
        num_blocks=sum(pages) + len(requests),  # + 1 page each: slack for the warm-up
        max_batch_tokens=batch_tokens,
        max_requests_per_batch=len(requests),
        allow_block_sharing=False,
    )


def _is_all_at_once(requests: list[BenchRequest]) -> bool:
    """``generate_batch`` can serve these: all arrive at 0 with one ``max_new_tokens``."""
    return all(r.arrival_s == 0 for r in requests) and len({r.output_tokens for r in requests}) == 1


def _warmup_prompts(requests: list[BenchRequest]) -> list[list[int]]:
    # The first request's leading tokens: ids valid for the model, never a timed prefix
    # (block sharing is off).
    return [list(requests[0].prompt_token_ids[:WARMUP_PROMPT_LEN])] * 2


# --- the two modes ---------------------------------------------------------------------------
# mode, start (monotonic), request id -> GenerationOutput, request id -> error of one never run
_RunOut = tuple[str, float, dict[str, Any], dict[str, str]]


def _run_generate_batch(
    model: Any,
    requests: list[BenchRequest],
    gen: Any,
    cb: Any,
    progress: Callable[[int], None] | None,
) -> _RunOut:
    """``generate_batch`` twice on one persistent manager: a warm-up, then the timed run.
    ``progress`` is called once, at the end (``generate_batch`` only has a tqdm bar)."""
    kwargs = {
        "generation_config": gen,
        "continuous_batching_config": cb,
        "persistent_manager": True,
        "warmup": False,  # CUDA-graph capture: nothing to do on CPU, and not timed anyway
    }
    try:
        model.generate_batch(
            inputs=_warmup_prompts(requests), max_new_tokens=NUM_WARMUP_TOKENS, **kwargs
        )
        prompts = [list(r.prompt_token_ids) for r in requests]
        start = time.monotonic()
        out = model.generate_batch(
            inputs=prompts,
            max_new_tokens=requests[0].output_tokens,
            record_timestamps=True,
            **kwargs,
        )
    finally:
        model.destroy_cached_continuous_batching_manager()
    if progress is not None:
        progress(len(out))
    return "generate_batch", start, _match_by_prompt(requests, list(out.values())), {}


def _match_by_prompt(requests: list[BenchRequest], results: list[Any]) -> dict[str, Any]:
    """Key ``generate_batch``'s results (in input order, failed ones missing, ids of its own
    ``req_<n>`` counter) by our request ids: the next unused result with the same prompt."""
    matched: dict[str, Any] = {}
    pos = 0
    for r in requests:
        prompt = list(r.prompt_token_ids)
        for k in range(pos, len(results)):
            if list(results[k].prompt_ids) == prompt:
                matched[r.request_id] = results[k]
                pos = k + 1
                break
    return matched


def _run_manager(
    model: Any,
    requests: list[BenchRequest],
    gen: Any,
    cb: Any,
    progress: Callable[[int], None] | None,
) -> _RunOut:
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    refused: dict[str, str] = {}  # request id -> why add_request failed (written by the feeder)
    stop_feeding = threading.Event()
    try:
        _manager_warmup(manager, _warmup_prompts(requests))
        start = time.monotonic()
        feeder = threading.Thread(
            target=_feed, args=(manager, requests, start, refused, stop_feeding), daemon=True
        )
        feeder.start()
        results = _collect(manager, requests, refused, progress)
        stop_feeding.set()  # if the loop died early: refuse what has not arrived yet, now
        feeder.join()
    finally:
        manager.stop(block=True)
        manager.destroy()
    return "manager", start, results, refused


def _manager_warmup(manager: Any, prompts: list[list[int]]) -> None:
    ids = [f"peer-warmup-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        manager.add_request(
            prompt, request_id=request_id, max_new_tokens=NUM_WARMUP_TOKENS, eos_token_id=-1
        )
    done = 0
    while done < len(ids):
        result = manager.get_result(timeout=RESULT_POLL_S)
        if result is not None and result.is_finished():
            done += 1
        elif result is None and not manager.is_running():
            raise RuntimeError("transformers' continuous-batching loop died during the warm-up")


def _feed(
    manager: Any,
    requests: list[BenchRequest],
    start: float,
    refused: dict[str, str],
    stop: threading.Event,
) -> None:
    """The feeder thread: each request at ``start + arrival_s`` (monotonic), in arrival order."""
    for r in sorted(requests, key=lambda r: r.arrival_s):
        if stop.wait(max(0.0, start + r.arrival_s - time.monotonic())):
            refused[r.request_id] = "not sent: transformers' generation loop had stopped"
            continue
        try:
            added = manager.add_request(
                list(r.prompt_token_ids),
                request_id=r.request_id,
                max_new_tokens=r.output_tokens,
                record_timestamps=True,
                eos_token_id=-1,  # note [EOS]
            )
        except Exception as e:  # reported per request, the run goes on
            refused[r.request_id] = f"add_request raised {e!r}"
            continue
        if added is None:
            refused[r.request_id] = "the manager refused the request (stopping or dead)"


def _collect(
    manager: Any,
    requests: list[BenchRequest],
    refused: dict[str, str],
    progress: Callable[[int], None] | None,
) -> dict[str, Any]:
    """Finished results by request id, until all are in (or refused) or the loop dies."""
    wanted = {r.request_id for r in requests}
    results: dict[str, Any] = {}
    while len(results) + len(refused) < len(wanted):
        result = manager.get_result(timeout=RESULT_POLL_S)
        if result is None:
            if not manager.is_running():
                break
            continue
        if result.is_finished() and result.request_id in wanted:
            results[result.request_id] = result
            if progress is not None:
                progress(len(results))
    return results


# --- outputs ---------------------------------------------------------------------------------
def _perf_to_monotonic_offset() -> float:
    """``monotonic() - perf_counter()``, read between two monotonic reads (note [clocks])."""
    before = time.monotonic()
    perf = time.perf_counter()
    after = time.monotonic()
    return (before + after) / 2 - perf


def _to_outputs(
    requests: list[BenchRequest],
    results: dict[str, Any],
    errors: dict[str, str],
    start: float,
    offset: float,
) -> list[RequestOutput]:
    outputs = []
    for r in requests:
        arrival = start + r.arrival_s
        result = results.get(r.request_id)
        if result is not None and result.error is None:
            outputs.append(_request_output(r, result, arrival, offset))
            continue
        if result is not None:
            reason = f"transformers: {result.error}"
        else:
            reason = errors.get(r.request_id, "transformers returned no result")
        outputs.append(_failed_output(r, arrival, reason))
    return outputs


def _request_output(r: BenchRequest, result: Any, arrival: float, offset: float) -> RequestOutput:
    tokens = list(result.generated_tokens)
    times = [t + offset for t in (result.timestamps or [])]
    _check_tokens_and_times(r, tokens, times, arrival)
    started, finished = result.lifespan
    metrics = RequestMetrics(
        arrival_time=arrival,
        # lifespan[0]: when the request left PENDING, i.e. its first prefill was scheduled
        first_scheduled_time=started + offset if started > 0 else None,
        first_token_time=times[0],
        finished_time=finished + offset if finished > 0 else times[-1],
        token_times=times,
    )
    completion = CompletionOutput(0, "", tokens, finish_reason="length")
    return RequestOutput(r.request_id, None, list(r.prompt_token_ids), [completion], True, metrics)


def _check_tokens_and_times(
    r: BenchRequest, tokens: list[int], times: list[float], arrival: float
) -> None:
    """Raise if transformers broke its contract: wrong numbers would reach the table."""
    where = f"HF peer, request {r.request_id!r}"
    if len(tokens) != r.output_tokens:
        raise RuntimeError(f"{where}: {len(tokens)} tokens generated, {r.output_tokens} asked")
    if len(times) != len(tokens):
        raise RuntimeError(f"{where}: {len(times)} token timestamps for {len(tokens)} tokens")
    if any(b < a for a, b in zip(times, times[1:])):
        raise RuntimeError(f"{where}: token timestamps go backwards: {times}")
    if times[0] < arrival - CLOCK_TOLERANCE_S:
        raise RuntimeError(
            f"{where}: first token at {times[0]:.6f} before its arrival at {arrival:.6f}"
        )


def _failed_output(r: BenchRequest, arrival: float, reason: str) -> RequestOutput:
    completion = CompletionOutput(0, "", [], finish_reason="error", error=reason)
    metrics = RequestMetrics(arrival_time=arrival)
    return RequestOutput(
        r.request_id, None, list(r.prompt_token_ids), [completion], True, metrics, error=reason
    )
