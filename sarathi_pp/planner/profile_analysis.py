"""What the offline profile of one pipeline stage shows (pure Python, no torch).

The rows and their CSV live in ``sarathi_pp/planner/profile_csv.py`` (re-exported here:
``load_profile``, ``write_profile``, ``ProfileRow``, ``GridPoint`` and the column names);
``sarathi-pp plan --profile`` and ``sarathi-pp profile`` read the findings off the rows here.

Note "profile analysis", what it reads off the rows:
  - the chunked-prefill overhead: a prompt of P tokens prefilled in chunks of c costs the
    sum of its chunks ``(c, 0, k)`` for k = 0, c, 2c, ... against one ``(P, 0, 0)``;
  - tile steps: among prefill-only rows at context 0, where the cost per micro-batch jumps
    more than its rows grow (a matmul spills into one more tile). The tile size is the
    steps' period: the largest T of ``TILE_CANDIDATES`` such that most steps sit just past
    a multiple of T and most swept pairs of rows that pass a multiple of T show a step. The
    sweep resolves T only down to the spacing of its windows (pairs of rows at multiples
    of 64 cannot tell a period of 32 from 64);
  - the piggyback cost: ``(c, d, x) - (c, 0, x)`` per decode, against ``(0, d, x)`` per decode.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from sarathi_pp.planner.profile_csv import (
    EXTRA_COLUMNS,
    PROFILE_COLUMNS,
    GridPoint,
    ProfileRow,
    load_profile,
    write_profile,
)

__all__ = [
    "DEFAULT_THRESHOLDS",
    "EXTRA_COLUMNS",
    "MAX_STEP_GAP",
    "PROFILE_COLUMNS",
    "STEP_THRESHOLD",
    "TILE_CANDIDATES",
    "TILE_CLEAR_FRACTION",
    "GridPoint",
    "PiggybackCost",
    "ProfileFindings",
    "ProfileRow",
    "analyze_profile",
    "chunk_chain",
    "chunk_overheads",
    "load_profile",
    "piggyback_costs",
    "tile_period",
    "tile_steps",
    "write_profile",
]

DEFAULT_THRESHOLDS = (0.2, 0.1)  # the paper's "chunk 256 costs < 20%, 512 < 10%"
# A tile step: the cost per row rises by more than this between two swept row counts at
# most MAX_STEP_GAP apart. On the shared 2-core CPU this was tuned on, neighbouring row
# counts jittered by up to ~7% per row (medians of 5) with no step behind it.
STEP_THRESHOLD = 0.08
MAX_STEP_GAP = 16
TILE_CANDIDATES = (512, 256, 128, 64, 32, 16, 8)
TILE_CLEAR_FRACTION = 0.75


# --- chunked prefill --------------------------------------------------------------------------
def chunk_chain(chunk_size: int, prompt_len: int) -> list[GridPoint]:
    """The chunks that prefill a ``prompt_len`` prompt ``chunk_size`` tokens at a time."""
    if not 0 < chunk_size <= prompt_len:
        raise ValueError(f"chunk_size must be in [1, prompt_len={prompt_len}], got {chunk_size}")
    return [
        GridPoint(min(chunk_size, prompt_len - start), 0, start)
        for start in range(0, prompt_len, chunk_size)
    ]


# --- the analysis ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PiggybackCost:
    """What ``decode_tokens`` decodes at ``context_len`` cost per decode token."""

    prefill_tokens: int  # the chunk they ride on
    decode_tokens: int
    context_len: int
    piggybacked_s: float  # (hybrid - prefill-only) / decodes
    decode_only_s: float | None  # decode-only micro-batch / decodes, if measured

    @property
    def ratio(self) -> float | None:
        """Piggybacked / decode-only cost per decode token (<< 1: nearly free)."""
        return None if not self.decode_only_s else self.piggybacked_s / self.decode_only_s


@dataclass(frozen=True)
class ProfileFindings:
    prompt_len: int
    """The unchunked prompt length the overheads refer to."""
    chunk_overhead: dict[int, float]
    """Chunk size -> (time to prefill ``prompt_len`` in chunks of it) / (unchunked time) - 1."""
    min_chunk: dict[float, int]
    """Overhead threshold -> the smallest chunk whose overhead is within it (absent: none)."""
    tile_steps: list[tuple[int, float]]
    """(rows, jump): past the previous swept row count (at most ``MAX_STEP_GAP`` fewer), the
    cost per micro-batch rises by ``jump`` (0.18 = +18%) while the cost per row rises by
    more than ``STEP_THRESHOLD``: the rows spilled into one more matmul tile."""
    tile_size: int | None
    """The steps' period when clear (Note "profile analysis"), else None."""
    stage: int = 0
    max_overhead: float = 0.2
    """The threshold asked for besides ``DEFAULT_THRESHOLDS``."""
    unchunked_s: float = 0.0
    """Seconds of one prefill of ``prompt_len`` tokens."""
    fastest_overhead: dict[int, float] = field(default_factory=dict)
    """``chunk_overhead`` from each configuration's fastest run (``min_seconds``), where
    recorded. Far from ``chunk_overhead``: other work disturbed the timings."""
    step_baselines: dict[int, int] = field(default_factory=dict)
    """Step rows -> the swept row count it is measured against."""
    piggyback: list[PiggybackCost] = field(default_factory=list)

    def summary_lines(self) -> list[str]:
        return [
            *self._overhead_lines(),
            *self._tile_lines(),
            *self._piggyback_lines(),
        ]

    def _overhead_lines(self) -> list[str]:
        lines = [
            f"stage {self.stage}: one {self.prompt_len}-token prefill takes "
            f"{self.unchunked_s * 1e3:.1f} ms; the same prompt in chunks:"
        ]
        for c, overhead in sorted(self.chunk_overhead.items()):
            total = self.unchunked_s * (1 + overhead) * 1e3
            fastest = ""
            if c in self.fastest_overhead:
                fastest = f"; fastest runs {self.fastest_overhead[c] * 100:+.1f}%"
            lines.append(
                f"  chunk {c:>5}: {overhead * 100:+6.1f}% vs unchunked {self.prompt_len}-token "
                f"prefill ({total:.1f} ms{fastest})"
            )
        for threshold in sorted({*DEFAULT_THRESHOLDS, self.max_overhead}, reverse=True):
            chunk = self.min_chunk.get(threshold, "none of the measured ones")
            lines.append(f"smallest chunk within {threshold * 100:g}%: {chunk}")
        return lines

    def _tile_lines(self) -> list[str]:
        if not self.tile_steps:
            return [
                f"tile steps: none (no rise of the cost per row above {STEP_THRESHOLD:.0%} between swept rows)"
            ]
        steps = ", ".join(
            f"{rows} rows {jump * 100:+.0f}% vs {self.step_baselines.get(rows, '?')}"
            for rows, jump in self.tile_steps
        )
        period = f"{self.tile_size} rows" if self.tile_size else "no clear period"
        return [f"tile steps: {steps}", f"tile size: {period}"]

    def _piggyback_lines(self) -> list[str]:
        if not self.piggyback:
            return []
        lines = ["piggybacked decodes (cost per decode token):"]
        for pc in self.piggyback:
            where = (
                f"  {pc.decode_tokens:>3} decodes at context {pc.context_len:>5} on a "
                f"{pc.prefill_tokens:>4}-token chunk:"
            )
            lines.append(f"{where} {_piggyback_text(pc)}")
        return lines


def _piggyback_text(pc: PiggybackCost) -> str:
    if pc.piggybacked_s <= 0:  # the difference of two timings, each a few % noisy
        return "below the timing noise (the hybrid ran no slower than the chunk alone)"
    text = f"{pc.piggybacked_s * 1e3:.3f} ms"
    if pc.decode_only_s is not None:
        text += f" vs {pc.decode_only_s * 1e3:.3f} ms decode-only (ratio {pc.ratio:.2f})"
    return text


def analyze_profile(rows: list[ProfileRow], max_overhead: float = 0.2) -> ProfileFindings:
    """The findings of one stage's profile (``ValueError`` if it has no chunk chain)."""
    if not max_overhead > 0:
        raise ValueError(f"max_overhead must be > 0, got {max_overhead}")
    times, fastest = _times(rows), _fastest(rows)
    prompt_len = _prompt_len(times)
    unchunked = times[GridPoint(prompt_len, 0, 0)]
    overhead = chunk_overheads(times, prompt_len, _chunk_sizes(times, prompt_len))
    min_chunk = {}
    for threshold in sorted({*DEFAULT_THRESHOLDS, max_overhead}):
        within = [c for c, o in overhead.items() if o <= threshold]
        if within:
            min_chunk[threshold] = min(within)
    steps, baselines = tile_steps(times, fastest)
    return ProfileFindings(
        prompt_len=prompt_len,
        chunk_overhead=dict(sorted(overhead.items())),
        min_chunk=min_chunk,
        tile_steps=steps,
        tile_size=tile_period(steps, baselines, _swept_rows(times)),
        stage=rows[0].stage,
        max_overhead=max_overhead,
        unchunked_s=unchunked,
        fastest_overhead=chunk_overheads(fastest, prompt_len, _chunk_sizes(fastest, prompt_len)),
        step_baselines=baselines,
        piggyback=piggyback_costs(times),
    )


def chunk_overheads(
    times: dict[GridPoint, float], prompt_len: int, chunk_sizes: list[int]
) -> dict[int, float]:
    """Chunk size -> the chunk chain's total time / the unchunked prefill's - 1."""
    unchunked = times.get(GridPoint(prompt_len, 0, 0))
    if unchunked is None:
        return {}
    return {
        c: sum(times[pt] for pt in chunk_chain(c, prompt_len)) / unchunked - 1 for c in chunk_sizes
    }


def _times(rows: list[ProfileRow]) -> dict[GridPoint, float]:
    """Seconds per configuration; a configuration measured twice gets the median."""
    if not rows:
        raise ValueError("the profile has no rows")
    stages = sorted({r.stage for r in rows})
    if len(stages) > 1:
        raise ValueError(f"the profile mixes stages {stages}: analyse one stage's rows at a time")
    seen: dict[GridPoint, list[float]] = {}
    for r in rows:
        seen.setdefault(r.key, []).append(r.seconds)
    return {key: statistics.median(ts) for key, ts in seen.items()}


def _fastest(rows: list[ProfileRow]) -> dict[GridPoint, float]:
    """``min_seconds`` per configuration, where recorded (the least disturbed run)."""
    out: dict[GridPoint, float] = {}
    for r in rows:
        if r.min_seconds is not None:
            out[r.key] = min(r.min_seconds, out.get(r.key, math.inf))
    return out


def _chunk_sizes(times: dict[GridPoint, float], prompt_len: int) -> list[int]:
    """Chunk sizes below ``prompt_len`` whose whole chain was measured."""
    sizes = {pt.prefill_tokens for pt in times if pt.decode_tokens == 0 and pt.context_len == 0}
    return [
        c for c in sorted(sizes)
        if c < prompt_len and all(pt in times for pt in chunk_chain(c, prompt_len))
    ]  # fmt: skip


def _prompt_len(times: dict[GridPoint, float]) -> int:
    """The longest unchunked prefill that has at least one complete chunk chain."""
    unchunked = sorted(
        (pt.prefill_tokens for pt in times if pt.decode_tokens == 0 and pt.context_len == 0),
        reverse=True,
    )
    for p in unchunked:
        if _chunk_sizes(times, p):
            return p
    raise ValueError(
        "the profile has no chunked prefill to compare: it needs an unchunked prefill row "
        "(P, 0, 0) and, for some chunk c < P, the rows (c, 0, k) for k = 0, c, 2c, ... < P "
        f"(as prefill_tokens, decode_tokens, context_len); prefill-only rows at context 0: "
        f"{sorted(unchunked)}"
    )


def _swept_rows(times: dict[GridPoint, float]) -> list[tuple[int, float]]:
    """(rows, seconds) of the prefill-only micro-batches at context 0, by rows."""
    return sorted(
        (pt.prefill_tokens, t)
        for pt, t in times.items()
        if pt.decode_tokens == 0 and pt.context_len == 0
    )


def tile_steps(
    times: dict[GridPoint, float], fastest: dict[GridPoint, float] | None = None
) -> tuple[list[tuple[int, float]], dict[int, int]]:
    """The tile steps (see ``ProfileFindings.tile_steps``) and each one's baseline rows.

    A step must show in the medians and, where ``fastest`` has both ends, in the fastest
    runs too: on a shared machine one slow spell can lift a median by 10%, but it rarely
    slows every run of one configuration and none of its neighbour's."""
    fastest = fastest or {}
    steps, baselines = [], {}
    swept = _swept_rows(times)
    for (m, t_m), (n, t_n) in zip(swept, swept[1:]):
        if n - m > MAX_STEP_GAP or not _rises(m, t_m, n, t_n):
            continue
        fast_m, fast_n = fastest.get(GridPoint(m, 0, 0)), fastest.get(GridPoint(n, 0, 0))
        if fast_m is None or fast_n is None or _rises(m, fast_m, n, fast_n):
            steps.append((n, t_n / t_m - 1))
            baselines[n] = m
    return steps, baselines


def _rises(m: int, t_m: float, n: int, t_n: float) -> bool:
    """Whether the cost per row rises by more than ``STEP_THRESHOLD`` from m to n rows."""
    return (t_n / n) / (t_m / m) - 1 > STEP_THRESHOLD


def tile_period(
    steps: list[tuple[int, float]], baselines: dict[int, int], swept: list[tuple[int, float]]
) -> int | None:
    """The largest T of ``TILE_CANDIDATES`` that explains the steps: at least 2 steps, and
    at least ``TILE_CLEAR_FRACTION`` of the steps lie just past a multiple of T and of the
    swept pairs that cross a multiple of T show a step. None when no T does."""
    if len(steps) < 2:
        return None
    step_rows = {n for n, _ in steps}
    pairs = [(m, n) for (m, _), (n, _) in zip(swept, swept[1:]) if n - m <= MAX_STEP_GAP]
    for tile in TILE_CANDIDATES:
        crossing = [(m, n) for m, n in pairs if _crosses(m, n, tile)]
        explained = [n for n in step_rows if _crosses(baselines[n], n, tile)]
        shown = [n for _, n in crossing if n in step_rows]
        if (
            len(explained) >= 2
            and len(explained) >= TILE_CLEAR_FRACTION * len(step_rows)
            and len(shown) >= TILE_CLEAR_FRACTION * len(crossing)
        ):
            return tile
    return None


def _crosses(m: int, n: int, tile: int) -> bool:
    """Whether going from ``m`` to ``n`` rows passes a multiple of ``tile`` (m <= k*tile < n)."""
    return (n - 1) // tile * tile >= m


def piggyback_costs(times: dict[GridPoint, float]) -> list[PiggybackCost]:
    """One ``PiggybackCost`` per measured hybrid ``(c, d, x)`` with its ``(c, 0, x)``."""
    out = []
    for pt, t in sorted(times.items()):
        c, d, x = pt
        base = times.get(GridPoint(c, 0, x))
        if c == 0 or d == 0 or base is None:
            continue
        alone = times.get(GridPoint(0, d, x))
        out.append(PiggybackCost(c, d, x, (t - base) / d, None if alone is None else alone / d))
    return out
