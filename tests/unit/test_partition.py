"""partition_layers: contiguous layer ranges per stage, balanced by FLOPs per token."""

from __future__ import annotations

import itertools

import pytest

from sarathi_pp.model_spec import ModelSpec
from sarathi_pp.placement.partition import (
    check_partition,
    format_partition,
    head_cost,
    layer_cost,
    partition_layers,
    stage_costs,
    stage_params,
)


def _spec(
    num_layers: int, vocab_size: int = 128256, hidden_size: int = 4096, tie: bool = False
) -> ModelSpec:
    """Llama-3-8B-like dimensions by default (lm_head ~0.6 of a layer at sampled_fraction=1)."""
    return ModelSpec(
        architecture="LlamaForCausalLM",
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=14336 * hidden_size // 4096,
        num_layers=num_layers,
        num_heads=32,
        num_kv_heads=8,
        head_dim=hidden_size // 32,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=tie,
    )


def _sizes(ranges: list[tuple[int, int]]) -> list[int]:
    return [end - start for start, end in ranges]


def _brute_force_max_cost(spec: ModelSpec, num_stages: int, sampled_fraction: float) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, spec.num_layers), num_stages - 1):
        bounds = (0, *cuts, spec.num_layers)
        ranges = list(itertools.pairwise(bounds))
        best = min(best, max(stage_costs(spec, ranges, sampled_fraction)))
    return best


@pytest.mark.parametrize("num_stages", [1, 2, 4, 8, 32])
def test_equal_layers_split_evenly_when_lm_head_is_small(num_stages):
    spec = _spec(32)
    assert head_cost(spec, 0.25) < layer_cost(spec)
    ranges = partition_layers(spec, num_stages)
    assert _sizes(ranges) == [32 // num_stages] * num_stages
    assert ranges[0][0] == 0 and ranges[-1][1] == 32


def test_uneven_split_puts_extra_layers_on_earlier_stages():
    # No head cost: any split with max 3 layers is optimal; the most even one, heavier first.
    assert _sizes(partition_layers(_spec(10), 4, sampled_fraction=0.0)) == [3, 3, 2, 2]
    # The last stage's lm_head breaks the tie the same way.
    assert _sizes(partition_layers(_spec(10), 4)) == [3, 3, 2, 2]
    assert _sizes(partition_layers(_spec(32), 5)) == [7, 7, 6, 6, 6]


def test_huge_vocab_pushes_layers_off_the_last_stage():
    spec = _spec(8, vocab_size=900_000)  # lm_head at 1/4 of the rows ~ 4.2 layers
    assert 4 * layer_cost(spec) < head_cost(spec, 0.25) < 5 * layer_cost(spec)
    ranges = partition_layers(spec, 2)
    assert ranges == [(0, 6), (6, 8)]  # 6 layers vs 2 layers + head (~6.2)
    # Sampling every row makes the head four times as heavy: the last stage keeps 1 layer.
    assert partition_layers(spec, 2, sampled_fraction=1.0) == [(0, 7), (7, 8)]


@pytest.mark.parametrize("vocab_size", [1000, 128256, 600_000, 3_000_000])
@pytest.mark.parametrize("sampled_fraction", [0.0, 0.25, 1.0])
def test_split_is_optimal_contiguous_and_covering(vocab_size, sampled_fraction):
    for num_layers in range(1, 10):
        spec = _spec(num_layers, vocab_size=vocab_size, hidden_size=1024)
        for num_stages in range(1, min(num_layers, 4) + 1):
            ranges = partition_layers(spec, num_stages, sampled_fraction)
            check_partition(spec, ranges)  # contiguous, non-empty, covers all layers
            assert len(ranges) == num_stages
            got = max(stage_costs(spec, ranges, sampled_fraction))
            assert got == pytest.approx(_brute_force_max_cost(spec, num_stages, sampled_fraction))


def test_infeasible_splits_raise_with_the_numbers():
    spec = _spec(4)
    with pytest.raises(ValueError, match="num_stages must be >= 1, got 0"):
        partition_layers(spec, 0)
    with pytest.raises(ValueError, match="cannot split 4 decoder layers over 5 stages"):
        partition_layers(spec, 5)
    with pytest.raises(ValueError, match=r"sampled_fraction must be in \[0, 1\], got 1.5"):
        partition_layers(spec, 2, sampled_fraction=1.5)


@pytest.mark.parametrize(
    "ranges, match",
    [
        (
            [(0, 2), (3, 4)],
            r"stage 1 has layers \[3, 4\); expected a non-empty range starting at 2",
        ),
        ([(0, 2), (2, 2), (2, 4)], r"stage 1 has layers \[2, 2\)"),
        ([(1, 4)], r"stage 0 has layers \[1, 4\)"),
        ([(0, 3)], r"cover 3 of 4 layers"),
    ],
)
def test_check_partition_rejects_gaps_empty_ranges_and_partial_cover(ranges, match):
    with pytest.raises(ValueError, match=match):
        check_partition(_spec(4), ranges)


def test_stage_params_count_embedding_first_and_lm_head_last():
    spec = _spec(4)
    params = stage_params(spec, [(0, 1), (1, 3), (3, 4)])
    assert sum(params) == spec.num_params()
    assert params[1] == 2 * spec.layer_params()
    tied = _spec(4, tie=True)
    # Tied embeddings: one stage shares the matrix, the last of several keeps its own copy.
    assert stage_params(tied, [(0, 4)]) == [tied.num_params()]
    assert sum(stage_params(tied, [(0, 2), (2, 4)])) == tied.num_params() + tied.embedding_params()


def test_format_partition_one_line_per_stage():
    spec = _spec(32)
    text = format_partition(spec, partition_layers(spec, 4))
    lines = text.splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("stage 0: layers [  0,   8) (  8 layers)  params")
    assert lines[3].startswith("stage 3: layers [ 24,  32)")
    assert all("GiB bfloat16" in line and "GFLOP/token" in line for line in lines)
    with pytest.raises(ValueError, match="cover 8 of 32 layers"):
        format_partition(spec, [(0, 8)])
