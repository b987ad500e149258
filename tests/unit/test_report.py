"""The report files (summary.json, trace.json, timeline.png), request metrics, the text
tables and comparison, ``sarathi-pp report`` and its errors, on simulated run dirs (the
real engine loop on ``sarathi_pp.sim`` with stated stage times, ``tests/sim_runs.py``)."""

from __future__ import annotations

import argparse
import csv
import json
import shutil
from pathlib import Path

import pytest
import sim_runs

from sarathi_pp.cli.report import add_parser as add_report_parser
from sarathi_pp.cli.report import run_names
from sarathi_pp.records.run_dir import REQUEST_COLUMNS
from sarathi_pp.report import write_report
from sarathi_pp.report.bubbles import BUBBLE_CLASSES
from sarathi_pp.report.interval import interval_bubbles
from sarathi_pp.report.log import load_log
from sarathi_pp.report.request_metrics import distribution, load_requests, request_summary
from sarathi_pp.report.text import format_comparison, ratio_text
from sarathi_pp.sim.executor import Overheads

DIST_KEYS = {"p50", "p90", "p99", "max", "mean"}
DEMO_REQUESTS = 15


@pytest.fixture(scope="module")
def demo_source(sim_model_dir, tmp_path_factory) -> Path:
    """A simulated PP=2 run of a mixed load (15 requests, a pause in the arrivals), the
    runtime's overheads, sends and the tokens' return, as the engine leaves it (report
    files written)."""
    d = tmp_path_factory.mktemp("demo_source") / "demo"
    return sim_runs.run(
        d, sim_model_dir, sim_runs.mixed_requests(DEMO_REQUESTS, seed=0, pause=(8, 0.3)),
        sim_runs.mixed_compute_s, report=True, send_s=3e-4, return_s=5e-4, chunk_size=256,
        overheads=Overheads(driver_s=3e-4, dispatch_s=2e-4, handoff_s=2e-4),
    )  # fmt: skip


@pytest.fixture
def demo_run(demo_source: Path, tmp_path: Path) -> Path:
    """A copy of ``demo_source`` for the test to change."""
    return Path(shutil.copytree(demo_source, tmp_path / "demo"))


def issued(run_dir: Path) -> int:
    """The micro-batches the engine issued (its ``issue`` records)."""
    return sum(1 for r in sim_runs.events(run_dir) if r["type"] == "issue")


def sim_run(d: Path, model_dir: Path, reqs: list, compute_s, **kw) -> Path:
    return sim_runs.run(d, model_dir, reqs, compute_s, **kw)


# --- summary.json ---------------------------------------------------------------------------
def test_summary_keys(demo_run: Path):
    summary = write_report(demo_run)
    assert json.loads((demo_run / "summary.json").read_text()) == summary
    assert summary["steady_state"] is True and summary["steady_state_note"]
    assert len(summary["stages"]) == summary["num_stages"] == 2
    entry_keys = {"busy_s", "idle_s", "bubble_fraction", "bubbles_s", "fill_drain_s"}
    for e in [*summary["stages"], summary["overall"]]:
        assert entry_keys <= e.keys()
        assert list(e["bubbles_s"]) == list(BUBBLE_CLASSES)
        assert e["busy_s"] + e["idle_s"] == pytest.approx(e["window_s"], abs=1e-9)
        assert sum(e["bubbles_s"].values()) == pytest.approx(e["idle_s"], abs=1e-9)
    o = summary["overall"]
    assert o["bubble_fraction"] == pytest.approx(o["idle_s"] / o["window_s"])
    assert o["idle_s"] == pytest.approx(sum(e["idle_s"] for e in summary["stages"]))
    n = issued(demo_run)
    assert n > 100 and set(o["microbatches_by_kind"]) == {"prefill", "decode", "hybrid"}
    assert sum(o["microbatches_by_kind"].values()) == o["num_microbatches"] == n
    mbs = summary["stages"][1]["microbatches"]
    assert mbs["all"]["count"] == n and mbs["all"]["compute_cv"] > 0
    assert all(
        e["stalls"] == {"count": 0, "excess_s": 0.0, "listed": []} for e in summary["stages"]
    )


def test_summary_splits_the_window_at_the_last_prefill(sim_model_dir, tmp_path: Path, capsys):
    # a closed workload: six long prompts chunked (prefills, hybrids), then their decodes
    d = sim_run(tmp_path / "tail", sim_model_dir, sim_runs.requests([1000] * 6, 40),
                sim_runs.mixed_compute_s, send_s=0.002, chunk_size=256,
                overheads=Overheads(driver_s=0.002, dispatch_s=0.001, handoff_s=0.001))  # fmt: skip
    summary = write_report(d, plot=False)
    p, w = summary["prefill_split"], summary["window"]
    log = load_log(d / "events.jsonl")
    last = max((e for e in log.stages[0] if e.num_prefill_tokens > 0), key=lambda e: e.mb)
    after = {e.kind for e in log.stages[0] if e.mb > last.mb}
    assert last.kind == "hybrid" and after == {"decode"}
    assert p["cut_s"] == last.compute_end  # the last hybrid left stage 0
    # the same figures as report --interval over each part (segments computed apart)
    for (a, b), got in (((w["start_s"], p["cut_s"]), p["while_prefills"]),
                        ((p["cut_s"], w["end_s"]), p["decode_only"])):  # fmt: skip
        ib = interval_bubbles(log, a, b)
        assert got == pytest.approx((ib.bubble_fraction(0) + ib.bubble_fraction(1)) / 2)
    share = p["decode_only_share"]
    assert share == pytest.approx((w["end_s"] - p["cut_s"]) / w["duration_s"])
    mixed = (1 - share) * p["while_prefills"] + share * p["decode_only"]
    assert mixed == pytest.approx(summary["overall"]["bubble_fraction"])
    assert cli(str(d)) == 0
    out = capsys.readouterr().out
    assert f"bubble while prefills remain {p['while_prefills']:.1%}" in out
    assert f"of the window) {p['decode_only']:.1%}" in out


def test_compute_stalls_name_the_slow_micro_batches(sim_model_dir, tmp_path: Path, capsys):
    """Two hybrids that took 10x their neighbours on both stages (a first touch of the KV
    cache in a VM, say) are named, with what their shape predicted; the wait each caused on
    stage 1 is in the `hybrid` class, as the shapes give it (Note [compute stalls])."""

    def timed(s: int, mb) -> float:
        if mb.microbatch_id in (5, 25):
            return 1.2
        if mb.kind == "decode":
            return 0.03 + 0.002 * mb.num_decode_tokens
        return 0.12 * (mb.num_prefill_tokens + mb.num_decode_tokens) / 128  # 0.12 a full one

    # 30 prompts of 130 tokens in micro-batches of 128: prefills, ~30 hybrids, decodes
    d = sim_run(tmp_path / "stalls", sim_model_dir, sim_runs.requests([130] * 30, 30), timed,
                chunk_size=128)  # fmt: skip
    log = load_log(d / "events.jsonl")
    shapes = {e.mb: (e.kind, e.num_prefill_tokens + e.num_decode_tokens) for e in log.stages[0]}
    assert all(shapes[j] == ("hybrid", 128) for j in (4, 5, 6, 24, 25, 26))
    decodes = {e.num_decode_tokens for e in log.stages[0] if e.kind == "decode"}
    assert min(decodes) == 1 and max(decodes) >= 12  # decode-only ones of 1 to 15 decodes
    summary = write_report(d, plot=False)
    for e in summary["stages"]:
        st = e["stalls"]
        assert [x["mb"] for x in st["listed"]] == [5, 25] and st["count"] == 2
        assert all(x["expected_s"] == pytest.approx(0.12) for x in st["listed"])
        assert st["excess_s"] == pytest.approx(2 * (1.2 - 0.12))
    assert summary["stages"][1]["bubbles_s"]["hybrid"] >= 1.2 - 0.12 - 1e-9
    assert cli(str(d)) == 0
    out = capsys.readouterr().out
    assert "compute stalls" in out
    assert "stage 1: 2, 2.160 s past the prediction: mb 5 1.200 s (~0.120), mb 25 1.200" in out


def test_shapes_alone_are_no_compute_stalls(sim_model_dir, tmp_path: Path):
    """What shapes explain stays out: whole prompts of 128 to 1024 tokens (a per-token cost
    and attention growing with the prompt), decode-only micro-batches of 1 to 31 decodes
    over a read of the weights, small and large hybrids."""

    def compute_s(s: int, mb) -> float:
        p = mb.num_prefill_tokens
        return 0.1 + 3e-4 * p + 1e-7 * p * p + 0.002 * mb.num_decode_tokens  # 0.1: the weights

    whole = [128, 1024, 512, 128, 1024, 256]  # one at a time, a token each: prefills
    mixed = [8, 512, 1024, 1024] * 2  # arriving while others decode: hybrids
    prompts = whole + mixed + [8] * 64  # 64 short ones at once: decodes of 31 down to 1
    outputs = [1] * 6 + [12] * 8 + [1 + i // 2 for i in range(64)]
    arrivals = [3.0 * i for i in range(6)] + [20.0 + 0.15 * i for i in range(8)] + [40.0] * 64
    reqs = sim_runs.requests(prompts, outputs, arrivals)
    # balance_microbatches off and one micro-batch in flight per stage: a lone prompt goes
    # whole into one micro-batch (paced, it would be spread over those in flight), so every
    # shape of the list is there
    d = sim_run(
        tmp_path / "shapes", sim_model_dir, reqs, compute_s, chunk_size=1024,
        balance_microbatches=False, prefill_pacing=False, num_microbatches_in_flight=2,
    )  # fmt: skip
    events = load_log(d / "events.jsonl").stages[0]
    assert {e.num_prefill_tokens for e in events if e.kind == "prefill"} >= {128, 512, 1024}
    assert {e.num_prefill_tokens for e in events if e.kind == "hybrid"} >= {17, 511, 1023}
    decodes = {e.num_decode_tokens for e in events if e.kind == "decode"}
    assert min(decodes) == 1 and max(decodes) >= 30
    for e in write_report(d, plot=False)["stages"]:
        assert e["stalls"]["count"] == 0, e["stalls"]


def test_summary_requests(demo_run: Path):
    req = write_report(demo_run, plot=False)["requests"]
    for key in ("ttft_s", "tbt_s", "tpot_s", "e2e_s", "scheduling_delay_s"):
        assert set(req[key]) == DIST_KEYS
        assert req[key]["p50"] <= req[key]["p90"] <= req[key]["p99"] <= req[key]["max"]
    assert req["num_requests"] == DEMO_REQUESTS and req["tbt_source"] == "token_times"
    assert req["generated_tokens_per_s"] > 0 and req["requests_per_s"] > 0


def test_too_short_run_says_so(sim_model_dir, tmp_path: Path):
    # one prompt, one micro-batch, through three stages
    d = sim_run(tmp_path / "short", sim_model_dir, sim_runs.requests([8], 1),
                sim_runs.constant_s(0.01), num_stages=3)  # fmt: skip
    assert issued(d) == 1
    summary = write_report(d, plot=False)
    assert summary["steady_state"] is False and "too short" in summary["steady_state_note"]
    assert summary["window"] == summary["run"]
    assert summary["overall"]["fill_drain_s"] == 0.0


# --- request metrics ------------------------------------------------------------------------
def sim_rows(model_dir: Path, d: Path, n: int, num_tokens: int) -> list[dict[str, str]]:
    """``requests.csv``'s rows, as the engine wrote them, of a simulated run of ``n``
    requests of ``num_tokens`` output tokens each."""
    reqs = sim_runs.requests([64] * n, num_tokens, [0.05 * i for i in range(n)])
    run = sim_run(d, model_dir, reqs, sim_runs.constant_s(0.01))
    with open(run / "requests.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["num_output_tokens"]) for r in rows] == [num_tokens] * n
    return rows


def rows_csv(path: Path, rows: list[dict], token_times: bool = True) -> list:
    columns = [c for c in REQUEST_COLUMNS if token_times or c != "token_times"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return load_requests(path)


def test_tbt_pools_every_gap(sim_model_dir, tmp_path: Path):
    rows = sim_rows(sim_model_dir, tmp_path / "run", 2, num_tokens=3)
    rows[0]["token_times"] = "0.5 0.75 1.25"  # gaps 0.25, 0.5
    rows[1]["token_times"] = "0.25 1.25 1.5"  # gaps 1.0, 0.25
    req = request_summary(rows_csv(tmp_path / "r.csv", rows))
    assert req["tbt_s"]["max"] == 1.0 and req["tbt_s"]["mean"] == pytest.approx(0.5)
    assert req["tbt_s"]["p50"] == pytest.approx(0.375)


def test_tbt_without_token_times(sim_model_dir, tmp_path: Path):
    rows = sim_rows(sim_model_dir, tmp_path / "run", 3, num_tokens=5)
    req = request_summary(rows_csv(tmp_path / "r.csv", rows, token_times=False))
    assert req["tbt_source"] == "tbt_mean_s"
    assert req["tbt_s"]["max"] == pytest.approx(max(float(r["tbt_max_s"]) for r in rows))
    mean = sum(float(r["tbt_mean_s"]) for r in rows) / 3
    assert req["tbt_s"]["mean"] == pytest.approx(mean) and mean > 0


def test_tpot_leaves_out_one_token_requests(sim_model_dir, tmp_path: Path):
    rows = sim_rows(sim_model_dir, tmp_path / "run", 2, num_tokens=3)
    rows[1].update(num_output_tokens="1", token_times="0.5")
    r0 = {k: float(rows[0][k]) for k in ("e2e_s", "ttft_s")}
    req = request_summary(rows_csv(tmp_path / "r.csv", rows))
    assert req["tpot_s"]["mean"] == pytest.approx((r0["e2e_s"] - r0["ttft_s"]) / 2)
    assert req["num_requests"] == 2


def test_distribution():
    d = distribution([float(x) for x in range(101)])
    assert (d["p50"], d["p90"], d["p99"], d["max"], d["mean"]) == (50, 90, 99, 100, 50)
    assert distribution([]) == dict.fromkeys(("p50", "p90", "p99", "max", "mean"))


# --- trace.json -----------------------------------------------------------------------------
def test_trace(demo_run: Path):
    summary = write_report(demo_run, plot=False)
    trace = json.loads((demo_run / "trace.json").read_text())
    events = trace["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"stage 0", "stage 1", "scheduler"}
    pids = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    compute = [e for e in events if e["ph"] == "X" and e.get("cat") == "compute"]
    for s in range(2):
        mine = [e for e in compute if e["pid"] == pids[f"stage {s}"]]
        assert sorted(e["args"]["mb"] for e in mine) == list(range(issued(demo_run)))
    for e in compute:
        assert e["dur"] >= 0 and isinstance(e["ts"], float)
        assert e["name"] == f"mb {e['args']['mb']} {e['args']['kind']}"
        assert {"num_prefill_tokens", "num_decode_tokens"} <= e["args"].keys()
    bubbles = [e for e in events if e["ph"] == "X" and e.get("cat") == "bubble"]
    assert {e["name"] for e in bubbles} <= set(BUBBLE_CLASSES)
    steady = sum(
        e["dur"] for e in bubbles if e["pid"] == pids["stage 1"] and e["args"]["phase"] == "steady"
    )
    assert steady == pytest.approx(summary["stages"][1]["idle_s"] * 1e6, rel=1e-9)
    issues = [e for e in events if e["ph"] == "i" and e["cat"] == "issue"]
    assert len(issues) == issued(demo_run) and all(e["pid"] == pids["scheduler"] for e in issues)


# --- timeline.png ---------------------------------------------------------------------------
def test_timeline_png(demo_run: Path):
    pytest.importorskip("matplotlib")
    write_report(demo_run)
    data = (demo_run / "timeline.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


# --- comparison -----------------------------------------------------------------------------
def test_ratio_text():
    assert (
        ratio_text("bubble fraction", ("sarathi", "vllm"), (0.04, 0.31), "", ("fewer", "more"))
        == "bubble fraction sarathi 0.040 vs vllm 0.310: 7.8x fewer"
    )
    assert ratio_text("x", ("a", "b"), (2.0, 1.0), "", ("lower", "higher")).endswith("2.0x higher")
    assert ratio_text("x", ("a", "b"), (0.0, 1.0), "", ("fewer", "more")).endswith("(one is zero)")
    assert ratio_text("x", ("a", "b"), (None, 1.0), "", ("fewer", "more")).endswith(
        "not comparable"
    )


def two_runs(model_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """``sarathi``: eight prompts at once in chunks, every micro-batch 1 s on each stage
    and 0.02 s of the driver's between them; ``vllm``: whole prompts of 2 s between decodes
    of 0.5 s, one request a second (stage 1 waits for each prompt, the pipeline for the
    tokens of the few requests there are)."""
    balanced = sim_run(
        tmp_path / "sarathi", model_dir, sim_runs.requests([200] * 8, 6),
        sim_runs.constant_s(1.0), overheads=Overheads(driver_s=0.02), chunk_size=128,
    )  # fmt: skip
    costs = {"prefill": 2.0, "decode": 0.5, "hybrid": 1.0}

    def by_kind(s: int, mb) -> float:
        return costs[mb.kind]

    reqs = sim_runs.requests([64] * 4, 4, [0.0, 1.0, 2.0, 3.0])
    mixed = sim_run(tmp_path / "vllm", model_dir, reqs, by_kind, scheduler="vllm")
    assert {e.kind for e in load_log(mixed / "events.jsonl").stages[0]} == {"prefill", "decode"}
    return balanced, mixed


def test_comparison_text(sim_model_dir, tmp_path: Path):
    a, b = two_runs(sim_model_dir, tmp_path)
    sa, sb = write_report(a, plot=False), write_report(b, plot=False)
    fa, fb = sa["overall"]["bubble_fraction"], sb["overall"]["bubble_fraction"]
    assert fa > 0 and fb / fa > 2
    text = format_comparison(["sarathi", "vllm"], [sa, sb])
    assert f"bubble fraction sarathi {fa:.3f} vs vllm {fb:.3f}: {fb / fa:.1f}x fewer" in text
    assert "sarathi vs vllm:" in text and "tbt p99" in text
    pa, pb = sa["prefill_split"], sb["prefill_split"]  # each run's bubble by phase, side by side
    cells = f"{pa['while_prefills']:.3f}".rjust(14) + f"{pb['while_prefills']:.3f}".rjust(14)
    assert f"{'bubble while prefills':<26}{cells}" in text
    assert f"decode-only share sarathi {pa['decode_only_share']:.3f} vs vllm" in text


# --- the CLI --------------------------------------------------------------------------------
def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="sarathi-pp")
    add_report_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["report", *argv])
    return args.func(args)


def test_cli_one_run(demo_run: Path, capsys):
    assert cli(str(demo_run)) == 0
    out = capsys.readouterr().out
    assert "== demo" in out and "bubble" in out and "ttft" in out
    assert {"summary.json", "trace.json", "timeline.png"} <= {p.name for p in demo_run.iterdir()}


def test_cli_compares_runs(sim_model_dir, tmp_path: Path, capsys):
    a, b = two_runs(sim_model_dir, tmp_path)
    assert cli(str(a), str(b), "--no-write") == 0
    out = capsys.readouterr().out
    assert "bubble fraction sarathi" in out and "x fewer" in out
    assert not (a / "summary.json").exists()


def test_run_names():
    assert run_names(["runs/a", "other/b/"]) == ["a", "b"]
    assert run_names(["x/a", "y/a"]) == ["x/a", "y/a"]


# --- errors name the file -------------------------------------------------------------------
def broken(d: Path, name: str, text: str | None) -> Path:
    if text is None:
        (d / name).unlink()
    else:
        (d / name).write_text(text)
    return d / name


@pytest.mark.parametrize(
    ("name", "text", "error", "match"),
    [
        ("events.jsonl", None, FileNotFoundError, "no event log"),
        (
            "events.jsonl",
            '{"type": "header", "schema_version": 1, "num_stages": 2}\n{oops\n',
            ValueError,
            r"events.jsonl:2: not valid JSON",
        ),
        ("events.jsonl", "", ValueError, "header"),
        ("requests.csv", None, FileNotFoundError, "no request metrics"),
        ("requests.csv", "", ValueError, "empty file"),
        ("requests.csv", "request_id,arrival_s\n0,0.0\n", ValueError, "missing column"),
    ],
)
def test_bad_files(demo_run: Path, name, text, error, match):
    path = broken(demo_run, name, text)
    with pytest.raises(error, match=match) as info:
        write_report(demo_run)
    assert str(path) in str(info.value)


def test_a_last_line_cut_short_is_left_out(demo_run: Path):
    """A writer killed in the middle of a line: the report stands on the records before it
    (a bad line anywhere else is still an error, above)."""
    events = demo_run / "events.jsonl"
    full = write_report(demo_run, plot=False)
    lines = events.read_text().splitlines()
    # the scheduler's last wait, recorded once the last micro-batch's tokens were back
    assert json.loads(lines[-1])["type"] == "idle" and json.loads(lines[-2])["type"] == "stage"
    events.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])  # no newline: torn
    with pytest.warns(UserWarning, match=rf"events.jsonl:{len(lines)}: left out a last line"):
        cut = write_report(demo_run, plot=False)
    assert cut["overall"]["num_microbatches"] == full["overall"]["num_microbatches"]
    events.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20] + "\n")  # a whole line
    with pytest.raises(ValueError, match=rf"events.jsonl:{len(lines)}: not valid JSON"):
        write_report(demo_run, plot=False)


def test_bad_request_value(demo_run: Path):
    text = (demo_run / "requests.csv").read_text().splitlines()
    fields = text[2].split(",")  # the second request (no field of the engine's is quoted)
    fields[REQUEST_COLUMNS.index("arrival_s")] = "soon"
    text[2] = ",".join(fields)
    path = broken(demo_run, "requests.csv", "\n".join(text) + "\n")
    with pytest.raises(ValueError, match=r"requests.csv:3: column 'arrival_s': 'soon'"):
        write_report(demo_run)
    assert path.exists()


def test_missing_run_dir(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="run dir .*nope.* does not exist"):
        write_report(tmp_path / "nope")


def test_a_benchmark_folder_names_its_run_dirs(sim_model_dir, tmp_path: Path):
    """``bench``/``simulate --run-dir D`` write D/<scheduler>/ (and a capacity search
    D/<scheduler>/probes/rate-<r>/): ``report D`` names them instead of D's missing log."""

    def one_run(d: Path, num_requests: int) -> Path:
        reqs = sim_runs.requests([8] * num_requests, 1)
        return sim_run(d, sim_model_dir, reqs, sim_runs.constant_s(0.01))

    for name in ("sarathi", "vllm"):
        one_run(tmp_path / "bench" / name, 4)
    probe = one_run(tmp_path / "cap" / "sarathi" / "probes" / "rate-0.5", 1)
    (tmp_path / "bench" / "comparison.json").write_text("{}")
    for d, inner in (
        (tmp_path / "bench", [tmp_path / "bench" / "sarathi", tmp_path / "bench" / "vllm"]),
        (tmp_path / "cap", [probe]),
        (tmp_path / "cap" / "sarathi", [probe]),
    ):
        with pytest.raises(FileNotFoundError, match="is not a run dir but holds") as info:
            write_report(d)
        assert all(repr(str(p)) in str(info.value) for p in inner), info.value
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no event log"):  # nothing inside: as before
        write_report(tmp_path / "empty")


def test_cli_usage_error(tmp_path: Path):
    from sarathi_pp.cli.common import UsageError

    with pytest.raises(UsageError, match="nope"):
        cli(str(tmp_path / "nope"))


def test_main_exits_2_naming_the_file(tmp_path: Path, capsys):
    from sarathi_pp.cli import main

    with pytest.raises(SystemExit) as info:
        main(["report", str(tmp_path / "nope")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("sarathi-pp: error: ") and "nope" in err and "Traceback" not in err


def test_metrics_from_hand_made_token_timelines(tmp_path: Path):
    """RequestOutput metrics -> requests.csv -> summary: every formula on known times."""
    from sarathi_pp.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from sarathi_pp.records.run_dir import RunDir

    def out(rid: str, arrival: float, scheduled: float, times: list[float]) -> RequestOutput:
        m = RequestMetrics(arrival, scheduled, times[0], times[-1], list(times))
        done = CompletionOutput(0, "", list(range(len(times))), "length")
        return RequestOutput(rid, None, [1, 2], [done], True, m)

    outputs = [
        out("a", 100.0, 100.5, [101.0, 101.5, 103.0]),  # ttft 1, gaps 0.5 1.5, e2e 3
        out("b", 102.0, 102.0, [102.25, 102.5]),  # ttft 0.25, gap 0.25, e2e 0.5
        out("c", 104.0, 106.0, [107.0]),  # one token: no gap, no TPOT
    ]
    RunDir(tmp_path).write_requests(outputs)
    req = request_summary(load_requests(tmp_path / "requests.csv"))
    assert req["ttft_s"]["mean"] == pytest.approx((1.0 + 0.25 + 3.0) / 3)
    assert req["ttft_s"]["max"] == pytest.approx(3.0)
    assert sorted([req["tbt_s"]["p50"], req["tbt_s"]["max"]]) == pytest.approx([0.5, 1.5])
    assert req["tbt_s"]["mean"] == pytest.approx((0.5 + 1.5 + 0.25) / 3)
    # TPOT: (e2e - ttft) / (n - 1): a (3 - 1) / 2 = 1.0, b (0.5 - 0.25) / 1 = 0.25; c left out
    assert req["tpot_s"]["mean"] == pytest.approx(0.625) and req["tpot_s"]["max"] == 1.0
    assert req["scheduling_delay_s"]["max"] == pytest.approx(2.0)  # c: 106 - 104
    assert req["e2e_s"]["max"] == pytest.approx(3.0)
    # throughput: 6 tokens over first arrival (100) to last finish (107)
    assert req["duration_s"] == pytest.approx(7.0)
    assert req["generated_tokens_per_s"] == pytest.approx(6 / 7.0)
    assert req["requests_per_s"] == pytest.approx(3 / 7.0)


def test_a_log_cut_in_a_micro_batchs_stage_records_still_reports(tmp_path: Path):
    """A writer killed after stage 0's record of the last micro-batch and part-way into
    stage 1's: that micro-batch is left out with a warning (never the whole report); a gap
    before the end is still an error."""
    model = sim_runs.write_model_dir(tmp_path / "m")
    run = sim_runs.run(
        tmp_path / "run", model, sim_runs.requests([40] * 4, 5), sim_runs.constant_s(0.01)
    )
    lines = (run / "events.jsonl").read_text().splitlines(keepends=True)
    stage_lines = [i for i, line in enumerate(lines) if line.startswith('{"type": "stage"')]
    last = stage_lines[-1]
    whole = load_log(run / "events.jsonl")
    last_mb = max(e.mb for e in whole.stages[0])
    (run / "events.jsonl").write_text("".join(lines[:last]) + lines[last][:30])
    with pytest.warns(UserWarning, match=rf"left out micro-batch\(es\) \[{last_mb}\]"):
        cut = load_log(run / "events.jsonl")
    assert [len(s) for s in cut.stages] == [len(s) - 1 for s in whole.stages]
    with pytest.warns(UserWarning):
        write_report(run)
    assert (run / "summary.json").is_file()
    # the same record gone from the middle: an error naming the stages
    first = stage_lines[1]
    (run / "events.jsonl").write_text("".join(lines[:first] + lines[first + 1 :]))
    with pytest.raises(ValueError, match="stages 0 and 1 ran different micro-batches"):
        load_log(run / "events.jsonl")
