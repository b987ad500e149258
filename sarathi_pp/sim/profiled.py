"""The profiled cost model: a ``sarathi-pp profile`` CSV of this machine, interpolated.

The CSV times one stage's forward over a grid of (prefill tokens ``P``, decodes ``D``,
context ``k``) (``planner/profile_csv.py``). Between and beyond the grid points the
time is a least-squares fit, linear in the work the micro-batch does:

    t = c0 + c1 x P + c2 x D + c3 x sum_chunks c (k + c / 2) + c4 x sum_decodes (k + 1)

(a fixed cost, the rows through the linear layers, prefill attention over the cached
context and the causal half of the chunk, decode attention over each context). A
coefficient the fit makes negative is dropped and the rest refitted, so no micro-batch
costs less than nothing; so is a feature the grid cannot tell from the others (with one
context length, decode attention is proportional to the decodes). A stage with a different number of layers than the profiled one
takes the time in proportion (the CSV's ``num_layers``; without it the largest stage is
assumed). Sends, the token return and the driver's time are not in the CSV: they are the
``Overheads`` (measured on a real run's ``events.jsonl``).
"""

from __future__ import annotations

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


class ProfiledCostModel:
    def __init__(
        self,
        coef: list[float],
        layer_ranges: tuple[tuple[int, int], ...],
        profiled_layers: int | None = None,
        source: str = "profile",
    ) -> None:
        self.coef = coef
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
        return cls(fit(rows), layer_ranges, layers.pop() if layers else None, str(path))

    def seconds(self, features: list[float]) -> float:
        return sum(c * x for c, x in zip(self.coef, features, strict=True))

    def costs(self, microbatch: MicroBatch) -> MicrobatchCost:
        t = self.seconds(microbatch_features(microbatch))
        compute = tuple(t * n / self.profiled_layers for n in self.num_layers)
        zeros = (0.0,) * self.num_stages
        return MicrobatchCost(compute, zeros, 0.0)

    def describe(self) -> str:
        terms = ", ".join(f"{n} {c:.3g}" for n, c in zip(FEATURES, self.coef, strict=True))
        return f"profiled ({self.source}, {self.profiled_layers} layers): {terms}"
