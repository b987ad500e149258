"""Decode graphs (Note [decode graphs], ``stages/worker/cuda_graphs.py``) without a GPU:
the bucket choice, which micro-batches run eagerly (recorded when a decode one finds no
graph), and the static buffers' padding, with a "capture" that runs the function itself on
CPU: decodes through the padded buckets give the eager run's greedy tokens."""

from __future__ import annotations

import json
import random

import pytest

from sarathi_pp import LLM, SamplingParams
from sarathi_pp.microbatch import MicroBatch, ScheduledChunk
from sarathi_pp.stages.worker.cuda_graphs import DecodeGraphs, graph_buckets


def test_buckets_are_small_sizes_then_multiples_of_8():
    assert graph_buckets(1) == (1, 2, 4, 8)
    assert graph_buckets(8) == (1, 2, 4, 8)
    assert graph_buckets(20) == (1, 2, 4, 8, 16, 24)
    with pytest.raises(ValueError, match="max_batch must be >= 1, got 0"):
        graph_buckets(0)


def microbatch(num_decodes: int, prefill: int = 0) -> MicroBatch:
    chunks = [ScheduledChunk(100, 0, tuple(range(prefill)), True, (0,))] if prefill else []
    chunks += [ScheduledChunk(i, 5, (1,), False, (i + 1,)) for i in range(num_decodes)]
    return MicroBatch(1, tuple(chunks))


def test_the_smallest_bucket_that_holds_the_decodes_and_every_eager_one_recorded():
    reasons: list[str] = []
    graphs = DecodeGraphs(0, (1, 2, 4, 8), reasons.append)
    assert [graphs.bucket_for(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    graphs.static = dict.fromkeys((1, 2, 8))  # captured; 4 failed
    graphs.failed[4] = "its capture failed: RuntimeError: boom"
    assert graphs.plan(microbatch(3, prefill=4)) is None  # hybrid: eager, no fallback
    assert graphs.plan(microbatch(0, prefill=4)) is None
    assert reasons == [] and graphs.eager_decodes == 0
    assert graphs.plan(microbatch(2)) == 2 and graphs.plan(microbatch(6)) == 8
    assert graphs.plan(microbatch(3)) is None  # bucket 4's capture failed
    assert graphs.plan(microbatch(9)) is None  # above the largest bucket
    assert reasons == [
        "CUDA graphs: decode micro-batches of bucket 4 run eagerly: its capture failed: "
        "RuntimeError: boom",
        "CUDA graphs: decode micro-batches above 8 sequences run eagerly",
    ]
    assert graphs.eager_decodes == 2
    with pytest.raises(ValueError, match=r"increasing sizes >= 1, got \(2, 1\)"):
        DecodeGraphs(0, (2, 1), reasons.append)


def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (3, 40, 21, 9, 14)]


sizes: list[tuple[int, int]] = []


def run(
    model_dir, run_dir, graphs: bool, backend: str
) -> tuple[list[list[int]], DecodeGraphs | None, dict]:
    with LLM(
        str(model_dir), max_model_len=96, dtype="float32", chunk_size=32, tile_align=False,
        block_size=16, run_dir=str(run_dir), **{"model.attention_backend": backend},
        **{"model.enforce_eager": not graphs}, **{"cache.num_kv_blocks": 64},
    ) as llm:  # fmt: skip
        runner = llm.engine.executor.runner
        captured = runner.capture_graphs(lambda fn: fn, buckets=(1, 2, 4)) if graphs else None
        if captured is not None:  # which bucket ran how many rows
            inner = captured.replay

            def replay(bucket, inputs, meta):
                sizes.append((bucket, inputs.shape[0]))
                return inner(bucket, inputs, meta)

            captured.replay = replay  # type: ignore[method-assign]
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                  for n in (12, 4, 9, 6, 15)]  # fmt: skip
        outs = llm.generate(prompts(), params, use_tqdm=False)
        llm.engine.write_run_records()
    summary = json.loads((run_dir / "summary.json").read_text())
    return [o.outputs[0].token_ids for o in outs], captured, summary


@pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")
@pytest.mark.parametrize("backend", ["torch", "flex_paged"])
def test_decodes_through_padded_static_buffers_give_the_eager_tokens(llama_dir, tmp_path, backend):
    sizes.clear()
    eager, _, _ = run(llama_dir, tmp_path / "eager", False, backend)
    got, graphs, summary = run(llama_dir, tmp_path / "graphs", True, backend)
    assert got == eager and len({tuple(t) for t in got}) > 1
    assert graphs is not None and sorted(graphs.static) == [1, 2, 4]
    assert graphs.replays > 0 and len(sizes) == graphs.replays
    assert any(n < bucket for bucket, n in sizes), sizes  # padded rows among them
    assert graphs.eager_decodes > 0  # 5 decoding at once: above the largest bucket
    (stage,) = summary["attention"]
    assert "CUDA graphs: decode micro-batches above 4 sequences run eagerly" in stage["fallbacks"]
