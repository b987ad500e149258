"""GPU figures on 7B layer shapes, one run, weights generated on the device (nothing loaded).

Decoder layers of Llama-2-7B's shape (hidden 4096, 32 heads of 128, MLP 11008; ``--layers``
of them, default 4) run through the engine's own code (``DecoderLayer``, the attention
backend ``auto`` chooses, ``build_metadata`` on hand-made micro-batches, the paged
``KVCache``), and this prints, after every figure, the attention backend that ran it and
every fallback so far (a figure measured on a fallback says so: Note [no silent fallback]):

* the bf16 matmul rate measured here (the best of a few large GEMMs): the peak for MFU;
* prefill MFU: one prompt chunk of 256-4096 tokens, layer FLOPs / time / matmul rate;
* a tile-quantization curve: time per token of chunks around multiples of 128 rows;
* the piggyback ratio (SARATHI's section 4.2): a decode token's cost in a hybrid step
  ((hybrid - prefill-only) / N) over its cost in a decode-only step (decode-only / N);
* decode-only steps without and with a CUDA graph (the layers' forward captured once);
* the control plane's L per micro-batch: the embedded model's engine on this device, the
  time per step outside ``ModelRunner.execute`` (scheduling, metadata, sampling return).
* decode-only steps through the engine at 1, 8 and 64 decodes, eager and with the stage's
  CUDA graphs (``--no-enforce-eager``), every graph fallback printed;
* the KV blocks the engine sizes from a profiling forward (``cache.activation_memory:
  profile``) against the estimate's;
* a PP=1 run's bubble report with its compute spans from CUDA events (how many spans came
  from the events, how many from the host's clock).
* the embedded model end to end on the mixed reference workload
  (``configs/workloads/mixed.yaml``, all at once): our engine's output tokens/s against
  transformers' ``generate_batch`` on the same device, and their greedy token agreement in
  the device's dtype (bf16 on CUDA; request by request, the first step they differ). Skipped,
  saying why, when transformers has no continuous batching.

``--device cpu --tiny`` runs every part on tiny shapes on CPU (no CUDA graph): the smoke
mode that tests/model/test_gpu_checks.py runs so the script cannot rot. Run from the
repository root: ``PYTHONPATH=. python benchmarks/gpu_checks.py`` (tests/gpu/run_checks.sh).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import time
from collections.abc import Callable

import torch
from results import Run, add_record_flag

from sarathi_pp.microbatch import MicroBatch, ScheduledChunk
from sarathi_pp.model_spec import spec_from_dict
from sarathi_pp.stages.model.attention import make_backend
from sarathi_pp.stages.model.backend_choice import AttentionRecord, choose_backend
from sarathi_pp.stages.model.decoder_layer import DecoderLayer, layer_ops
from sarathi_pp.stages.model.kv_cache import KVCache
from sarathi_pp.stages.model.rope import RotaryEmbedding
from sarathi_pp.stages.worker.metadata import build_metadata

LLAMA_7B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
    "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
}  # fmt: skip
TINY = {**LLAMA_7B, "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 300}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --tiny)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: checks the script")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (2-4 fit 5 minutes)")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per figure (median)")
    add_record_flag(p)
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device (use --device cpu --tiny for the smoke mode)")
    return args


class Layers:
    """``num_layers`` decoder layers with random weights on ``device`` and a paged KV cache."""

    def __init__(self, cfg: dict, num_layers: int, block_size: int, device, dtype, blocks: int):
        self.spec = spec = spec_from_dict({**cfg, "num_hidden_layers": num_layers})
        self.device, self.dtype, self.block_size = device, dtype, block_size
        self.record = AttentionRecord(0, "torch")
        self.backend = choose_backend("auto", device, dtype, block_size, self.record)
        attention = make_backend(
            self.backend, spec.num_heads, spec.num_kv_heads, spec.head_dim, self.record,
            max_blocks_per_seq=-(-spec.max_position_embeddings // block_size),
        )  # fmt: skip
        h, q, kv, inter = (spec.hidden_size, spec.num_heads * spec.head_dim,
                           spec.num_kv_heads * spec.head_dim, spec.intermediate_size)  # fmt: skip
        shapes = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                  "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                  "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
                  "mlp.down_proj.weight": (h, inter), "input_layernorm.weight": (h,),
                  "post_attention_layernorm.weight": (h,)}  # fmt: skip
        self.rope = RotaryEmbedding(spec, spec.max_position_embeddings, dtype, device)
        self.ops = layer_ops(self.rope, dtype, device)
        self.layers = []
        for i in range(num_layers):
            w = {f"model.layers.{i}.{k}": _weight(s, device, dtype) for k, s in shapes.items()}
            self.layers.append(DecoderLayer(spec, w, f"model.layers.{i}", attention, self.ops))
        self.kv = KVCache(
            num_layers, blocks, block_size, spec.num_kv_heads, spec.head_dim, dtype, device
        )
        self.next_block = 0

    def attention_line(self) -> str:
        """``  attention: flex_paged, no fallback`` or the backend and every fallback."""
        if not self.record.fallbacks:
            return f"  attention: {self.record.backend}, no fallback"
        lines = [f"  attention: {self.record.backend}, FELL BACK:"]
        return "\n".join(lines + [f"    - {f}" for f in self.record.fallbacks])

    def table(self, num_tokens: int) -> tuple[int, ...]:
        n = -(-num_tokens // self.block_size)
        start, self.next_block = self.next_block, self.next_block + n
        assert self.next_block <= self.kv.num_blocks, "KV cache too small for the figures"
        return tuple(range(start, start + n))

    def prepare(self, microbatch: MicroBatch):
        """What a step needs before its layers: metadata and input hidden states."""
        _, meta = build_metadata(microbatch, self.block_size, self.device, self.backend)
        x = torch.randn(microbatch.num_tokens, self.spec.hidden_size, device=self.device).to(
            self.dtype
        )
        return x, meta

    def run(self, x: torch.Tensor, meta) -> torch.Tensor:
        rotation = self.ops.rotation(meta.positions)
        for idx, layer in enumerate(self.layers):
            k_cache, v_cache = self.kv.flat(idx)
            x = layer(x, rotation, k_cache, v_cache, meta)
        return x

    def step(self, microbatch: MicroBatch) -> torch.Tensor:
        return self.run(*self.prepare(microbatch))

    def flops(self, microbatch: MicroBatch) -> int:
        """Matmul FLOPs of the layers (2 per multiply-add; attention QK^T and PV included)."""
        s = self.spec
        total = 0
        for c in microbatch.chunks:
            ctx = c.num_tokens * c.start + c.num_tokens * (c.num_tokens + 1) // 2
            total += 2 * c.num_tokens * s.layer_params() + 4 * ctx * s.num_heads * s.head_dim
        return total * s.num_layers


def _weight(shape: tuple[int, ...], device, dtype) -> torch.Tensor:
    if len(shape) == 1:
        return torch.ones(shape, device=device, dtype=dtype)
    return (torch.randn(shape, device=device) * shape[1] ** -0.5).to(dtype)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up call."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def matmul_rate(device: torch.device, dtype: torch.dtype, tiny: bool) -> float:
    """The best FLOP/s of a few large GEMMs in ``dtype`` (the MFU denominator)."""
    sizes = (
        [(256, 256, 256)] if tiny else [(8192, 8192, 8192), (4096, 4096, 11008), (8192, 4096, 4096)]
    )
    best = 0.0
    for m, k, n in sizes:
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(k, n, device=device).to(dtype)
        t = timed(lambda a=a, b=b: a @ b, device, 10)
        best = max(best, 2 * m * k * n / t)
    return best


def fill(layers: Layers, seq_id: int, num_tokens: int) -> ScheduledChunk:
    """A decode of a sequence whose first ``num_tokens`` tokens are in the KV cache."""
    table = layers.table(num_tokens + 1)
    chunk = 4096 if num_tokens >= 4096 else num_tokens
    for start in range(0, num_tokens, chunk):
        n = min(chunk, num_tokens - start)
        layers.step(MicroBatch(0, (ScheduledChunk(seq_id, start, (1,) * n, True, table),)))
    return ScheduledChunk(seq_id, num_tokens, (1,), False, table)


# --- the figures -----------------------------------------------------------------------------
def prefill_mfu(layers: Layers, peak: float, sizes: list[int], repeats: int, run: Run) -> None:
    print(f"prefill MFU ({layers.spec.num_layers} layers; vs the matmul rate above):")
    for n in sizes:
        mb = MicroBatch(1, (ScheduledChunk(10_000 + n, 0, (1,) * n, True, layers.table(n)),))
        x, meta = layers.prepare(mb)
        t = timed(lambda x=x, meta=meta: layers.run(x, meta), layers.device, repeats)
        rate = layers.flops(mb) / t
        print(
            f"  chunk {n:>5} tokens: {t * 1e3:8.2f} ms  {rate / 1e12:7.3f} TFLOP/s  MFU {rate / peak:6.1%}"
        )
        headline = "GPU prefill MFU, 7B layer shapes" if not run.quick and n == sizes[-1] else None
        run.measure(f"prefill MFU, chunk {n} tokens", 100 * rate / peak, "%", better="higher",
                    headline=headline, detail=f"{t * 1e3:.2f} ms, {rate / 1e12:.3f} TFLOP/s")  # fmt: skip
    print(layers.attention_line())


def tile_curve(layers: Layers, around: list[int], repeats: int) -> None:
    """Rows just below, at and above multiples of 128: a step in time per token where the
    GEMM tiles quantize."""
    print("tile quantization (prefill chunk rows around multiples of 128; us per token):")
    line = []
    for base in around:
        for n in (base - 64, base - 1, base, base + 1, base + 64):
            mb = MicroBatch(1, (ScheduledChunk(20_000 + n, 0, (1,) * n, True, layers.table(n)),))
            x, meta = layers.prepare(mb)
            t = timed(lambda x=x, meta=meta: layers.run(x, meta), layers.device, repeats)
            line.append(f"{n}:{t / n * 1e6:.2f}")
    print("  " + "  ".join(line))
    print(layers.attention_line())


def piggyback(
    layers: Layers, decodes: list[ScheduledChunk], chunk: int, repeats: int, run: Run
) -> None:
    prefill = ScheduledChunk(30_000, 0, (1,) * chunk, True, layers.table(chunk))
    kinds = {
        "prefill-only": MicroBatch(1, (prefill,)),
        "decode-only": MicroBatch(2, tuple(decodes)),
        "hybrid": MicroBatch(3, (prefill, *decodes)),
    }
    t = {k: timed(lambda mb=mb: layers.step(mb), layers.device, repeats) for k, mb in kinds.items()}
    n = len(decodes)
    alone, added = t["decode-only"] / n, (t["hybrid"] - t["prefill-only"]) / n
    print(
        f"piggyback ({n} decodes at {decodes[0].start} context, chunk {chunk}): step ms "
        + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in t.items())
        + f"; per decode token: alone {alone * 1e3:.3f} ms, piggybacked {added * 1e3:.3f} ms, "
        f"ratio {added / alone:.3f}"
    )
    run.measure(
        f"decode token cost piggybacked, {n} decodes at {decodes[0].start}, chunk {chunk}",
        added * 1e3, "ms", baseline=alone * 1e3, baseline_label="in a decode-only step",
        better="lower",
    )  # fmt: skip
    print(layers.attention_line())


def decode_graphs(layers: Layers, decodes: list[ScheduledChunk], repeats: int, run: Run) -> None:
    """A decode-only step's layers eagerly, then replayed from a CUDA graph captured once
    (same metadata and inputs: what a graph-per-batch-size runner would replay)."""
    mb = MicroBatch(4, tuple(decodes))
    x, meta = layers.prepare(mb)
    eager = timed(lambda: layers.run(x, meta), layers.device, repeats)
    msg = f"decode-only step ({len(decodes)} decodes, backend {layers.backend}): eager {eager * 1e3:.2f} ms"
    name = f"decode-only step, {len(decodes)} decodes"
    if layers.device.type != "cuda":
        print(msg + "; CUDA graph: skipped (not on CUDA)")
        run.measure(name, eager * 1e3, "ms", better="lower", detail="eager, no CUDA graph")
        print(layers.attention_line())
        return
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                layers.run(x, meta)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layers.run(x, meta)
        replay = timed(graph.replay, layers.device, repeats)
        print(msg + f"; CUDA graph replay {replay * 1e3:.2f} ms ({eager / replay:.2f}x)")
        run.measure(name, replay * 1e3, "ms", baseline=eager * 1e3, baseline_label="eager",
                    better="lower", detail="CUDA graph replay")  # fmt: skip
    except Exception as e:  # noqa: BLE001 - report, do not stop the other figures
        print(msg + f"; CUDA graph capture failed: {type(e).__name__}: {str(e)[:200]}")
        run.measure(name, eager * 1e3, "ms", better="lower",
                    detail=f"eager; CUDA graph capture failed: {type(e).__name__}")  # fmt: skip
    print(layers.attention_line())


def control_plane(device: str, steps: int, run: Run) -> None:
    """L per micro-batch on PP=1: the engine's time per step outside ``ModelRunner.execute``."""
    from sarathi_pp import LLM, SamplingParams

    with LLM("builtin:tiny-llama", device=device, dtype="float32", max_model_len=512) as llm:
        worker = llm.engine.executor.runner
        execute, inside = worker.execute, []

        def timed_execute(*a, **kw):
            t0 = time.perf_counter()
            out = execute(*a, **kw)
            sync(torch.device(device))
            inside.append(time.perf_counter() - t0)
            return out

        worker.execute = timed_execute
        params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        llm.generate([[5, 6, 7]] * 4, params, use_tqdm=False)  # warm-up
        inside.clear()
        t0 = time.perf_counter()
        llm.generate([[5, 6, 7, 8]] * 8, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    n = len(inside)
    print(
        f"control plane (embedded model, PP=1, {n} steps): step compute {sum(inside) / n * 1e3:.2f} ms, "
        f"outside execute (L) {(wall - sum(inside)) / n * 1e3:.2f} ms per micro-batch"
    )
    run.measure("control plane: outside execute (L) per micro-batch, PP=1",
                (wall - sum(inside)) / n * 1e3, "ms", better="lower",
                detail=f"embedded model; step compute {sum(inside) / n * 1e3:.2f} ms")  # fmt: skip


def engine_decode_graphs(device: str, tiny: bool, run: Run) -> None:
    """Decode-only steps through the engine (the embedded model, PP=1) at 1, 8 and 64
    decodes, eager (``model.enforce_eager``) and replaying the stage's CUDA graphs
    (``--no-enforce-eager``, Note [decode graphs]): the median time of a decode-only
    ``execute``, sampling and the token copy included; every graph fallback printed."""
    sizes = [1, 2] if tiny else [1, 8, 64]
    if not device.startswith("cuda"):
        for n in sizes:
            eager = _engine_decode_ms(device, n, True, tiny)[0]
            print(f"engine decode step ({n} decodes): eager {eager:.2f} ms; CUDA graphs: "
                  "skipped (not on CUDA)")  # fmt: skip
        return
    for n in sizes:
        eager, _ = _engine_decode_ms(device, n, True, tiny)
        try:
            graphs, why = _engine_decode_ms(device, n, False, tiny)
        except Exception as e:  # noqa: BLE001 - report, do not stop the other figures
            print(f"engine decode step ({n} decodes): eager {eager:.2f} ms; CUDA graphs "
                  f"FAILED: {type(e).__name__}: {str(e)[:200]}")  # fmt: skip
            continue
        print(f"engine decode step ({n} decodes): eager {eager:.2f} ms, CUDA graphs "
              f"{graphs:.2f} ms ({eager / graphs:.2f}x); {why}")  # fmt: skip
        run.measure(f"engine decode step, {n} decodes, embedded model, PP=1", graphs, "ms",
                    baseline=eager, baseline_label="enforce_eager", better="lower",
                    detail=f"CUDA graphs (--no-enforce-eager); {why}")  # fmt: skip


def _engine_decode_ms(device: str, n: int, eager: bool, tiny: bool) -> tuple[float, str]:
    """The median decode-only step (ms) with ``n`` sequences decoding, and what the decode
    graphs did (replays, eager decode micro-batches, fallbacks)."""
    from sarathi_pp import LLM, SamplingParams

    steps = 4 if tiny else 32
    times: list[float] = []
    with LLM("builtin:tiny-llama", device=device, max_model_len=256, max_num_seqs=max(n, 8),
             **{"model.enforce_eager": eager}) as llm:  # fmt: skip
        runner = llm.engine.executor.runner
        execute = runner.execute

        def timed_execute(microbatch, hidden=None):
            t0 = time.perf_counter()
            out = execute(microbatch, hidden)  # PP=1: returns after the token copy
            if not microbatch.num_prefill_tokens:
                times.append(time.perf_counter() - t0)
            return out

        runner.execute = timed_execute
        params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        llm.generate([[5, 6, 7]] * n, params, use_tqdm=False)  # warm-up
        times.clear()
        llm.generate([[5 + i, 6, 7, 8] for i in range(n)], params, use_tqdm=False)
        g = runner.graphs
        what = "no graphs" if g is None else (
            f"{g.replays} replays, {g.eager_decodes} decode micro-batches eager"
        )  # fmt: skip
        a = runner.attention
        if a is not None and a.fallbacks:
            what += f"; fallbacks: {'; '.join(a.fallbacks)}"
    times.sort()
    return times[len(times) // 2] * 1e3, what


def profiled_kv(device: str, run: Run) -> None:
    """The KV cache the engine sizes from a profiling forward (``cache.activation_memory:
    profile``, Note [profiling forward]) against the estimate's, the embedded model, PP=1."""
    from sarathi_pp import LLM

    if not device.startswith("cuda"):
        print("profiled KV capacity: skipped (not on CUDA: M_A is 0 on CPU)")
        return
    got = {}
    for how in ("estimate", "profile"):
        with LLM("builtin:tiny-llama", device=device, max_model_len=2048,
                 **{"cache.activation_memory": how}) as llm:  # fmt: skip
            got[how] = (llm.engine.num_kv_blocks, llm.engine.stage_memory[0].activation_bytes)
    (eb, ea), (pb, pa) = got["estimate"], got["profile"]
    print(f"KV capacity (embedded model, PP=1): profiled {pb} blocks (M_A {pa / 2**20:.1f} MiB) "
          f"vs estimate {eb} blocks (M_A {ea / 2**20:.1f} MiB)")  # fmt: skip
    run.measure("KV blocks, embedded model, PP=1, profiling forward", pb, "blocks",
                baseline=eb, baseline_label="estimate", better="higher",
                detail=f"M_A profiled {pa} B, estimated {ea} B")  # fmt: skip


def pp1_bubble_report(device: str, tiny: bool, run: Run) -> None:
    """A PP=1 run's bubble report, its compute spans from CUDA events on CUDA (Note [compute
    spans from CUDA events]): how many spans came from events and how many from the host's
    clock, and the report's busy time and bubble fraction."""
    import json
    import tempfile
    from pathlib import Path

    from sarathi_pp import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        with LLM("builtin:tiny-llama", device=device, max_model_len=512, run_dir=tmp,
                 overwrite=True) as llm:  # fmt: skip
            params = SamplingParams(max_tokens=8 if tiny else 64, temperature=0.0,
                                    ignore_eos=True)  # fmt: skip
            llm.generate([[5 + i, 6, 7, 8] * (2 + i) for i in range(8)], params, use_tqdm=False)
            llm.engine.write_run_records()
            clock = llm.engine.executor.runner.clock
        summary = json.loads((Path(tmp) / "summary.json").read_text())
    stage = summary["stages"][0]
    source = getattr(clock, "name", type(clock).__name__)
    spans = (f", {clock.gpu_spans} spans from events, {clock.host_spans} from the host"
             if hasattr(clock, "gpu_spans") else "")  # fmt: skip
    classes = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in stage["bubbles_s"].items() if v)
    print(
        f"PP=1 bubble report ({source}{spans}): busy {stage['busy_s'] * 1e3:.1f} ms, "
        f"bubble fraction {stage['bubble_fraction']:.3f} ({classes or 'no idle time'})"
    )
    if hasattr(clock, "gpu_spans"):
        run.measure("PP=1 bubble fraction, compute spans from CUDA events",
                    stage["bubble_fraction"], "fraction", better="lower",
                    detail=f"{clock.gpu_spans} spans from events, {clock.host_spans} host")  # fmt: skip


def engine_vs_transformers(device: str, dtype: torch.dtype, tiny: bool, run: Run) -> None:
    """The embedded model on the mixed workload: our engine vs transformers' generate_batch
    (tokens/s), and their greedy tokens compared request by request."""
    from sarathi_pp import LLM, SamplingParams
    from sarathi_pp.bench.peer_hf import run_hf_peer
    from sarathi_pp.bench.workload import load_workload
    from sarathi_pp.stages.loader.builtin import resolve_builtin

    model_dir = resolve_builtin("tiny-llama")
    workload = load_workload("configs/workloads/mixed.yaml")
    if tiny:
        workload = workload.with_num_requests(2)
    dtype_name = str(dtype).removeprefix("torch.")
    with LLM(model_dir, device=device, dtype=dtype_name, max_model_len=2048) as llm:
        requests = workload.requests(llm.engine.spec.vocab_size, 2048)
        prompts = [list(r.prompt_token_ids) for r in requests]
        params = SamplingParams(
            max_tokens=requests[0].output_tokens, temperature=0.0, ignore_eos=True
        )
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        ours_s = time.perf_counter() - t0
        runner = llm.engine.executor.runner
        a = runner.attention
        attention = (
            "?"
            if a is None
            else a.backend
            + (f", FELL BACK: {'; '.join(a.fallbacks)}" if a.fallbacks else ", no fallback")
        )
    num_tokens = sum(len(t) for t in ours)
    line = (
        f"end to end ({workload.name}, {len(requests)} requests, embedded model, {dtype_name}): "
        f"ours {num_tokens / ours_s:,.0f} tokens/s (attention {attention})"
    )
    name = f"embedded model end to end, {workload.name} workload, {dtype_name}"
    try:
        peer = run_hf_peer(model_dir, requests, dtype=dtype_name, device=device)
    except Exception as e:  # noqa: BLE001 - an older transformers: say so, keep the rest
        print(line + f"; transformers: skipped ({type(e).__name__}: {str(e)[:160]})")
        run.measure(name, num_tokens / ours_s, "tokens/s", better="higher",
                    detail=f"attention {attention}; transformers skipped")  # fmt: skip
        return
    outs = peer.outputs
    span = max(o.metrics.finished_time or 0.0 for o in outs) - min(
        o.metrics.arrival_time for o in outs
    )
    theirs = [list(o.outputs[0].token_ids) if o.outputs else [] for o in outs]
    hf_tokens = sum(len(t) for t in theirs)
    print(line + f"; transformers {peer.mode} {hf_tokens / span:,.0f} tokens/s ({peer.note})")
    run.measure(name, num_tokens / ours_s, "tokens/s", baseline=hf_tokens / span,
                baseline_label=f"transformers {peer.mode}", better="higher",
                detail=f"attention {attention}")  # fmt: skip
    first_diff = [
        next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
        for x, y in zip(ours, theirs)
    ]
    same = sum(d is None and len(x) == len(y) for d, x, y in zip(first_diff, ours, theirs))
    where = sorted(d for d in first_diff if d is not None)
    print(
        f"greedy agreement with transformers ({dtype_name}): {same}/{len(ours)} requests "
        f"identical" + (f"; the others first differ at steps {where}" if where else "")
    )
    run.measure(f"greedy requests identical to transformers, {dtype_name}", same, "requests",
                better="higher", detail=f"of {len(ours)}; first differences at {where}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run = Run("gpu_checks", argv, quick=args.tiny, enabled=not args.no_record)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"device: {name}; torch {torch.__version__}; {now}; {dtype}")
    tiny = args.tiny
    if tiny and device.type == "cpu":
        torch.set_num_threads(1)  # a smoke run: steadier on a shared machine, and quick
    peak = matmul_rate(device, dtype, tiny)
    print(f"matmul rate ({dtype}): {peak / 1e12:.3f} TFLOP/s")
    run.measure(f"matmul rate, {dtype}".replace("torch.", ""), peak / 1e12, "TFLOP/s",
                better="higher", detail="the best of a few large GEMMs: the MFU peak")  # fmt: skip
    cfg = TINY if tiny else LLAMA_7B
    num_decodes, context = (4, 40) if tiny else (64, 1024)
    blocks = -(-(num_decodes * (context + 1) + 40_000) // args.block_size)
    layers = Layers(cfg, args.layers, args.block_size, device, dtype, blocks)
    s = layers.spec
    print(
        f"layers: {args.layers} x (hidden {s.hidden_size}, {s.num_heads} heads of {s.head_dim}, "
        f"{s.num_kv_heads} KV heads, MLP {s.intermediate_size}); block size {args.block_size}; "
        f"attention backend {layers.backend}"
    )
    prefill_mfu(layers, peak, [32, 64] if tiny else [256, 512, 1024, 2048, 4096], args.repeats, run)
    tile_curve(layers, [128] if tiny else [512, 1024, 2048], args.repeats)
    decodes = [fill(layers, i, context) for i in itertools.islice(itertools.count(1), num_decodes)]
    piggyback(layers, decodes, 64 if tiny else 1024, args.repeats, run)
    for n in sorted({1, min(8, num_decodes), num_decodes}):
        decode_graphs(layers, decodes[:n], args.repeats, run)
    control_plane(args.device, 8 if tiny else 32, run)
    engine_decode_graphs(args.device, tiny, run)
    profiled_kv(args.device, run)
    pp1_bubble_report(args.device, tiny, run)
    engine_vs_transformers(args.device, dtype, tiny, run)
    run.settings.update(device=name, layers=args.layers, block_size=args.block_size,
                        repeats=args.repeats, backend=layers.backend,
                        attention_fallbacks=list(layers.record.fallbacks))  # fmt: skip
    if tiny:
        run.note("--tiny: tiny shapes, the smoke mode; no figure of a 7B layer.")
    run.write()


if __name__ == "__main__":
    main()
