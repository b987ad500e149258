"""The offline profile of one pipeline stage as a CSV file: its rows, writing and reading.

Pure Python (no torch): ``sarathi-pp profile`` (``stages/worker/profiler.py`` times the forward)
writes the CSV; ``sarathi-pp plan --profile`` and anyone else read it back here, and
``sarathi_pp/planner/profile_analysis.py`` reads the findings off the rows.

One CSV row is one timed configuration of a micro-batch on one stage: a prefill chunk of
``prefill_tokens`` rows and ``decode_tokens`` decode rows, every sequence with
``context_len`` tokens already in its KV cache (the chunk runs at positions
``[context_len, context_len + prefill_tokens)``, each decode at position ``context_len``),
and ``seconds``, the median wall time of the stage's forward on it. Lines starting with
``#`` are comments (the profiler writes the machine and model there).
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NamedTuple

PROFILE_COLUMNS = ("stage", "prefill_tokens", "decode_tokens", "context_len", "seconds")
# Written by the profiler, optional when reading (an empty cell reads as None).
EXTRA_COLUMNS = ("min_seconds", "repeats", "num_layers", "threads", "dtype", "device")


@dataclass(frozen=True, slots=True)
class ProfileRow:
    """One timed configuration (see the module docstring)."""

    stage: int
    prefill_tokens: int
    decode_tokens: int
    context_len: int
    seconds: float  # median wall time of the stage's forward
    min_seconds: float | None = None  # the fastest run (the least disturbed)
    repeats: int | None = None  # timed runs behind the median
    num_layers: int | None = None  # decoder layers of the stage
    threads: int | None = None  # torch intra-op threads (CPU)
    dtype: str | None = None
    device: str | None = None

    def __post_init__(self) -> None:
        for name in ("stage", "prefill_tokens", "decode_tokens", "context_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.num_tokens < 1:
            raise ValueError("a row needs prefill_tokens + decode_tokens >= 1, got 0 + 0")
        if not _is_positive(self.seconds):
            raise ValueError(f"seconds must be a finite number > 0, got {self.seconds!r}")

    @property
    def num_tokens(self) -> int:
        """Rows of the micro-batch: prefill + decode."""
        return self.prefill_tokens + self.decode_tokens

    @property
    def key(self) -> GridPoint:
        return GridPoint(self.prefill_tokens, self.decode_tokens, self.context_len)


def _is_positive(x: object) -> bool:
    """A finite number > 0 (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


class GridPoint(NamedTuple):
    """One configuration to time (a row without its measurement)."""

    prefill_tokens: int
    decode_tokens: int
    context_len: int


# --- reading and writing ----------------------------------------------------------------------
_INT_FIELDS = {*PROFILE_COLUMNS[:4], "repeats", "num_layers", "threads"}
_FLOAT_FIELDS = {"seconds", "min_seconds"}


def write_profile(
    path: str | Path, rows: Iterable[ProfileRow], comments: Iterable[str] = ()
) -> None:
    """Write ``rows`` as CSV: ``# comment`` lines, the header, one line per row."""
    out = io.StringIO()
    for line in comments:
        out.write(f"# {line}\n")
    writer = csv.writer(out, lineterminator="\n")
    columns = PROFILE_COLUMNS + EXTRA_COLUMNS
    writer.writerow(columns)
    for row in rows:
        writer.writerow(["" if v is None else _cell(v) for v in (getattr(row, c) for c in columns)])
    Path(path).write_text(out.getvalue(), encoding="utf-8")


def _cell(value: object) -> str:
    return f"{value:.9g}" if isinstance(value, float) else str(value)


def load_profile(path: str | Path) -> list[ProfileRow]:
    """The rows of a profile CSV. ``FileNotFoundError`` if it is missing; ``ValueError``
    naming the file and the line for a header without the ``PROFILE_COLUMNS`` or a bad row."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"profile CSV {str(path)!r} does not exist")
    lines = [
        (line_no, text)
        for line_no, text in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1)
        if text.strip() and not text.lstrip().startswith("#")
    ]
    if not lines:
        raise ValueError(
            f"profile CSV {str(path)!r} is empty: expected a header with {', '.join(PROFILE_COLUMNS)}"
        )
    header_line, header_text = lines[0]
    header = _check_header(path, header_line, _split(header_text))
    rows = [_parse_row(path, line_no, header, _split(text)) for line_no, text in lines[1:]]
    if not rows:
        raise ValueError(f"profile CSV {str(path)!r} has a header but no rows")
    return rows


def _split(text: str) -> list[str]:
    return [cell.strip() for cell in next(csv.reader([text]))]


def _check_header(path: str | Path, line_no: int, header: list[str]) -> list[str]:
    missing = [c for c in PROFILE_COLUMNS if c not in header]
    if missing:
        raise ValueError(
            f"profile CSV {str(path)!r}, line {line_no}: missing column(s) {', '.join(missing)}; "
            f"the header has {', '.join(header)}; a profile needs {', '.join(PROFILE_COLUMNS)}"
        )
    duplicated = sorted({c for c in header if header.count(c) > 1})
    if duplicated:
        raise ValueError(
            f"profile CSV {str(path)!r}, line {line_no}: column(s) {', '.join(duplicated)} appear twice"
        )
    return header


def _parse_row(path: str | Path, line_no: int, header: list[str], cells: list[str]) -> ProfileRow:
    where = f"profile CSV {str(path)!r}, line {line_no}"
    if len(cells) != len(header):
        raise ValueError(f"{where}: {len(cells)} cells, the header has {len(header)} columns")
    known = {f.name for f in fields(ProfileRow)}
    values: dict[str, Any] = {}
    for name, cell in zip(header, cells):
        if name not in known:
            continue  # a column some other tool added
        try:
            values[name] = _value(name, cell)
        except ValueError:
            kind = "an integer" if name in _INT_FIELDS else "a number"  # text never fails
            raise ValueError(f"{where}: column {name} is {cell!r}, expected {kind}") from None
    try:
        return ProfileRow(**values)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _value(name: str, cell: str) -> int | float | str | None:
    if cell == "":
        if name in PROFILE_COLUMNS:
            raise ValueError(name)
        return None
    if name in _INT_FIELDS:
        return int(cell)
    if name in _FLOAT_FIELDS:
        return float(cell)
    return cell
