"""The profiled cost model: a ``sarathi-pp profile`` CSV of this machine, interpolated.

The CSV times one stage's forward over a grid of (prefill tokens ``P``, decodes ``D``,
context ``k``) (``planner/profile_csv.py``). Between and beyond the grid points the
time is a least-squares fit, linear in the work the micro-batch does:

    t = c0 + c1 x P + c2 x D + c3 x sum_chunks c (k + c / 2) + c4 x sum_decodes (k + 1)

(a fixed cost, the rows through the linear layers, prefill attention over the cached
context and the causal half of the chunk, decode attention over each context). A
coefficient the fit makes negative is dropped and the rest refitted, so no micro-batch
costs less than nothing; so is a feature the grid cannot tell from the others (with one
context length, decode attention is proportional to the decodes).

A decode-only micro-batch is not linear in its decodes on a CPU (a matmul of 1 row costs
nearly what 8 rows cost): when the CSV has decode-only rows of two sizes or more at a
context (``sarathi-pp profile``'s decode sweep), such a micro-batch's time is read off
them instead (``DecodeTable``: piecewise linear in the decodes at each profiled context,
then linear in the mean context between contexts, extrapolated past the largest), and the
linear fit is made on the rows with a prefill chunk.

A stage with a different number of layers than the profiled one takes the time in
proportion (the CSV's ``num_layers``; without it the largest stage is assumed). Sends, the token return and the driver's time are not in the CSV: they are the
``Overheads`` (measured on a real run's ``events.jsonl``).
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

from sarathi_pp.microbatch import MicroBatch
from sarathi_pp.planner.profile_csv import ProfileRow, load_profile
from sarathi_pp.sim.cost_model import MicrobatchCost

FEATURES = ("fixed", "prefill_tokens", "decodes", "prefill_attention", "decode_attention")


def row_features(p: int, d: int, k: int) -> list[float]:
    """The features of a CSV row: a chunk of ``p`` and ``d`` decodes, all at context ``k``."""
    return [1.0, float(p), float(d), p * (k + p / 2), d * (k + 1.0)]


def microbatch_features(mb: MicroBatch) -> list[float]:
    p = sum(c.num_tokens for c in mb.chunks if c.is_prefill)
    att_p = sum(c.num_tokens * (c.start + c.num_tokens / 2) for c in mb.chunks if c.is_prefill)
    decodes = [c.start for c in mb.chunks if not c.is_prefill]
    return [1.0, float(p), float(len(decodes)), att_p, sum(decodes) + float(len(decodes))]


class _Singular(Exception):
    def __init__(self, col: int) -> None:
        self.col = col  # a column the earlier ones already explain


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """``a x = b`` by Gaussian elimination with partial pivoting (small, dense);
    ``_Singular`` names a column that depends on the earlier ones."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max(abs(x) for row in a for x in row) or 1.0
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-9 * scale:
            raise _Singular(col)
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit(rows: list[ProfileRow]) -> list[float]:
    """Non-negative least squares (by dropping negative coefficients) over ``FEATURES``,
    columns scaled to unit size first so the normal equations stay well conditioned."""
    xs = [row_features(r.prefill_tokens, r.decode_tokens, r.context_len) for r in rows]
    ys = [r.seconds for r in rows]
    active = list(range(len(FEATURES)))
    while True:
        cols = [i for i in active if any(x[i] for x in xs)]
        if not cols:
            raise ValueError("the profile's times do not grow with the work: nothing to fit")
        scale = [max(abs(x[i]) for x in xs) for i in cols]
        z = [[x[i] / s for i, s in zip(cols, scale, strict=True)] for x in xs]
        ata = [[sum(r[i] * r[j] for r in z) for j in range(len(cols))] for i in range(len(cols))]
        atb = [sum(r[i] * y for r, y in zip(z, ys, strict=True)) for i in range(len(cols))]
        try:
            solved = _solve(ata, atb)
        except _Singular as e:  # e.g. one context length: decode attention ~ decodes
            active = [i for i in cols if i != cols[e.col]]
            continue
        coef = [c / s for c, s in zip(solved, scale, strict=True)]
        negative = [i for i, c in zip(cols, coef, strict=True) if c < 0]
        if not negative:
            out = [0.0] * len(FEATURES)
            for i, c in zip(cols, coef, strict=True):
                out[i] = c
            return out
        active = [i for i in cols if i not in negative]


def interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through ``points`` (sorted by x, at least two), extrapolated from
    the last segment past the largest x; clamped at the smallest x (a value there or below
    it is the first point's)."""
    if x <= points[0][0]:
        return points[0][1]
    # the first segment that reaches x, else the last one
    (x0, y0), (x1, y1) = next(
        (pair for pair in pairwise(points) if x <= pair[1][0]), (points[-2], points[-1])
    )
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class DecodeTable:
    """Decode-only micro-batches' time from the profile's decode-only rows (the module
    docstring); ``usable`` is false without two sizes at one context at least."""

    def __init__(self, rows: list[ProfileRow]) -> None:
        by_context: dict[int, dict[int, float]] = {}
        for r in rows:
            if r.prefill_tokens == 0 and r.decode_tokens > 0:
                by_context.setdefault(r.context_len, {})[r.decode_tokens] = r.seconds
        self.curves = [
            (float(k), [(float(d), t) for d, t in sorted(ts.items())])
            for k, ts in sorted(by_context.items())
            if len(ts) >= 2
        ]

    @property
    def usable(self) -> bool:
        return bool(self.curves)

    def seconds(self, decodes: int, mean_context: float) -> float:
        at_contexts = [(k, interpolate(curve, decodes)) for k, curve in self.curves]
        if len(at_contexts) == 1:
            return at_contexts[0][1]
        return interpolate(at_contexts, mean_context)


class ProfiledCostModel:
    def __init__(
        self,
        coef: list[float],
        layer_ranges: tuple[tuple[int, int], ...],
        profiled_layers: int | None = None,
        source: str = "profile",
        decodes: DecodeTable | None = None,
    ) -> None:
        self.coef = coef
        self.decodes = decodes if decodes is not None and decodes.usable else None
        self.num_layers = tuple(end - start for start, end in layer_ranges)
        self.profiled_layers = profiled_layers or max(self.num_layers)
        self.num_stages = len(layer_ranges)
        self.source = source

    @classmethod
    def from_csv(cls, path: str | Path, layer_ranges: tuple[tuple[int, int], ...]):
        rows = load_profile(path)
        layers = {r.num_layers for r in rows if r.num_layers is not None}
        if len(layers) > 1:
            raise ValueError(f"profile CSV {str(path)!r} mixes stages of {sorted(layers)} layers")
        decodes = DecodeTable(rows)
        if decodes.usable:  # decode-only micro-batches come from the table: fit the rest
            rows = [r for r in rows if r.prefill_tokens > 0] or rows
        num_layers = layers.pop() if layers else None
        return cls(fit(rows), layer_ranges, num_layers, str(path), decodes)

    def seconds(self, features: list[float]) -> float:
        return sum(c * x for c, x in zip(self.coef, features, strict=True))

    def costs(self, microbatch: MicroBatch) -> MicrobatchCost:
        if self.decodes is not None and microbatch.num_prefill_tokens == 0:
            starts = [c.start for c in microbatch.chunks]
            t = self.decodes.seconds(len(starts), sum(starts) / len(starts))
        else:
            t = self.seconds(microbatch_features(microbatch))
        compute = tuple(t * n / self.profiled_layers for n in self.num_layers)
        zeros = (0.0,) * self.num_stages
        return MicrobatchCost(compute, zeros, 0.0)

    def describe(self) -> str:
        terms = ", ".join(f"{n} {c:.3g}" for n, c in zip(FEATURES, self.coef, strict=True))
        if self.decodes is not None:
            contexts = ", ".join(str(int(k)) for k, _ in self.decodes.curves)
            terms += f"; decode-only micro-batches interpolated at contexts {contexts}"
        return f"profiled ({self.source}, {self.profiled_layers} layers): {terms}"
