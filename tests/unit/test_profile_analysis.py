"""The profile CSV and its analysis on hand-made rows (pure Python, no model), and the
grid ``sarathi-pp profile`` times."""

from __future__ import annotations

import math

import pytest

from sarathi_pp.cli import build_parser
from sarathi_pp.cli.profile import (
    DEFAULT_GRID,
    GridArgs,
    grid_args,
    output_path,
    profile_grid,
)
from sarathi_pp.planner.profile_analysis import (
    EXTRA_COLUMNS,
    PROFILE_COLUMNS,
    GridPoint,
    ProfileRow,
    analyze_profile,
    chunk_chain,
    load_profile,
    write_profile,
)

HEADER = ",".join(PROFILE_COLUMNS)


def rows_from(times: dict[tuple[int, int, int], float], stage: int = 0) -> list[ProfileRow]:
    return [ProfileRow(stage, p, d, x, t) for (p, d, x), t in times.items()]


# Prompt 1024: one unchunked prefill of 1 s; each chunk of c costs the same at every context,
# chosen (binary fractions) so that the overheads are exact: 64 -> +50%, 128 -> +25%,
# 256 -> +12.5%, 512 -> +6.25%.
CHUNK_COST = {64: 0.09375, 128: 0.15625, 256: 0.28125, 512: 0.53125}
EXPECTED_OVERHEAD = {64: 0.5, 128: 0.25, 256: 0.125, 512: 0.0625}


def chain_times(prompt_len: int = 1024) -> dict[tuple[int, int, int], float]:
    times = {(prompt_len, 0, 0): 1.0}
    for c, cost in CHUNK_COST.items():
        for start in range(0, prompt_len, c):
            times[(c, 0, start)] = cost
    return times


# --- chunked-prefill overhead -----------------------------------------------------------------
def test_chunk_overheads_and_min_chunk():
    f = analyze_profile(rows_from(chain_times()), max_overhead=0.3)
    assert f.prompt_len == 1024
    assert f.unchunked_s == 1.0
    assert f.chunk_overhead == EXPECTED_OVERHEAD
    assert f.min_chunk == {0.1: 512, 0.2: 256, 0.3: 128}


def test_min_chunk_has_the_default_thresholds_and_omits_unreachable_ones():
    f = analyze_profile(rows_from(chain_times()), max_overhead=0.01)
    assert f.min_chunk == {0.1: 512, 0.2: 256}  # 0.01: no chunk is within it
    text = "\n".join(f.summary_lines())
    assert "within 1%: none of the measured ones" in text
    assert "chunk   256:  +12.5% vs unchunked 1024-token prefill" in text


def test_fastest_runs_give_a_second_opinion():
    # A slow spell hit the unchunked prefill's median: its fastest run tells.
    rows = [ProfileRow(0, *key, t, min_seconds=t) for key, t in chain_times().items()]
    rows[0] = ProfileRow(0, 1024, 0, 0, 1.25, min_seconds=1.0)
    f = analyze_profile(rows)
    assert f.chunk_overhead[256] == pytest.approx(-0.1)  # 1.125 s / 1.25 s - 1
    assert f.fastest_overhead == EXPECTED_OVERHEAD
    assert "(1125.0 ms; fastest runs +12.5%)" in "\n".join(f.summary_lines())
    assert analyze_profile(rows_from(chain_times())).fastest_overhead == {}  # none recorded


def test_overhead_sums_chunks_at_growing_contexts():
    # Attention makes later chunks dearer: the chain sums every chunk at its own context.
    times = {(256, 0, 0): 1.0, (64, 0, 0): 0.25, (64, 0, 64): 0.25, (64, 0, 128): 0.5, (64, 0, 192): 0.5}  # fmt: skip
    f = analyze_profile(rows_from(times))
    assert f.prompt_len == 256
    assert f.chunk_overhead == {64: 0.5}
    assert 0.2 not in f.min_chunk and 0.1 not in f.min_chunk


def test_last_chunk_may_be_shorter():
    assert chunk_chain(128, 300) == [GridPoint(128, 0, 0), GridPoint(128, 0, 128), GridPoint(44, 0, 256)]  # fmt: skip
    times = {(300, 0, 0): 1.0, (128, 0, 0): 0.5, (128, 0, 128): 0.5, (44, 0, 256): 0.25}
    assert analyze_profile(rows_from(times)).chunk_overhead == {128: 0.25}


def test_incomplete_chain_is_left_out_and_the_longest_complete_prompt_wins():
    times = chain_times()
    del times[(64, 0, 960)]  # chunk 64's chain is incomplete
    times[(2048, 0, 0)] = 2.0  # a longer prefill with no chain at all
    f = analyze_profile(rows_from(times))
    assert f.prompt_len == 1024
    assert 64 not in f.chunk_overhead and 128 in f.chunk_overhead


def test_duplicate_rows_take_the_median():
    rows = rows_from(chain_times())
    rows += [ProfileRow(0, 1024, 0, 0, 3.0), ProfileRow(0, 1024, 0, 0, 0.5)]
    assert analyze_profile(rows).unchunked_s == 1.0  # median of 1.0, 3.0, 0.5


def test_no_chain_is_an_error_naming_what_is_needed():
    with pytest.raises(ValueError, match=r"no chunked prefill.*\(P, 0, 0\).*\[128, 256\]"):
        analyze_profile(rows_from({(256, 0, 0): 1.0, (128, 0, 0): 0.5}))


def test_mixed_stages_are_an_error():
    rows = rows_from(chain_times()) + [ProfileRow(1, 1024, 0, 0, 1.0)]
    with pytest.raises(ValueError, match=r"mixes stages \[0, 1\]"):
        analyze_profile(rows)


# --- tile steps ---------------------------------------------------------------------------------
def pairs(multiples_of: int, up_to: int) -> list[int]:
    return [r for n in range(multiples_of, up_to + 1, multiples_of) for r in (n, n + 4)]


def quantized(tile: int, rows: list[int]) -> dict[tuple[int, int, int], float]:
    """A GPU-like stage: a micro-batch costs 0.1 s per started tile of rows."""
    times = {(n, 0, 0): 0.1 * math.ceil(n / tile) for n in rows}
    times.update({(64, 0, 64): times[(64, 0, 0)], (128, 0, 0): times[(128, 0, 0)]})  # a chain
    return times


def test_tile_steps_of_128():
    f = analyze_profile(rows_from(quantized(128, pairs(64, 512))))
    assert [n for n, _ in f.tile_steps] == [132, 260, 388, 516]
    assert f.tile_steps[0][1] == pytest.approx(1.0)  # 1 tile -> 2 tiles
    assert f.tile_steps[1][1] == pytest.approx(0.5)
    assert f.step_baselines[260] == 256
    assert f.tile_size == 128
    assert "tile steps: 132 rows +100% vs 128" in "\n".join(f.summary_lines())


def test_tile_steps_of_64():
    f = analyze_profile(rows_from(quantized(64, pairs(64, 512))))
    assert [n for n, _ in f.tile_steps] == [68, 132, 196, 260, 324, 388, 452, 516]
    assert f.tile_size == 64


def test_one_cpu_like_step_has_no_clear_period():
    # Linear cost (1 ms a row) but 260 rows cost 18% more than 256: one step, no period.
    times = {(n, 0, 0): n * 1e-3 for n in pairs(64, 384)}
    times[(260, 0, 0)] = 0.256 * 1.18
    times.update({(64, 0, 64): 0.064, (128, 0, 0): 0.128})
    f = analyze_profile(rows_from(times))
    assert f.tile_steps == [(260, pytest.approx(0.18))]
    assert f.tile_size is None
    assert "tile size: no clear period" in f.summary_lines()


def test_a_step_must_show_in_the_fastest_runs_too():
    # The medians of 320 -> 324 rise 15%; the fastest runs don't: a slow spell, not a tile.
    rows = [ProfileRow(0, n, 0, 0, n * 1e-3, min_seconds=n * 0.9e-3) for n in pairs(64, 384)]
    rows = [r for r in rows if r.prefill_tokens != 324]
    rows += [ProfileRow(0, 324, 0, 0, 0.320 * 1.15, min_seconds=0.324 * 0.9e-3)]
    rows += [ProfileRow(0, 64, 0, 64, 0.064)]
    assert analyze_profile(rows).tile_steps == []
    rows[-2] = ProfileRow(0, 324, 0, 0, 0.320 * 1.15, min_seconds=0.320 * 0.9 * 1.15)
    assert [n for n, _ in analyze_profile(rows).tile_steps] == [324]


def test_smooth_costs_have_no_steps():
    times = {(n, 0, 0): 0.01 + n * 1e-3 for n in pairs(64, 384)}  # a fixed cost + per row
    times.update({(64, 0, 64): 0.074, (128, 0, 0): 0.138})
    f = analyze_profile(rows_from(times))
    assert f.tile_steps == [] and f.tile_size is None
    assert f.summary_lines()[-1].startswith("tile steps: none")


def test_rows_far_apart_are_not_compared():
    # 64 -> 128 rows: the cost per row rises, but 64 rows apart says nothing about tiles.
    times = {(128, 0, 0): 1.0, (64, 0, 0): 0.25, (64, 0, 64): 0.25}
    assert analyze_profile(rows_from(times)).tile_steps == []


# --- piggybacked decodes ----------------------------------------------------------------------
def test_piggyback_cost_per_decode():
    times = chain_times()
    times.update({(0, 32, 1024): 0.32, (256, 0, 1024): 0.5, (256, 32, 1024): 0.532})
    (pc,) = analyze_profile(rows_from(times)).piggyback
    assert (pc.prefill_tokens, pc.decode_tokens, pc.context_len) == (256, 32, 1024)
    assert pc.piggybacked_s == pytest.approx(0.001)
    assert pc.decode_only_s == pytest.approx(0.01)
    assert pc.ratio == pytest.approx(0.1)
    line = "32 decodes at context  1024 on a  256-token chunk: 1.000 ms vs 10.000 ms decode-only (ratio 0.10)"
    assert line in analyze_profile(rows_from(times)).summary_lines()[-1]


def test_piggyback_below_the_noise():
    times = chain_times()
    times.update({(256, 0, 1024): 0.5, (256, 32, 1024): 0.49})  # no decode-only row
    f = analyze_profile(rows_from(times))
    assert f.piggyback[0].ratio is None
    assert f.summary_lines()[-1].endswith(
        "below the timing noise (the hybrid ran no slower than the chunk alone)"
    )


# --- the CSV ----------------------------------------------------------------------------------
def test_write_then_load_round_trips(tmp_path):
    rows = [
        ProfileRow(1, 256, 0, 0, 0.123456789, 0.12, 5, 4, 1, "float32", "cpu"),
        ProfileRow(1, 0, 32, 1024, 0.05),
    ]
    path = tmp_path / "profile.csv"
    write_profile(path, rows, ["made by a test"])
    lines = path.read_text().splitlines()
    assert lines[0] == "# made by a test"
    assert lines[1].split(",") == [*PROFILE_COLUMNS, *EXTRA_COLUMNS]
    assert load_profile(path) == rows


def test_load_skips_comments_and_blank_lines_and_extra_columns(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text(
        f"# a comment\n\n{HEADER},note\n0,128,0,0,0.5,hello\n# another\n0,64,0,0,0.3,x\n"
    )
    assert [r.prefill_tokens for r in load_profile(path)] == [128, 64]


def test_missing_columns_are_named(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("# comment\nstage,prefill_tokens,decode_tokens\n0,128,0\n")
    with pytest.raises(ValueError) as e:
        load_profile(path)
    msg = str(e.value)
    assert str(path) in msg and "line 2" in msg
    assert "missing column(s) context_len, seconds" in msg


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("0,128,0,0,fast", "column seconds is 'fast', expected a number"),
        ("0,12.5,0,0,0.5", "column prefill_tokens is '12.5', expected an integer"),
        ("0,128,0,0", "4 cells, the header has 5 columns"),
        ("0,128,0,0,", "column seconds is '', expected a number"),
        ("0,-1,0,0,0.5", "prefill_tokens must be an integer >= 0, got -1"),
        ("0,128,0,0,0", "seconds must be a finite number > 0, got 0.0"),
        ("0,0,0,0,0.5", "a row needs prefill_tokens + decode_tokens >= 1, got 0 + 0"),
    ],
)
def test_malformed_row_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "p.csv"
    path.write_text(f"# comment\n{HEADER}\n0,64,0,0,0.25\n{line}\n")
    with pytest.raises(ValueError) as e:
        load_profile(path)
    assert f"profile CSV {str(path)!r}, line 4: {message}" in str(e.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_profile(tmp_path / "nope.csv")
    (tmp_path / "empty.csv").write_text("# only a comment\n")
    with pytest.raises(ValueError, match="is empty"):
        load_profile(tmp_path / "empty.csv")
    (tmp_path / "header.csv").write_text(HEADER + "\n")
    with pytest.raises(ValueError, match="no rows"):
        load_profile(tmp_path / "header.csv")


# --- the grid of `sarathi-pp profile` ---------------------------------------------------------
def small_grid(**changes) -> GridArgs:
    base = GridArgs((0, 32, 64), (0, 4), (16,), (32, 36), repeats=1, warmup=0)
    return GridArgs(**{**base.__dict__, **changes})


def test_grid_has_the_chains_the_sweep_and_the_decode_rows():
    points, skipped = profile_grid(small_grid(), max_model_len=128)
    assert skipped == []
    assert set(points) == {
        (64, 0, 0), (32, 0, 0), (32, 0, 32),  # unchunked prompt, chunk 32's chain
        (36, 0, 0),  # the sweep (32 is in the chain)
        (0, 4, 16), (32, 0, 16), (32, 4, 16),  # decodes alone, the chunk alone, both
    }  # fmt: skip
    assert analyze_profile([ProfileRow(0, *pt, 1.0) for pt in points]).prompt_len == 64


def test_grid_has_the_decode_sweep():
    points, _ = profile_grid(
        small_grid(decode_sweep=(1, 8), decode_contexts=(64,)), max_model_len=128
    )
    sweep = {pt for pt in points if pt.prefill_tokens == 0}
    assert sweep == {(0, 1, 16), (0, 8, 16), (0, 1, 64), (0, 8, 64), (0, 4, 16)}


def test_grid_skips_what_passes_max_model_len():
    points, skipped = profile_grid(small_grid(context_lens=(16, 100)), max_model_len=128)
    assert skipped == [GridPoint(32, 0, 100), GridPoint(32, 4, 100)]
    assert GridPoint(0, 4, 100) in points  # a decode at position 100 fits


@pytest.mark.parametrize(
    ("prefill", "message"),
    [((0, 32, 256), "256 exceeds max_model_len=128"), ((0, 64), "no chunk size between 0")],
)
def test_grid_errors(prefill, message):
    with pytest.raises(ValueError, match=message):
        profile_grid(small_grid(prefill_tokens=prefill), max_model_len=128)


def test_default_grid_fits_the_embedded_model():
    points, skipped = profile_grid(DEFAULT_GRID, max_model_len=2048)
    assert skipped == []
    rows = [ProfileRow(1, *pt, 1e-3 * (pt.prefill_tokens + pt.decode_tokens)) for pt in points]
    f = analyze_profile(rows)
    assert f.prompt_len == 1024 and sorted(f.chunk_overhead) == [128, 256, 512]


def test_grid_flags_override_the_preset():
    parser = build_parser()
    args = parser.parse_args(["profile", "--quick", "--repeats", "7", "--decode-tokens", "0,2"])
    grid = grid_args(args)
    assert grid.repeats == 7 and grid.decode_tokens == (0, 2)
    assert grid.prefill_tokens == (0, 64, 128, 256)  # the quick grid's
    assert grid_args(parser.parse_args(["profile"])) == DEFAULT_GRID


def test_output_path(tmp_path):
    assert output_path(None, str(tmp_path / "run"), False) == tmp_path / "run" / "profile.csv"
    (tmp_path / "p.csv").write_text("x")
    with pytest.raises(ValueError, match="exists; pass --overwrite"):
        output_path(str(tmp_path / "p.csv"), None, False)
    assert output_path(str(tmp_path / "p.csv"), None, True) == tmp_path / "p.csv"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        output_path(str(tmp_path / "no" / "p.csv"), None, False)
