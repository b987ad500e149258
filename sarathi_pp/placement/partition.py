"""Which decoder layers each pipeline stage runs: contiguous ranges balanced by compute.

Pure Python (no torch). Cost model, in FLOPs per token of the micro-batch:
  - a decoder layer: 2 x ``spec.layer_params()`` (one multiply-add per weight);
  - the last stage also runs the final norm, the lm_head and the sampler on the *sampled*
    rows only: 2 x hidden x vocab per sampled row, modelled as ``sampled_fraction`` of that
    per token (under chunked prefills most rows are prompt tokens that sample nothing);
  - the first stage's embedding lookup is a gather: ~0 FLOPs.
The split minimises the most expensive stage (the pipeline's throughput is set by its
slowest stage); among the optimal splits it takes the most even one.
"""

from __future__ import annotations

from sarathi_pp.model_spec import DTYPE_BYTES, ModelSpec

_REL_TOL = 1e-9  # float slack when comparing a stage's cost with the optimum


def layer_cost(spec: ModelSpec) -> float:
    """FLOPs per token of one decoder layer."""
    return 2.0 * spec.layer_params()  # 2: multiply + add per weight


def head_cost(spec: ModelSpec, sampled_fraction: float) -> float:
    """FLOPs per token of the last stage's final norm + lm_head + sampler."""
    return sampled_fraction * 2.0 * spec.hidden_size * spec.vocab_size


def check_num_stages(spec: ModelSpec, num_stages: int) -> None:
    """``ValueError`` unless every stage can have at least one decoder layer."""
    if num_stages > spec.num_layers:
        raise ValueError(
            f"pipeline_parallel_size={num_stages} exceeds the model's "
            f"{spec.num_layers} layers: every stage needs at least one"
        )


def partition_layers(
    spec: ModelSpec, num_stages: int, sampled_fraction: float = 0.25
) -> list[tuple[int, int]]:
    """``[(layer_start, layer_end), ...]``, one half-open range per stage, covering all layers
    in order; every stage gets at least one layer."""
    num_layers = spec.num_layers
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(
            f"cannot split {num_layers} decoder layers over {num_stages} stages: every stage "
            f"needs at least one layer (use at most {num_layers} stages)"
        )
    if not 0.0 <= sampled_fraction <= 1.0:
        raise ValueError(f"sampled_fraction must be in [0, 1], got {sampled_fraction}")
    costs = [layer_cost(spec)] * num_layers
    extra = [0.0] * num_stages  # per-stage cost besides its layers
    extra[-1] += head_cost(spec, sampled_fraction)
    return _split(costs, extra)


def _split(costs: list[float], extra: list[float]) -> list[tuple[int, int]]:
    """Contiguous split of ``costs`` into ``len(extra)`` non-empty ranges (range k also costs
    ``extra[k]``): first the least possible maximum stage cost, then, under that maximum,
    the least sum of squared stage costs (the most even split). Exact DP, O(S x L^2)."""
    num_layers, num_stages = len(costs), len(extra)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(k: int, i: int, j: int) -> float:  # stage k runs layers [i, j)
        return prefix[j] - prefix[i] + extra[k]

    inf = float("inf")
    # best[k][j]: least max cost of stages 0..k covering layers [0, j)
    best = [[inf] * (num_layers + 1) for _ in range(num_stages)]
    for j in range(1, num_layers + 1):
        best[0][j] = cost(0, 0, j)
    for k in range(1, num_stages):
        for j in range(k + 1, num_layers + 1):
            best[k][j] = min(max(best[k - 1][i], cost(k, i, j)) for i in range(k, j))
    limit = best[-1][num_layers] * (1 + _REL_TOL)

    # Second pass: least sum of squares with every stage under ``limit``. Ties go to the
    # split whose earlier stages are heavier (``<`` keeps the first, i.e. largest, ``i``).
    sq = [[inf] * (num_layers + 1) for _ in range(num_stages)]
    cut = [[0] * (num_layers + 1) for _ in range(num_stages)]
    for j in range(1, num_layers + 1):
        if cost(0, 0, j) <= limit:
            sq[0][j] = cost(0, 0, j) ** 2
    for k in range(1, num_stages):
        for j in range(k + 1, num_layers + 1):
            for i in range(j - 1, k - 1, -1):
                c = cost(k, i, j)
                if c <= limit and sq[k - 1][i] + c * c < sq[k][j] * (1 - _REL_TOL):
                    sq[k][j], cut[k][j] = sq[k - 1][i] + c * c, i
    ranges, j = [], num_layers
    for k in range(num_stages - 1, 0, -1):
        i = cut[k][j]
        ranges.append((i, j))
        j = i
    ranges.append((0, j))
    return ranges[::-1]


def check_partition(spec: ModelSpec, ranges: list[tuple[int, int]]) -> None:
    """Raise ``ValueError`` unless ``ranges`` are non-empty, contiguous and cover all layers."""
    expected_start = 0
    for stage_idx, (start, end) in enumerate(ranges):
        if start != expected_start or end <= start:
            raise ValueError(
                f"stage {stage_idx} has layers [{start}, {end}); expected a non-empty range "
                f"starting at {expected_start} (ranges: {ranges})"
            )
        expected_start = end
    if expected_start != spec.num_layers:
        raise ValueError(f"the ranges {ranges} cover {expected_start} of {spec.num_layers} layers")


def stage_params(spec: ModelSpec, ranges: list[tuple[int, int]]) -> list[int]:
    """Parameters each stage holds: its layers, the embedding on the first stage, the final
    norm and lm_head on the last (the last keeps its own copy when embeddings are tied)."""
    check_partition(spec, ranges)
    out = []
    for stage_idx, (start, end) in enumerate(ranges):
        n = (end - start) * spec.layer_params()
        if stage_idx == 0:
            n += spec.embedding_params()
        if stage_idx == len(ranges) - 1:
            lm_head = (
                0 if (spec.tie_word_embeddings and len(ranges) == 1) else spec.embedding_params()
            )
            n += lm_head + spec.hidden_size  # + final RMSNorm weight
        out.append(n)
    return out


def stage_costs(
    spec: ModelSpec, ranges: list[tuple[int, int]], sampled_fraction: float = 0.25
) -> list[float]:
    """FLOPs per token of each stage under the module's cost model."""
    check_partition(spec, ranges)
    costs = [(end - start) * layer_cost(spec) for start, end in ranges]
    costs[-1] += head_cost(spec, sampled_fraction)
    return costs


def format_partition(
    spec: ModelSpec,
    ranges: list[tuple[int, int]],
    dtype: str = "bfloat16",
    sampled_fraction: float = 0.25,
) -> str:
    """One line per stage: its layers, parameter bytes (share) and compute cost (share)."""
    params = stage_params(spec, ranges)
    costs = stage_costs(spec, ranges, sampled_fraction)
    total_params, total_cost = sum(params), sum(costs)
    lines = []
    for stage_idx, ((start, end), p, c) in enumerate(zip(ranges, params, costs, strict=True)):
        gib = p * DTYPE_BYTES[dtype] / 2**30
        lines.append(
            f"stage {stage_idx}: layers [{start:>3}, {end:>3}) ({end - start:>3} layers)  "
            f"params {gib:8.3f} GiB {dtype} ({100 * p / total_params:5.1f}%)  "
            f"cost {c / 1e9:8.3f} GFLOP/token ({100 * c / total_cost:5.1f}%)"
        )
    return "\n".join(lines)
