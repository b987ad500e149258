"""The planner's arithmetic: B on known model configs (values computed by hand below), the
chunk rule and the tile rounding on tables of cases, and agreement with the engine's KV
block sizing (``memory.num_kv_blocks``)."""

from __future__ import annotations

import pytest

from sarathi_pp.config import CacheConfig, make_config
from sarathi_pp.model_spec import ModelSpec
from sarathi_pp.placement import Placement
from sarathi_pp.planner.chunk import (
    decode_coverage,
    decodes_per_microbatch,
    pd_ratio_of,
    planned_chunk_size,
    round_to_tile,
)
from sarathi_pp.planner.memory import (
    batch_bound,
    dtype_bytes,
    free_bytes,
    kv_cache_bytes,
    max_decode_batch,
    max_rows,
    num_kv_blocks,
    spec_stage_memory,
    stage_bounds,
    with_activations,
)
from sarathi_pp.scheduler.block_manager import blocks_for
from sarathi_pp.stage_memory import StageMemory

GiB = 1 << 30


def llama_spec(**kw) -> ModelSpec:
    base = dict(
        architecture="LlamaForCausalLM",
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    )
    return ModelSpec(**{**base, **kw})


LLAMA2_7B = llama_spec(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
    num_heads=32, num_kv_heads=32, head_dim=128, max_position_embeddings=4096,
)  # fmt: skip
LLAMA3_8B = llama_spec(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
    num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192,
)  # fmt: skip
TINY_LLAMA = llama_spec(  # builtin:tiny-llama
    vocab_size=259, hidden_size=1024, intermediate_size=2816, num_layers=8,
    num_heads=16, num_kv_heads=4, head_dim=64, max_position_embeddings=2048,
)  # fmt: skip


# --- 1. B ----------------------------------------------------------------------------------
def test_llama2_7b_fp16_on_an_80gib_gpu():
    # params: per layer 4 x 4096^2 (q, k, v, o) + 3 x 4096 x 11008 (mlp) + 2 x 4096 (norms)
    #   = 202_383_360; x 32 = 6_476_267_520; + 2 x 32000 x 4096 (embed, lm_head) + 4096
    #   = 6_738_415_616 params (the known 6.74B) x 2 bytes = 13_476_831_232 bytes.
    [stage] = spec_stage_memory(LLAMA2_7B, 1, "float16", int(0.9 * 80 * GiB))
    assert stage.param_bytes == 13_476_831_232
    # m_kv = 2 (K, V) x 32 layers x 32 KV heads x 128 x 2 bytes = 524_288 (0.5 MiB/token)
    assert stage.kv_bytes_per_token == 524_288
    # M_G = 0.9 x 80 GiB = 77_309_411_328; (M_G - M_S) / (4096 x 0.5 MiB = 2 GiB)
    #   = 63_832_580_096 / 2_147_483_648 = 29.72 -> 29
    assert stage.memory_bytes == 77_309_411_328
    assert max_decode_batch(stage.memory_bytes, stage.param_bytes, 4096, 524_288) == 29


def test_llama3_8b_bf16_gqa():
    # per layer: attn 4096^2 x 2 (q, o) + 2 x 4096 x 1024 (k, v) = 41_943_040; mlp
    #   3 x 4096 x 14336 = 176_160_768; norms 8192 -> 218_112_000; x 32 = 6_979_584_000;
    #   + 2 x 128256 x 4096 = 1_050_673_152; + 4096 = 8_030_261_248 params x 2 bytes.
    [stage] = spec_stage_memory(LLAMA3_8B, 1, "bfloat16", int(0.9 * 80 * GiB))
    assert stage.param_bytes == 16_060_522_496
    # m_kv = 2 x 32 x 8 KV heads x 128 x 2 = 131_072; L x m_kv = 8192 x 128 KiB = 1 GiB
    assert stage.kv_bytes_per_token == 131_072
    # (77_309_411_328 - 16_060_522_496) / 1_073_741_824 = 57.04 -> 57
    assert max_decode_batch(stage.memory_bytes, stage.param_bytes, 8192, 131_072) == 57
    # half the context: twice the sequences (114.08 -> 114)
    assert max_decode_batch(stage.memory_bytes, stage.param_bytes, 4096, 131_072) == 114


def test_tiny_llama_per_stage_figures():
    # per layer: 2 x 1024^2 + 2 x 1024 x 256 + 3 x 1024 x 2816 + 2048 = 11_274_240 params;
    # embed = lm_head = 259 x 1024 = 265_216; final norm 1024; float32 = 4 bytes.
    [one] = spec_stage_memory(TINY_LLAMA, 1, "float32", 4 * GiB)
    assert one.param_bytes == (8 * 11_274_240 + 2 * 265_216 + 1024) * 4 == 362_901_504
    assert one.kv_bytes_per_token == 2 * 8 * 4 * 64 * 4 == 16_384
    # (4 GiB - 362_901_504) / (2048 x 16384) = 3_932_065_792 / 33_554_432 = 117.18
    assert max_decode_batch(4 * GiB, one.param_bytes, 2048, 16_384) == 117
    first, last = spec_stage_memory(TINY_LLAMA, 2, "float32", 4 * GiB)
    assert first.param_bytes == (4 * 11_274_240 + 265_216) * 4 == 181_448_704
    assert last.param_bytes == (4 * 11_274_240 + 265_216 + 1024) * 4 == 181_452_800
    assert first.kv_bytes_per_token == last.kv_bytes_per_token == 8192
    bounds = stage_bounds([first, last], 2048)
    assert [b.max_decode_batch for b in bounds] == [245, 245]  # 4_113_5xx_xxx / 16_777_216
    # a tie in B: the stage with less KV memory (the last: it also holds norm + lm_head)
    assert batch_bound(bounds, 256).binding.memory.stage_idx == 1


def test_tied_embeddings_last_stage_keeps_its_own_copy():
    tied = llama_spec(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True,
    )  # fmt: skip
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64  # = 36_992
    [one] = spec_stage_memory(tied, 1, "float32", GiB)
    assert one.param_bytes == (2 * layer + 64_000 + 64) * 4  # one shared matrix
    first, last = spec_stage_memory(tied, 2, "float32", GiB)
    assert first.param_bytes == (layer + 64_000) * 4
    assert last.param_bytes == (layer + 64_000 + 64) * 4  # lm_head = its own embedding copy


def test_kv_cache_memory_fixes_the_kv_bytes():
    s = StageMemory(0, param_bytes=10**9, kv_bytes_per_token=1000, memory_bytes=2 * 10**9)
    [b] = stage_bounds([s], 100, kv_cache_memory=250_000)
    assert b.max_decode_batch == 2  # 250_000 / (100 x 1000)
    assert b.kv_cache_bytes == 250_000
    assert "kv_cache_memory 250000" in b.formula()


@pytest.mark.parametrize(
    "memory, params, max_len, batch, binds",
    [
        (4 * GiB, 362_901_504, 2048, 117, "memory"),
        (64 * GiB, 362_901_504, 2048, 256, "max_num_seqs"),  # memory allows 2036
    ],
)
def test_effective_bound_and_what_binds(memory, params, max_len, batch, binds):
    s = StageMemory(0, params, 16_384, memory)
    bound = batch_bound(stage_bounds([s], max_len), max_num_seqs=256)
    assert (bound.effective, bound.binds) == (batch, binds)


@pytest.mark.parametrize("max_len", [2048, 2000, 2040, 100])
def test_agrees_with_the_engines_block_sizing(max_len):
    # blocks = (M_G - M_S) // (16 x m_kv); one sequence takes ceil(L / 16) blocks, so the
    # cache holds floor((M_G - M_S) / (16 ceil(L / 16) x m_kv)) sequences (nested floors):
    # B itself when 16 divides L, else B of L rounded up to whole blocks.
    cache = CacheConfig(block_size=16, cpu_memory_budget=4 * GiB)
    stages = spec_stage_memory(TINY_LLAMA, 2, "float32", 4 * GiB)
    blocks = num_kv_blocks(cache, stages, 16, max_len, max_num_seqs=10**6)
    block_seqs = blocks // blocks_for(max_len, 16)
    bound = batch_bound(stage_bounds(stages, max_len), 10**6)
    if max_len % 16 == 0:
        assert block_seqs == bound.memory_bound == bound.effective
    padded = batch_bound(stage_bounds(stages, blocks_for(max_len, 16) * 16), 10**6)
    assert block_seqs == padded.memory_bound
    if max_len == 2040:  # 4_113_514_496 / (2040 x 8192) = 246.1; blocks 31_383 // 128 = 245
        assert (bound.memory_bound, block_seqs) == (246, 245)


def test_budget_below_the_parameters_names_the_numbers():
    with pytest.raises(ValueError, match=r"M_S = 362901504 bytes.*M_G = 100000000 bytes"):
        max_decode_batch(100_000_000, 362_901_504, 2048, 16_384)
    s = StageMemory(1, 362_901_504, 16_384, 100_000_000)
    with pytest.raises(ValueError, match="stage 1: the parameters need"):
        stage_bounds([s], 2048)


def test_not_one_sequence_fits_shows_the_formula():
    with pytest.raises(ValueError, match=r"\(1000 - 900\) / \(10 x 20\) = 0.500"):
        max_decode_batch(1000, 900, 10, 20)


def _placement(device: str, num_stages: int, memory: int) -> Placement:
    per = 32 // num_stages
    ranges = tuple((i * per, (i + 1) * per) for i in range(num_stages))
    return Placement(device, "float16", None, "", memory, "", 16, ranges)


def test_activations_come_off_the_kv_cache_on_cuda():
    # Llama-2-7B fp16, one 80 GiB GPU at 0.9, chunks of 512, one micro-batch in flight.
    # Per row of a layer: attention 2 x 4096 (residual, normed) + 3 x 4096 (q, k, v) + 4096
    # (output) = 24_576; MLP 2 x 4096 + 3 x 11008 (gate, up, product) = 41_216 (larger);
    # x 512 rows x 2 bytes = 42_205_184. The last stage (here the only one) adds 3 float32
    # copies of the logits of max(256 sampled rows, 256 prompt rows): 256 x 32000 x 4 x 3
    # = 98_304_000.
    config = make_config(chunk_size=512, max_num_seqs=256, num_microbatches_in_flight=1)
    memory = int(0.9 * 80 * GiB)
    stages = spec_stage_memory(LLAMA2_7B, 1, "float16", memory)
    assert with_activations(stages, config, LLAMA2_7B, _placement("cpu", 1, memory), 4096) == (
        stages
    )  # on CPU, nothing
    [stage] = with_activations(stages, config, LLAMA2_7B, _placement("cuda", 1, memory), 4096)
    assert stage.activation_bytes == 42_205_184 + 98_304_000
    free = 77_309_411_328 - 13_476_831_232 - 140_509_184
    assert kv_cache_bytes(stage) == free_bytes(memory, stage.param_bytes, 140_509_184) == free
    [bound] = stage_bounds([stage], 4096)
    assert bound.max_decode_batch == free // (4096 * 524_288) == 29  # 29.66
    assert "- M_A 140509184)" in bound.formula()
    blocks = num_kv_blocks(config.cache, [stage], 16, 4096, 10**6)
    assert blocks == free // (16 * 524_288) < (free + 140_509_184) // (16 * 524_288)


def test_activations_per_stage_and_policy():
    # PP=2, two micro-batches in flight plus one ahead: each stage holds two more
    # micro-batches' hidden states (2 x 4096 a row); only the last has logits.
    config = make_config(chunk_size=512, max_num_seqs=8, num_microbatches_in_flight=2)
    stages = spec_stage_memory(LLAMA2_7B, 2, "float16", 40 * GiB)
    first, last = with_activations(
        stages, config, LLAMA2_7B, _placement("cuda", 2, 40 * GiB), 4096, schedule_ahead=True
    )
    assert first.activation_bytes == 512 * (41_216 + 2 * 4096) * 2
    # 8 sampled rows, but a prompt_logprobs chunk scores up to 256 rows at once
    assert last.activation_bytes == first.activation_bytes + 256 * 32000 * 4 * 3
    # whole prompts: the prefill cap (max_model_len here) plus every running decode
    vllm = make_config(scheduler="vllm", max_num_seqs=8, num_microbatches_in_flight=1)
    assert max_rows(vllm.scheduler, 4096) == 4096 + 8
    one = _placement("cuda", 1, 80 * GiB)
    [whole] = with_activations(stages[:1], vllm, LLAMA2_7B, one, 4096)
    assert whole.activation_bytes == 4104 * 41_216 * 2 + 256 * 32000 * 4 * 3


def test_activations_that_leave_nothing_are_named():
    with pytest.raises(ValueError, match=r"M_S = 50 bytes .* and the activations M_A = 60 bytes"):
        free_bytes(100, 50, 60)
    with pytest.raises(ValueError, match=r"\(1000 - 800 - 150\) / \(10 x 20\) = 0.250"):
        max_decode_batch(1000, 800, 10, 20, activation_bytes=150)
    s = StageMemory(0, 800, 20, 1000, activation_bytes=300)
    with pytest.raises(ValueError, match="stage 0: the parameters need M_S = 800 bytes"):
        stage_bounds([s], 10)


def test_unknown_dtype():
    with pytest.raises(ValueError, match="unknown dtype 'int4'; known: float32, bfloat16"):
        dtype_bytes("int4")
    with pytest.raises(ValueError, match="unknown dtype 'int4'"):
        spec_stage_memory(TINY_LLAMA, 1, "int4", GiB)


# --- 2. + 3. the chunk ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "batch, n, decodes",
    [(1, 1, 0), (2, 1, 1), (117, 1, 116), (245, 2, 122), (10, 4, 3), (5, 4, 1), (1, 8, 0)],
)
def test_decodes_per_microbatch_rounds_up(batch, n, decodes):
    assert decodes_per_microbatch(batch, n) == decodes  # ceil((B - 1) / n)


@pytest.mark.parametrize(
    "tokens, tile, rounded",
    [
        (1, 128, 128),  # never below one tile
        (127, 128, 128),
        (128, 128, 128),
        (255, 128, 128),
        (256, 128, 256),
        (260, 128, 256),  # the 18% step of this CPU: 260 rows cost more than 256
        (1121, 128, 1024),
        (100, 16, 96),
        (7, 1, 7),
    ],
)
def test_round_to_tile(tokens, tile, rounded):
    assert round_to_tile(tokens, tile) == rounded


def test_round_to_tile_rejects_nonsense():
    with pytest.raises(ValueError, match="tile_size must be >= 1, got 0"):
        round_to_tile(100, 0)
    with pytest.raises(ValueError, match="num_tokens must be >= 1, got 0"):
        round_to_tile(0, 128)


# (pd, B, n, min, max, tile) -> (raw C, C, decodes, chunk_size, clamped, rounded_up)
CHUNK_CASES = [
    # 10 x 116 = 1160; 1160 + 116 = 1276 -> 1152
    ((10.0, 117, 1, 128, 2048, 128), (1160, 1160, 116, 1152, None, False)),
    # two in flight: ceil(116 / 2) = 58 decodes; 580 + 58 = 638 -> 512
    ((10.0, 117, 2, 128, 2048, 128), (580, 580, 58, 512, None, False)),
    # decode-heavy: 0.5 x 32 = 16 -> clamped up to 128; 128 + 32 = 160 -> 128 would leave
    # 96 prefill rows, under min_chunk_size: up to 256 (224 rows)
    ((0.5, 33, 1, 128, 2048, 128), (16, 128, 32, 256, "min", True)),
    # with min_chunk_size 64 the same rounds down: 96 rows are enough
    ((0.5, 33, 1, 64, 2048, 128), (16, 64, 32, 128, "min", False)),
    # 1.0 x 116 = 116 -> 128; 128 + 116 = 244 -> 128 would leave 12 rows: up to 256 (140)
    ((1.0, 117, 1, 128, 2048, 128), (116, 128, 116, 256, "min", True)),
    # prefill-heavy: 100 x 64 = 6400 -> clamped down to 2048; 2048 + 64 = 2112 -> 2048
    ((100.0, 65, 1, 128, 2048, 128), (6400, 2048, 64, 2048, "max", False)),
    # B = 1: no decode to piggyback; C = min_chunk_size, one tile
    ((8.0, 1, 1, 128, 2048, 128), (0, 128, 0, 128, "min", False)),
    # halves round up: 2.5 x 1 = 2.5 -> 3; tile 1: budget 3 + 1 = 4
    ((2.5, 2, 1, 1, 2048, 1), (3, 3, 1, 4, None, False)),
    # 0.1 x 200 = 20; 20 + 200 = 220 -> 128 would hold no prefill row: up to 256
    ((0.1, 201, 1, 16, 2048, 128), (20, 20, 200, 256, None, True)),
    # the shipped configs with the mixed workload (P:D = 554.67 / 64): PP=1, PP=2
    ((1664 / 3 / 64, 117, 1, 128, 2048, 128), (1005, 1005, 116, 1024, None, False)),
    ((1664 / 3 / 64, 245, 2, 128, 2048, 128), (1057, 1057, 122, 1152, None, False)),
]


@pytest.mark.parametrize("args, expected", CHUNK_CASES)
def test_planned_chunk_size(args, expected):
    plan = planned_chunk_size(*args)
    got = (
        plan.raw_prefill_chunk,
        plan.prefill_chunk,
        plan.num_decodes,
        plan.chunk_size,
        plan.clamped,
        plan.rounded_up,
    )
    assert got == expected
    assert plan.chunk_size % plan.tile_size == 0
    assert plan.prefill_rows == plan.chunk_size - plan.num_decodes >= plan.min_chunk_size


def test_reason_names_ratio_clamp_and_tile():
    text = planned_chunk_size(0.5, 33, 1, 128, 2048, 128).reason()
    assert "P:D 0.500 x 32 decodes per micro-batch = 16" in text
    assert "clamped up to min_chunk_size 128: C = 128" in text
    assert (
        "rounded up (to keep min_chunk_size 128 prefill rows) to a multiple of the tile 128: chunk_size = 256 (224 prefill rows"
        in text
    )
    text = planned_chunk_size(0.5, 33, 1, 64, 2048, 128).reason()
    assert "rounded down to a multiple of the tile 128: chunk_size = 128" in text
    text = planned_chunk_size(100.0, 65, 1, 128, 2048, 128).reason()
    assert "clamped down to max_chunk_size 2048" in text
    assert (
        "rounded up (to keep min_chunk_size 16 prefill rows)"
        in planned_chunk_size(0.1, 201, 1, 16, 2048, 128).reason()
    )


@pytest.mark.parametrize(
    "pd, match",
    [(0.0, "finite number > 0, got 0.0"), (float("inf"), "got inf"), ("8", "must be a number")],
)
def test_bad_pd_ratio(pd, match):
    with pytest.raises(ValueError, match=match):
        planned_chunk_size(pd, 10, 1, 128, 2048, 128)


def test_bad_clamp_range():
    with pytest.raises(ValueError, match="got 512 and 256"):
        planned_chunk_size(8.0, 10, 1, 512, 256, 128)


def test_zero_output_tokens():
    assert pd_ratio_of(554.0, 64.0) == 554.0 / 64.0
    with pytest.raises(ValueError, match="0 output tokens per request"):
        pd_ratio_of(100, 0)


# --- decodes that miss a chunk -------------------------------------------------------------
@pytest.mark.parametrize(
    "rows, decodes, chunks, carried, missed",
    [
        # 4 x (128, 512, 1024) prompts, 64 out: 12 x 63 = 756 decode steps; in 500-row
        # chunks 4 x (1 + 2 + 3) = 24 chunks; at most 11 others decode beside a chunk
        (500, 10, 24, 240, 516),
        (500, 100, 24, 264, 492),  # the planned 100 capped at the 11 other requests
        (2048, 10, 12, 120, 636),  # bigger chunks: fewer of them, more decodes left over
        (500, 0, 24, 0, 756),  # B = 1: every decode runs alone
        (100, 11, 4 * (2 + 6 + 11), 756, 0),  # more room than steps: none missed
    ],
)
def test_decode_coverage(rows, decodes, chunks, carried, missed):
    cov = decode_coverage([(128, 64), (512, 64), (1024, 64)] * 4, rows, decodes, 1, 12)
    assert cov.num_decode_steps == 756  # output tokens - 1 each
    assert (cov.num_prefill_chunks, cov.carried, cov.missed) == (chunks, carried, missed)
    assert cov.missed_fraction == pytest.approx(missed / 756)


@pytest.mark.parametrize(
    "decodes, n, per_chunk",
    [(10, 1, 2), (10, 2, 1), (1, 1, 1), (0, 1, 0)],
)
def test_decode_coverage_is_capped_by_the_other_requests(decodes, n, per_chunk):
    # 3 requests: beside one request's chunk at most the other 2 decode, spread over n.
    cov = decode_coverage([(128, 64), (512, 64), (1024, 64)], 500, decodes, n, 3)
    assert cov.num_decodes == per_chunk
    assert (cov.carried, cov.missed) == (6 * per_chunk, 189 - 6 * per_chunk)


def test_decode_coverage_of_a_steady_stream_is_not_capped():
    cov = decode_coverage([(128, 64)], 100, 10)  # P and D of a request in a long stream
    assert (cov.num_prefill_chunks, cov.num_decodes, cov.carried, cov.missed) == (2, 10, 20, 43)


def test_decode_coverage_rejects_empty_requests():
    with pytest.raises(ValueError, match="request 1 has 10 prompt and 0 output tokens"):
        decode_coverage([(10, 5), (10, 0)], 100, 4)
