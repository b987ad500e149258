"""``sarathi-pp profile``: time one pipeline stage's forward over a grid of micro-batches on
the machine at hand, save the CSV and report what it shows.

The report gives the overhead of a chunked prefill against the unchunked one per chunk
size and the smallest chunk within 20%, 10% and ``--max-overhead`` (SARATHI's "chunk 256
costs < 20%, 512 < 10%"), the tile steps (where a few more rows cost a lot more), and the
cost of decodes piggybacked on a chunk. ``sarathi-pp plan --profile`` reads the CSV back.
The grid's rows and the CSV are described in ``sarathi_pp/planner/profile_csv.py``, the analysis
in ``sarathi_pp/planner/profile_analysis.py``.

Bad flags, a bad config, or an output that exists (without ``--overwrite``) are usage errors
(exit 2).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sarathi_pp.checkpoint import load_checkpoint
from sarathi_pp.cli.common import add_engine_args, config_from_args, user_errors
from sarathi_pp.executors import builtin_resolver
from sarathi_pp.placement import resolve_placement
from sarathi_pp.planner.profile_analysis import (
    GridPoint,
    analyze_profile,
    chunk_chain,
    write_profile,
)
from sarathi_pp.records.run_dir import PROFILE_FILE

if TYPE_CHECKING:
    from sarathi_pp.stages.worker.profiler import StageSetup


@dataclass(frozen=True)
class GridArgs:
    """What to time; the prompt length is the largest of ``prefill_tokens``."""

    prefill_tokens: tuple[int, ...]
    decode_tokens: tuple[int, ...]
    context_lens: tuple[int, ...]
    tile_rows: tuple[int, ...]
    repeats: int
    warmup: int
    # Decode-only micro-batches of each of these sizes at each of ``decode_contexts`` and
    # ``context_lens``: what the simulator's profiled model interpolates a decode-only
    # micro-batch from (few-row matmuls are far from linear in the rows on a CPU).
    decode_sweep: tuple[int, ...] = ()
    decode_contexts: tuple[int, ...] = ()


def _tile_pairs(multiples_of: int, up_to: int, step: int = 4) -> tuple[int, ...]:
    """Rows n and n + step at every multiple n of ``multiples_of``: a step past n shows."""
    return tuple(r for n in range(multiples_of, up_to + 1, multiples_of) for r in (n, n + step))


# 1-2 minutes for the embedded model on 2 shared cores: 80 s for stage 1 of
# configs/tiny-llama-pp2.yaml (4 layers, 1 thread), 90 s for configs/tiny-llama.yaml (8
# layers, 2 threads). Chunks of 64 are left out: their chain alone adds a quarter.
DEFAULT_GRID = GridArgs(
    prefill_tokens=(0, 128, 256, 512, 1024),
    decode_tokens=(0, 16),
    context_lens=(512,),
    tile_rows=_tile_pairs(64, 320),
    repeats=5,
    warmup=1,
    decode_sweep=(1, 2, 4, 8, 16, 32),
    decode_contexts=(128, 1024),
)
QUICK_GRID = GridArgs(
    prefill_tokens=(0, 64, 128, 256),
    decode_tokens=(0, 8),
    context_lens=(256,),
    tile_rows=_tile_pairs(128, 256),
    repeats=3,
    warmup=1,
    decode_sweep=(1, 4, 8),
    decode_contexts=(64,),
)
GRID_FLAGS = (
    "prefill_tokens", "decode_tokens", "context_lens", "tile_rows", "repeats", "warmup",
    "decode_sweep", "decode_contexts",
)  # fmt: skip


def token_list(text: str) -> tuple[int, ...]:
    """``"0,128,256"`` -> ``(0, 128, 256)`` (argparse ``type=``)."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected integers >= 0, got {text!r}")
    return values


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "profile",
        help="time one stage over a grid of micro-batches; chunk overheads and tile steps",
        description="Time one pipeline stage's forward over a grid of (prefill tokens, "
        "decode tokens, context length) on this machine, save the CSV and report the "
        "chunked-prefill overhead per chunk size, the smallest chunk within 20%, 10% and "
        "--max-overhead, the matmul tile steps and the piggybacked-decode cost. Grid flags "
        "not given take the default grid's values (--quick: the quick grid's).",
    )
    add_engine_args(p)
    g = p.add_argument_group("profile")
    g.add_argument(
        "--stage", type=int, metavar="K",
        help="the stage of the config's pipeline to time (default: the most expensive one "
        "by the partition's cost model, the one that sets the pace)",
    )  # fmt: skip
    g.add_argument(
        "--output", metavar="FILE",
        help=f"the CSV (default: <run-dir>/{PROFILE_FILE} with --run-dir, else ./{PROFILE_FILE})",
    )  # fmt: skip
    g.add_argument(
        "--max-overhead", type=float, default=0.2, metavar="F",
        help="also report the smallest chunk within this overhead (default 0.2: +20%%)",
    )  # fmt: skip
    g.add_argument("--quick", action="store_true", help="a small grid: seconds, not minutes")
    g = p.add_argument_group("grid (the prompt length P is the largest prefill value)")
    _grid_flag(g, "--prefill-tokens", "chunk sizes; 0 = decode-only", "prefill_tokens")
    _grid_flag(g, "--decode-tokens", "decodes riding on each chunk", "decode_tokens")
    _grid_flag(
        g,
        "--context-lens",
        "cached tokens of every sequence in the decode rows' micro-batches",
        "context_lens",
    )
    _grid_flag(g, "--tile-rows", "rows of the tile sweep (prefill-only, context 0)", "tile_rows")
    _grid_flag(g, "--decode-sweep", "sizes of decode-only micro-batches", "decode_sweep")
    _grid_flag(
        g,
        "--decode-contexts",
        "contexts of the decode sweep, besides --context-lens",
        "decode_contexts",
    )
    g.add_argument("--repeats", type=int, metavar="N", help=f"timed runs per configuration, median kept (default {DEFAULT_GRID.repeats})")  # fmt: skip
    g.add_argument("--warmup", type=int, metavar="N", help=f"untimed runs first (default {DEFAULT_GRID.warmup})")  # fmt: skip
    p.set_defaults(func=run)


def _grid_flag(group: Any, flag: str, what: str, name: str) -> None:
    default = ",".join(map(str, getattr(DEFAULT_GRID, name)))
    group.add_argument(flag, type=token_list, metavar="N,N,...", help=f"{what} (default {default})")


# --- pieces that need no model --------------------------------------------------------------
def grid_args(args: argparse.Namespace) -> GridArgs:
    """The grid flags given, the preset's values for the others."""
    preset = QUICK_GRID if args.quick else DEFAULT_GRID
    values = {
        n: getattr(args, n) if getattr(args, n) is not None else getattr(preset, n)
        for n in GRID_FLAGS
    }
    if values["repeats"] < 1 or values["warmup"] < 0:
        raise ValueError(
            f"--repeats must be >= 1 and --warmup >= 0, got {values['repeats']} and {values['warmup']}"
        )
    if args.max_overhead <= 0:
        raise ValueError(f"--max-overhead must be > 0, got {args.max_overhead}")
    return GridArgs(**values)


def profile_grid(grid: GridArgs, max_model_len: int) -> tuple[list[GridPoint], list[GridPoint]]:
    """The configurations to time, and those skipped as longer than ``max_model_len``.

    With P the largest prefill value: one unchunked prefill of P; the chunk chain of every
    smaller non-zero prefill value (what chunked prefill costs); the tile sweep; and every
    (prefill < P, decode, context) of the lists, prefill = decode = 0 excepted (decodes
    alone, piggybacked, and the chunk alone at that context); and the decode sweep: decode-only
    micro-batches of every ``decode_sweep`` size at every context of ``decode_contexts`` and
    ``context_lens``."""
    prompt_len = max(grid.prefill_tokens)
    if prompt_len < 1:
        raise ValueError(
            f"--prefill-tokens needs a value >= 1 (the prompt length), got {grid.prefill_tokens}"
        )
    if prompt_len > max_model_len:
        raise ValueError(f"--prefill-tokens {prompt_len} exceeds max_model_len={max_model_len}")
    chunk_sizes = [c for c in grid.prefill_tokens if 0 < c < prompt_len]
    if not chunk_sizes:
        raise ValueError(
            f"--prefill-tokens {','.join(map(str, grid.prefill_tokens))} has no chunk size "
            f"between 0 and the prompt length {prompt_len}: nothing to compare the prefill with"
        )
    points = {GridPoint(prompt_len, 0, 0)}
    for c in chunk_sizes:
        points.update(chunk_chain(c, prompt_len))
    points.update(GridPoint(n, 0, 0) for n in grid.tile_rows if n > 0)
    points.update(
        GridPoint(p, d, x)
        for p in grid.prefill_tokens for d in grid.decode_tokens for x in grid.context_lens
        if p < prompt_len and p + d > 0
    )  # fmt: skip
    points.update(
        GridPoint(0, d, x)
        for d in grid.decode_sweep for x in {*grid.decode_contexts, *grid.context_lens} if d > 0
    )  # fmt: skip
    fits = sorted(pt for pt in points if _positions(pt) <= max_model_len)
    return fits, sorted(points - set(fits))


def _positions(pt: GridPoint) -> int:
    """Positions the longest sequence of ``pt`` reaches (a decode: its context + itself)."""
    return pt.context_len + max(pt.prefill_tokens, 1 if pt.decode_tokens else 0)


def output_path(output: str | None, run_dir: str | None, overwrite: bool) -> Path:
    """Where the CSV goes; checked before minutes of timing, not after."""
    path = Path(output) if output else Path(run_dir or ".") / PROFILE_FILE
    if path.is_dir():
        raise ValueError(f"--output {str(path)!r} is a folder")
    if path.exists() and not overwrite:
        raise ValueError(f"{str(path)!r} exists; pass --overwrite to replace it")
    if output and not path.parent.is_dir():
        raise FileNotFoundError(f"output folder {str(path.parent)!r} does not exist")
    return path


def machine_line() -> str:
    """The machine and its load: above the CPU count, other processes took turns on the
    cores and the medians are inflated (``min_seconds`` is the least disturbed run)."""
    line = f"machine: {platform.machine()}, {os.cpu_count()} logical CPUs, {platform.platform()}"
    if not hasattr(os, "getloadavg"):
        return line
    load = os.getloadavg()[0]
    busy = (
        " (busy: above the CPU count, rerun on a quiet machine)"
        if load > (os.cpu_count() or 1)
        else ""
    )
    return f"{line}, load avg (1 min) {load:.2f}{busy}"


# --- the subcommand ---------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    # torch: only once the flags are good
    from sarathi_pp.stages.worker.device import probe_resources
    from sarathi_pp.stages.worker.profiler import StageProfiler, binding_stage, stage_setup

    with user_errors():
        config = config_from_args(args)
        grid = grid_args(args)
        path = output_path(args.output, config.run.run_dir, config.run.overwrite)
        checkpoint = load_checkpoint(config.model, builtin_resolver())
        model_dir, spec, max_model_len = checkpoint.path, checkpoint.spec, checkpoint.max_model_len
        placement = resolve_placement(config, spec, probe_resources())
        num_stages = config.parallel.pipeline_parallel_size
        stage_idx = args.stage if args.stage is not None else binding_stage(spec, num_stages)
        setup = stage_setup(placement, stage_idx, config.cache.prefault)
        points, skipped = profile_grid(grid, max_model_len)
    header = _header_lines(model_dir, setup, points, skipped, grid, max_model_len)
    for line in header:
        print(line)
    profiler = StageProfiler(spec, model_dir, setup, max_model_len, points)
    start = time.perf_counter()

    def progress(done: int, total: int) -> None:
        elapsed = time.perf_counter() - start
        print(f"  pass {done}/{total} done, {elapsed:.0f} s", file=sys.stderr, flush=True)

    rows = profiler.measure(points, grid.repeats, grid.warmup, progress)
    machine = machine_line()  # the load while timing
    path.parent.mkdir(parents=True, exist_ok=True)
    write_profile(path, rows, [*header, machine])
    print(f"wrote {path} ({len(rows)} rows) in {time.perf_counter() - start:.0f} s")
    for line in analyze_profile(rows, args.max_overhead).summary_lines():
        print(line)
    print(machine)
    return 0


def _header_lines(
    model_dir: str,
    setup: StageSetup,
    points: list[GridPoint],
    skipped: list[GridPoint],
    grid: GridArgs,
    max_model_len: int,
) -> list[str]:
    """What is timed, on what: printed first and kept as the CSV's comment lines."""
    import torch

    s = setup.stage
    threads = setup.threads_source
    if setup.threads is not None:
        plural = "s" if setup.threads > 1 else ""
        threads = f"{setup.threads} thread{plural} ({setup.threads_source})"
    num_rows = sum(pt.prefill_tokens + pt.decode_tokens for pt in points)
    lines = [
        f"sarathi-pp profile: {model_dir}, stage {s.stage_idx} of {s.num_stages} "
        f"(layers [{s.layer_start}, {s.layer_end})), {s.device}, {s.dtype}, block size "
        f"{setup.block_size}, torch {torch.__version__}",
        f"{threads}",
        f"{len(points)} configurations ({num_rows} rows a pass) x ({grid.warmup} warm-up + "
        f"{grid.repeats} timed) passes; prompt length {max(grid.prefill_tokens)}",
    ]
    if skipped:
        lines.append(f"skipped {len(skipped)} configurations past max_model_len={max_model_len}")
    return lines
