"""The simulator: analytic costs against hand-computed layers, tile padding, hardware and
model files, and small simulated runs through the real engine and schedulers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sim_runs

from sarathi_pp.bench.workload import workload_from_dict
from sarathi_pp.config import make_config
from sarathi_pp.microbatch import MicroBatch, ScheduledChunk
from sarathi_pp.model_spec import spec_from_dict
from sarathi_pp.report import load_log, write_report
from sarathi_pp.sampling_params import SamplingParams
from sarathi_pp.sim.analytic import LayerShape, Rows, layer_ops, op_seconds, pad_rows
from sarathi_pp.sim.cost_model import AnalyticCostModel
from sarathi_pp.sim.hardware import hardware_from_dict, load_hardware
from sarathi_pp.sim.setup import SimSetup, build_cluster

HW_DIR = Path(__file__).resolve().parents[2] / "configs" / "hardware"
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "eos_token_id": 2,
}
HW = sim_runs.TOY_GPU


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return sim_runs.write_model_dir(tmp_path / "tiny", TINY)


def ops_by_name(rows: Rows, tp: int = 1, tile: int = 128) -> dict:
    spec = spec_from_dict(TINY)
    shape = LayerShape.of(spec, tp, "bfloat16")
    hw = hardware_from_dict({**HW, "matmul_tile": tile}, "toy")
    out: dict = {}
    for op in layer_ops(shape, rows, tile, tp, hw):
        out.setdefault(op.name, []).append(op)
    return out


# --- the analytic model against hand-computed figures ------------------------------------
def test_gemm_flops_and_bytes_by_hand():
    rows = Rows(prefills=((0, 120),), decodes=(), num_sampled=1)
    ops = ops_by_name(rows)
    # qkv: [120 (padded to 128), 256] x [256, 256 + 2 x 128]; bf16
    qkv = ops["qkv"][0]
    assert qkv.flops == 2 * 128 * 256 * 512
    assert qkv.bytes == 2 * (256 * 512 + 120 * 256 + 120 * 512)
    down = ops["down"][0]
    assert down.flops == 2 * 128 * 512 * 256
    assert ops["gate_up"][0].flops == 2 * 128 * 256 * 1024
    assert "all_reduce" not in ops  # tp = 1


def test_attention_by_hand():
    # one chunk of 64 after 128 cached tokens, and decodes at contexts 10 and 20
    rows = Rows(prefills=((128, 64),), decodes=(10, 20), num_sampled=2)
    ops = ops_by_name(rows)
    d, heads, q_dim, kv_dim = 64, 4, 256, 128
    pre = ops["attn_prefill"][0]
    assert pre.flops == 4 * d * heads * 64 * (128 + 65 / 2)
    assert pre.bytes == 2 * (2 * 64 * q_dim + (128 + 64) * 2 * kv_dim + 64 * 2 * kv_dim)
    dec = ops["attn_decode"][0]
    assert dec.flops == 4 * d * heads * (11 + 21)
    assert dec.bytes == 2 * ((11 + 21) * 2 * kv_dim + 2 * (2 * q_dim + 2 * kv_dim))


def test_tile_padding():
    assert [pad_rows(n, 128) for n in (0, 1, 17, 127, 128, 129, 256)] == [
        0, 16, 32, 128, 128, 256, 256,
    ]  # fmt: skip
    flops = lambda n: ops_by_name(Rows(((0, n),), (), 0))["qkv"][0].flops  # noqa: E731
    assert flops(128) == flops(113) and flops(129) == 2 * flops(128)
    assert flops(1) == flops(16) == flops(128) / 8  # a few rows: a small-M kernel
    # a tile of 1: no padding
    assert ops_by_name(Rows(((0, 100),), (), 0), tile=1)["qkv"][0].flops == 2 * 100 * 256 * 512


def test_tensor_parallel_splits_weights_and_adds_all_reduces():
    rows = Rows(((0, 128),), (), 0)
    one, two = ops_by_name(rows, tp=1), ops_by_name(rows, tp=2)
    assert two["gate_up"][0].flops == one["gate_up"][0].flops / 2
    assert two["o"][0].flops == one["o"][0].flops / 2
    assert len(two["all_reduce"]) == 2  # after o and after down
    hw = hardware_from_dict(HW, "toy")
    # ring: 2 (tp-1)/tp x bytes / bw + latency = 1 x 128 x 256 x 2 / 1e11 + 1e-5
    assert two["all_reduce"][0].seconds == pytest.approx(128 * 256 * 2 / 100e9 + 10e-6)
    assert op_seconds(two["all_reduce"][0], hw) == two["all_reduce"][0].seconds
    with pytest.raises(ValueError, match="tp=3 must divide"):
        LayerShape.of(spec_from_dict(TINY), 3, "bfloat16")


def test_roofline_takes_the_slower_bound():
    hw = hardware_from_dict(HW, "toy")  # 50 TFLOP/s, 500 GB/s achievable
    decode = ops_by_name(Rows((), (100,), 1))["qkv"][0]  # one row: memory-bound
    assert op_seconds(decode, hw) == pytest.approx(decode.bytes / 500e9)
    big = ops_by_name(Rows(((0, 2048),), (), 0))["gate_up"][0]  # compute-bound
    assert op_seconds(big, hw) == pytest.approx(big.flops / 50e12)


def test_stage_costs_follow_the_layers_and_head():
    spec = spec_from_dict(TINY)
    hw = hardware_from_dict(HW, "toy")
    model = AnalyticCostModel(spec, hw, ((0, 2), (2, 6)), tp=1)
    chunk = ScheduledChunk(0, 0, tuple(range(64)), True, (0,), SamplingParams(), 0)
    cost = model.costs(MicroBatch(0, (chunk,)))
    layer = model.layer_seconds(Rows.of(MicroBatch(0, (chunk,))))
    assert cost.compute_s[0] > 2 * layer and cost.compute_s[1] > 4 * layer  # + embed, + head
    assert cost.send_s[1] == 0 and cost.send_s[0] == pytest.approx(64 * 256 * 2 / 10e9 + 20e-6)
    assert cost.return_s == pytest.approx(20e-6)


# --- hardware and model files --------------------------------------------------------------
def test_shipped_hardware_files_load():
    for name in ("a100-80gb", "a6000", "h100", "h200"):
        hw = load_hardware(HW_DIR / f"{name}.yaml")
        assert hw.name == name and hw.sources and hw.memory_bytes > 40 * 2**30


@pytest.mark.parametrize(
    "change,match",
    [
        ({"matmul_efficiency": 1.5}, "matmul_efficiency must be in"),
        ({"memory_bandwidth_gbs": 0}, "memory_bandwidth_gbs must be a number > 0"),
        ({"network_latency_us": "fast"}, "network_latency_us must be a number"),
        ({"hbm": 3}, "unknown key.*hbm"),
        ({"matmul_tile": 0}, "matmul_tile must be an integer >= 1"),
    ],
)
def test_bad_hardware_values_are_named(change, match):
    with pytest.raises(ValueError, match=match):
        hardware_from_dict({**HW, **change}, "bad.yaml")


def test_bad_hardware_files(tmp_path: Path):
    f = tmp_path / "x.yaml"
    f.write_text("matmul_tflops: 1\n")
    with pytest.raises(ValueError, match="missing key.*matmul_efficiency"):
        load_hardware(f)
    f.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="must hold a mapping"):
        load_hardware(f)
    f.write_text("a: [\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_hardware(f)
    with pytest.raises(FileNotFoundError, match="no-such-gpu"):
        load_hardware("no-such-gpu")


def test_shipped_model_configs_load():
    from sarathi_pp.checkpoint import load_model_spec

    models = Path(__file__).resolve().parents[2] / "configs" / "models"
    sizes = {d.name: load_model_spec(d).num_params() / 1e9 for d in models.iterdir()}
    assert set(sizes) >= {"llama-13b", "llama-33b", "llama-2-70b", "mistral-7b", "gpt3-175b"}
    assert 174 < sizes["gpt3-175b"] < 176 and 12.5 < sizes["llama-13b"] < 13.5


def test_bad_model_file_is_a_usage_error(tmp_path: Path, capsys):
    from sarathi_pp.cli import main

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**TINY, "hidden_size": 250}))
    w = tmp_path / "w.yaml"
    w.write_text("num_requests: 2\nprompt_tokens: 16\noutput_tokens: 2\n")
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--model", str(d), "--hardware", str(HW_DIR / "a100-80gb.yaml"),
              "--workload", str(w), "--run-dir", str(tmp_path / "r")])  # fmt: skip
    assert e.value.code == 2
    assert "hidden_size=250 is not divisible" in capsys.readouterr().err


# --- simulated runs ------------------------------------------------------------------------
def _cluster(model_dir: Path, pp: int, **overrides):
    config = make_config(model=str(model_dir), pipeline_parallel_size=pp, **overrides)
    return build_cluster(config, SimSetup(hardware=hardware_from_dict(HW, "toy")))


def _requests(n: int, prompt: int = 300, output: int = 6):
    w = workload_from_dict({"num_requests": n, "prompt_tokens": prompt, "output_tokens": output})
    return w.requests(1000)


def test_stage_order_and_inflight_limit(model_dir: Path, tmp_path: Path):
    cluster = _cluster(model_dir, pp=3, chunk_size=128)
    summary = cluster.serve_run(_requests(6), tmp_path / "run")
    log = load_log(tmp_path / "run" / "events.jsonl")
    assert summary["requests"]["num_requests"] == 6
    assert summary["requests"]["num_generated_tokens"] == 36
    for s in range(3):
        mbs = [e.mb for e in log.stages[s]]
        assert mbs == sorted(mbs)  # every stage runs micro-batches in issue order
    for s in range(1, 3):
        prev = log.by_mb(s - 1)
        for e in log.stages[s]:  # stage s starts j after stage s-1 ended it (+ the send)
            assert e.compute_start >= prev[e.mb].compute_end + 20e-6 - 1e-12
    done = dict(log.dones)
    # at most 3 (the stages) outstanding when one is issued, + the one scheduled ahead (on
    # by default: simulated GPUs leave the driver its CPU core)
    assert cluster.engines[0].schedule_ahead
    for issue in log.issues:
        outstanding = [i for i in log.issues if i.t <= issue.t and done[i.mb] > issue.t]
        assert len(outstanding) <= 3 + 1
    assert max(e.num_prefill_tokens + e.num_decode_tokens for e in log.stages[0]) <= 128


def test_inflight_limit_setting_is_obeyed(model_dir: Path, tmp_path: Path):
    cluster = _cluster(model_dir, pp=2, num_microbatches_in_flight=1)
    cluster.serve_run(_requests(4), tmp_path / "run")
    log = load_log(tmp_path / "run" / "events.jsonl")
    done = dict(log.dones)
    for a, b in zip(log.issues, log.issues[1:]):
        assert b.t >= done[a.mb]  # one at a time: the next waits for the previous' tokens


def test_decode_only_steps_take_one_microbatch_per_stage(model_dir: Path, tmp_path: Path):
    """PP=2 with 3 in flight: once no prompt has tokens left, at most 2 micro-batches (the
    stages: ``num_decode_microbatches_in_flight``'s default) are in flight and the decodes
    are shared out over them; with the limit at 3 the same run issues a third more
    decode-only micro-batches, each reading all of a stage's weights: more compute. (Whether
    the run ends sooner depends on the loop back to the driver against a decode's compute:
    on this toy model a decode takes microseconds, the loop back longer.)"""
    runs = {}
    for decode_limit in (None, 3):
        cluster = _cluster(
            model_dir, pp=2, chunk_size=128, num_microbatches_in_flight=3,
            num_decode_microbatches_in_flight=decode_limit, schedule_ahead=False,
        )  # fmt: skip
        run = tmp_path / f"decode-{decode_limit}"
        summary = cluster.serve_run(_requests(12, prompt=100, output=30), run)
        assert summary["requests"]["num_generated_tokens"] == 12 * 30
        runs[decode_limit] = (load_log(run / "events.jsonl"), summary)
    for decode_limit, (log, _) in runs.items():
        done = dict(log.dones)
        decode_only = [i for i in log.issues if i.kind == "decode"]
        assert len(decode_only) > 20
        most = max(
            sum(1 for j in log.issues if j.t <= i.t and done[j.mb] > i.t) for i in decode_only
        )  # in flight when a decode-only micro-batch was issued, itself included
        assert most == (decode_limit or 2), (decode_limit, most)
    counts = {d: sum(1 for i in log.issues if i.kind == "decode") for d, (log, _) in runs.items()}
    assert counts[None] < 0.8 * counts[3], counts
    busy = {
        d: sum(e.compute_end - e.compute_start for st in log.stages for e in st if e.kind == "decode")
        for d, (log, _) in runs.items()
    }  # fmt: skip
    assert busy[None] < 0.9 * busy[3], busy


def test_report_reads_a_simulated_run(model_dir: Path, tmp_path: Path):
    from sarathi_pp.cli import main

    cluster = _cluster(model_dir, pp=2)
    cluster.serve_run(_requests(5), tmp_path / "run")
    summary = write_report(tmp_path / "run", plot=False)
    assert summary["num_stages"] == 2 and summary["overall"]["num_microbatches"] > 0
    assert summary["requests"]["bubble_time_s"]["p50"] is not None
    assert main(["report", str(tmp_path / "run")]) == 0


def test_sarathi_beats_orca_on_tbt_p99(model_dir: Path, tmp_path: Path):
    """Long prompts stall orca's decodes; SARATHI's chunks keep every step short."""
    p99 = {}
    for policy in ("sarathi", "orca"):
        cluster = _cluster(model_dir, pp=1, scheduler=policy, chunk_size=128)
        s = cluster.serve_run(_requests(8, prompt=1500, output=20), tmp_path / policy)
        p99[policy] = s["requests"]["tbt_s"]["p99"]
    assert p99["sarathi"] < p99["orca"] / 2


def test_replicas_split_the_requests(model_dir: Path, tmp_path: Path):
    config = make_config(model=str(model_dir))
    setup = SimSetup(hardware=hardware_from_dict(HW, "toy"), replicas=3)
    summary = build_cluster(config, setup).serve_run(_requests(7), tmp_path / "run")
    assert summary["replicas"] == 3 and summary["requests"]["num_requests"] == 7
    counts = [
        summary_of(tmp_path / "run" / f"replica-{i}")["requests"]["num_requests"] for i in range(3)
    ]
    assert counts == [3, 2, 2]  # round robin
    assert len(summary["stages"]) == 3


def summary_of(d: Path) -> dict:
    return json.loads((d / "summary.json").read_text())


def test_simulate_cli_end_to_end(model_dir: Path, tmp_path: Path, capsys):
    from sarathi_pp.cli import main

    w = tmp_path / "w.yaml"
    w.write_text("num_requests: 6\nprompt_tokens: {choice: [64, 400]}\noutput_tokens: 5\n")
    out = tmp_path / "sim"
    rc = main(["simulate", "--model", str(model_dir), "--hardware", str(HW_DIR / "a6000.yaml"),
               "--pp", "2", "--workload", str(w), "--schedulers", "sarathi,orca",
               "--run-dir", str(out), "--no-progress"])  # fmt: skip
    assert rc == 0
    assert "sarathi / orca" in capsys.readouterr().out
    comparison = json.loads((out / "comparison.json").read_text())
    assert [r["name"] for r in comparison["runs"]] == ["sarathi", "orca"]
    for policy in ("sarathi", "orca"):
        assert summary_of(out / policy)["requests"]["num_generated_tokens"] == 30
        assert main(["report", str(out / policy)]) == 0


def test_pictures_of_a_long_run_show_a_window(model_dir: Path, tmp_path: Path):
    from sarathi_pp.report.window import head_window

    cluster = _cluster(model_dir, pp=2)
    cluster.serve_run(_requests(4), tmp_path / "run")
    log = load_log(tmp_path / "run" / "events.jsonl")
    assert head_window(log, log.num_microbatches) is None  # short enough: drawn whole
    w = head_window(log, 3)
    assert w is not None and [len(s) for s in w.stages] == [3, 3]
    assert {i.mb for i in w.issues} == {e.mb for e in w.stages[0]}
    end = max(e.send_end for e in w.stages[1])
    assert all(i.end <= end for i in w.idles)


@pytest.mark.parametrize("pp", [1, 3])
def test_compact_event_log_reads_as_the_full_one(model_dir: Path, tmp_path: Path, pp: int):
    """``run.compact_events``: one ``microbatch`` record per completed micro-batch instead of
    a ``done`` and one ``stage`` record per stage; the log reads back as the same events and
    gives the same summary."""
    logs, summaries = {}, {}
    for form in (False, True, "auto"):
        cluster = _cluster(model_dir, pp=pp, chunk_size=128, compact_events=form)
        d = tmp_path / str(form)
        summaries[form] = cluster.serve_run(_requests(6), d)
        logs[form] = load_log(d / "events.jsonl")
        types = [json.loads(line)["type"] for line in (d / "events.jsonl").open()]
        n = logs[form].num_microbatches
        assert n > 10
        if form is True:
            assert types.count("microbatch") == n and "stage" not in types and "done" not in types
        else:  # auto: compact only after 2,000 micro-batches
            assert types.count("stage") == pp * n and "microbatch" not in types
    full, compact = logs[False], logs[True]
    assert compact.dones == full.dones and compact.waits == full.waits
    assert compact.issues == full.issues
    assert compact.stages == full.stages
    assert summaries[True]["overall"] == summaries[False]["overall"]
    assert summaries[True]["requests"] == summaries[False]["requests"]


def test_compact_events_after_a_count(model_dir: Path, tmp_path: Path):
    """The switch mid-log (``auto`` does it at 2,000): both forms in one file read as one."""
    from sarathi_pp.records.events import EventLog

    cluster = _cluster(model_dir, pp=2, chunk_size=128)
    cluster.serve_run(_requests(6), tmp_path / "full")
    full = load_log(tmp_path / "full" / "events.jsonl")
    records = [json.loads(line) for line in (tmp_path / "full" / "events.jsonl").open()]
    header = records[0]
    log = EventLog(2, 0.0, header["config"], compact_after=5)
    by_mb = {e.mb: [full.stages[0][i], full.stages[1][i]] for i, e in enumerate(full.stages[0])}

    class MB:
        def __init__(self, mb):
            self.microbatch_id = mb

    class Result:
        def __init__(self, events):
            self.events = events

    for w in full.waits:
        log.completed(MB(w.mb), Result(by_mb[w.mb]), w.end, w.start, w.full)
    path = tmp_path / "mixed.jsonl"
    log.write(path)
    types = [json.loads(line)["type"] for line in path.open()]
    assert types.count("stage") == 2 * 5 and types.count("microbatch") == len(full.waits) - 5
    from sarathi_pp.report.log import parse_log

    mixed = parse_log([json.loads(line) for line in path.open()], "mixed")
    assert [e.mb for e in mixed.stages[1]] == [e.mb for e in full.stages[1]]
    assert mixed.waits == full.waits


def test_bad_compact_records_are_named(tmp_path: Path):
    from sarathi_pp.report.log import parse_log

    header = {"type": "header", "schema_version": 3, "num_stages": 2, "t0": 0.0, "config": {}}
    good = {"type": "microbatch", "mb": 0, "t": 2.0, "kind": "prefill",
            "num_prefill_tokens": 8, "num_decode_tokens": 0,
            "stages": [[0, 0, 0, 1, 1], [0, 1, 1, 2, 2]]}  # fmt: skip
    assert parse_log([header, good], "x").num_microbatches == 1
    with pytest.raises(ValueError, match="x:2: microbatch record field 'stages' must list 2"):
        parse_log([header, good | {"stages": [[0, 0, 0, 1, 1]]}], "x")
    with pytest.raises(ValueError, match="x:2: microbatch 0 stage 1: times must be 5 finite"):
        parse_log([header, good | {"stages": [[0, 0, 0, 1, 1], [0, 1, 1, 2]]}], "x")
    with pytest.raises(ValueError, match="compute_start <= compute_end <= send_end"):
        parse_log([header, good | {"stages": [[0, 0, 0, 1, 1], [0, 1, 3, 2, 2]]}], "x")
    with pytest.raises(ValueError, match="compact_events must be true, false or auto"):
        make_config(compact_events="yes")


# --- the profiled model --------------------------------------------------------------------
def test_profiled_fit_recovers_a_linear_cost(tmp_path: Path):
    from sarathi_pp.planner.profile_csv import ProfileRow, write_profile
    from sarathi_pp.sim.profiled import ProfiledCostModel, row_features

    true = [2e-3, 1e-5, 3e-5, 1e-9, 2e-8]
    grid = [(p, d, k) for p in (0, 64, 128, 256) for d in (0, 8, 16) for k in (0, 256, 512)]
    rows = [
        ProfileRow(
            0, p, d, k, sum(c * x for c, x in zip(true, row_features(p, d, k))), num_layers=4
        )
        for p, d, k in grid
        if p + d > 0
    ]
    write_profile(tmp_path / "p.csv", rows)
    model = ProfiledCostModel.from_csv(tmp_path / "p.csv", ((0, 4), (4, 6)))
    assert model.coef == pytest.approx(true, rel=1e-6)
    chunk = ScheduledChunk(0, 100, tuple(range(50)), True, (0,), None, 0)
    cost = model.costs(MicroBatch(0, (chunk,)))
    expected = model.seconds(row_features(50, 0, 100))
    assert cost.compute_s == pytest.approx((expected, expected / 2))  # 4 and 2 layers


def test_profiled_fit_drops_negative_terms(tmp_path: Path):
    from sarathi_pp.planner.profile_csv import ProfileRow
    from sarathi_pp.sim.profiled import fit

    # time falls with decodes (noise): the decode term is dropped, not negative
    rows = [
        ProfileRow(0, p, d, 0, 1e-3 + 1e-5 * p - 1e-7 * d) for p in (16, 64, 256) for d in (0, 8)
    ]
    coef = fit(rows)
    assert all(c >= 0 for c in coef) and coef[2] == 0.0


def test_interpolate_clamps_below_and_extrapolates_above():
    from sarathi_pp.sim.profiled import interpolate

    pts = [(1.0, 10.0), (4.0, 16.0), (8.0, 18.0)]
    assert interpolate(pts, 0.5) == 10.0  # below the first point: its value
    assert interpolate(pts, 2.0) == pytest.approx(12.0)
    assert interpolate(pts, 4.0) == pytest.approx(16.0)
    assert interpolate(pts, 6.0) == pytest.approx(17.0)
    assert interpolate(pts, 16.0) == pytest.approx(22.0)  # the last segment's slope


def test_profiled_decode_only_microbatches_come_from_the_sweep(tmp_path: Path):
    """Decode-only rows far from linear in the decodes (as few-row matmuls on a CPU): a
    decode-only micro-batch is read off them; one with a prefill chunk from the linear fit,
    made on the rows with a chunk."""
    from sarathi_pp.planner.profile_csv import ProfileRow, write_profile
    from sarathi_pp.sim.profiled import ProfiledCostModel, row_features

    true = [2e-3, 1e-5, 3e-5, 1e-9, 2e-8]

    def decode_only(d: int, k: int) -> float:
        return 0.03 + 0.01 * d**0.5 + 1e-6 * d * k

    rows = [
        ProfileRow(0, p, d, k, sum(c * x for c, x in zip(true, row_features(p, d, k))))
        for p in (64, 128, 256) for d in (0, 8, 16) for k in (0, 256, 512)
    ]  # fmt: skip
    rows += [ProfileRow(0, 0, d, k, decode_only(d, k)) for d in (1, 2, 4, 8, 16, 32)
             for k in (128, 1024)]  # fmt: skip
    write_profile(tmp_path / "p.csv", rows)
    model = ProfiledCostModel.from_csv(tmp_path / "p.csv", ((0, 4),))
    assert model.coef == pytest.approx(true, rel=1e-6)  # the decode-only rows kept out
    assert "decode-only micro-batches interpolated at contexts 128, 1024" in model.describe()

    def decodes(*contexts: int) -> MicroBatch:
        chunks = tuple(
            ScheduledChunk(i, k, (1,), False, (0,), None, 1) for i, k in enumerate(contexts)
        )
        return MicroBatch(0, chunks)

    def t(mb: MicroBatch) -> float:
        return model.costs(mb).compute_s[0]

    assert t(decodes(128, 128, 128, 128)) == pytest.approx(decode_only(4, 128))
    assert t(decodes(*[1024] * 16)) == pytest.approx(decode_only(16, 1024))
    six = (decode_only(4, 128) + decode_only(8, 128)) / 2  # between 4 and 8 decodes
    assert t(decodes(*[128] * 6)) == pytest.approx(six)
    mixed = (decode_only(2, 128) + decode_only(2, 1024)) / 2  # mean context 576: halfway
    assert t(decodes(128, 1024)) == pytest.approx(mixed)
    assert t(decodes(*[2048] * 2)) > decode_only(2, 1024)  # past the largest: extrapolated
    chunk = ScheduledChunk(0, 100, tuple(range(50)), True, (0,), None, 0)
    hybrid = MicroBatch(0, (chunk, *decodes(512).chunks[:1]))
    assert t(hybrid) == pytest.approx(model.seconds(row_features(50, 1, 100)), rel=0.05)


def test_activation_memory_comes_off_the_kv_cache(model_dir: Path):
    """On a simulated GPU the KV cache gets M_G - M_S less the peak activation memory of
    the largest micro-batch the scheduler can issue (``planner.memory.with_activations``,
    as the real executors)."""
    from sarathi_pp.config import SchedulerConfig
    from sarathi_pp.planner.memory import activation_bytes, kv_cache_bytes, max_rows

    assert max_rows(SchedulerConfig(chunk_size=256), 4096) == 256
    auto = SchedulerConfig(chunk_size="auto", max_chunk_size=1024, max_num_seqs=32)
    assert max_rows(auto, 4096) == 1024 + 32
    assert max_rows(SchedulerConfig(policy="orca", max_num_seqs=8), 4096) == 4096 + 8
    vllm = SchedulerConfig(policy="vllm", max_num_batched_tokens=2048, max_num_seqs=8)
    assert max_rows(vllm, 4096) == 2048 + 8
    shape = LayerShape.of(spec_from_dict(TINY), 1, "bfloat16")
    # hidden 256, q 256, kv 128, inter 512: attention 2*256 + (256 + 256) + 256 = 1280,
    # MLP 2*256 + 3*512 = 2048 per row; one more micro-batch's hidden state waits (256)
    assert activation_bytes(shape, 100, 2, last=False) == 100 * (2048 + 256) * 2
    # the last stage: 3 fp32 copies of the logits of the sampled rows (one per sequence)
    # or of the prompt rows scored at once (256), whichever is more, within the rows
    last = activation_bytes(shape, 100, 2, last=True, sampled=8)
    assert last == 100 * (2048 + 256) * 2 + 100 * 1000 * 4 * 3
    last = activation_bytes(shape, 1000, 2, last=True, sampled=300)
    assert last == 1000 * (2048 + 256) * 2 + 300 * 1000 * 4 * 3
    cluster = _cluster(model_dir, pp=2, chunk_size=512)
    executor = cluster.executor
    memory = executor.load_model()
    seqs = executor.config.scheduler.max_num_seqs
    assert executor.schedule_ahead.on  # one micro-batch more in flight
    assert [m.activation_bytes for m in memory] == [
        activation_bytes(shape, 512, 3, last=False),
        activation_bytes(shape, 512, 3, last=True, sampled=seqs),
    ]
    assert memory[0].memory_bytes == executor.placement.memory_bytes  # M_G itself
    first, second = (kv_cache_bytes(m) for m in memory)
    assert first == memory[0].memory_bytes - memory[0].param_bytes - memory[0].activation_bytes
    assert second < first  # the logits


# --- planning and capacity on the simulator ------------------------------------------------
def test_chunk_search_trades_throughput_for_tbt(model_dir: Path):
    from sarathi_pp.sim.chunk_search import search_chunk_size

    w = workload_from_dict({"num_requests": 6, "prompt_tokens": 1500, "output_tokens": 8})
    config = make_config(model=str(model_dir))
    setup = SimSetup(hardware=hardware_from_dict(HW, "toy"))
    loose = search_chunk_size(config, w, setup, 10.0, (128, 1024))
    small, big = loose.probes
    assert small.tbt_p99_s < big.tbt_p99_s and small.tokens_per_s < big.tokens_per_s
    assert loose.best.chunk_size == 1024  # both meet a loose SLO: the faster one
    tight = search_chunk_size(config, w, setup, (small.tbt_p99_s + big.tbt_p99_s) / 2, (128, 1024))
    assert tight.best.chunk_size == 128
    none = search_chunk_size(config, w, setup, small.tbt_p99_s / 10, (128,))
    assert none.best is None and "no chunk size meets" in none.lines()[-1]


def test_plan_simulate_cli(model_dir: Path, tmp_path: Path, capsys):
    from sarathi_pp.cli import main

    w = tmp_path / "w.yaml"
    w.write_text("num_requests: 4\nprompt_tokens: 600\noutput_tokens: 4\n")
    rc = main(["plan", "--simulate", "--model", str(model_dir), "--hardware",
               str(HW_DIR / "h100.yaml"), "--workload", str(w), "--slo-tbt-p99", "1",
               "--chunk-sizes", "128,512"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0 and "chunk_size: 512" in out
    with pytest.raises(SystemExit):
        main(["plan", "--simulate", "--model", str(model_dir), "--hardware", "h100"])
    assert "needs --workload" in capsys.readouterr().err


def test_simulate_capacity(model_dir: Path, tmp_path: Path, capsys):
    from sarathi_pp.cli import main

    w = tmp_path / "w.yaml"
    w.write_text("num_requests: 8\nprompt_tokens: 200\noutput_tokens: 6\n")
    rc = main(["simulate", "--model", str(model_dir), "--hardware", str(HW_DIR / "a6000.yaml"),
               "--workload", str(w), "--capacity", "--slo-tbt-p99", "1", "--max-probes", "3",
               "--start-rate", "1", "--run-dir", str(tmp_path / "cap"), "--no-progress"])  # fmt: skip
    assert rc == 0
    cap = json.loads((tmp_path / "cap" / "sarathi" / "capacity.json").read_text())
    assert len(cap["probes"]) == 3 and cap["capacity_rps"] == 4.0  # 1, 2, 4 req/s all met


def test_least_loaded_routing_picks_the_fewest_pending_tokens(model_dir: Path):
    """The simulator routes with the runtime's router (``sarathi_pp/routing.py``)."""
    config = make_config(model=str(model_dir))
    setup = SimSetup(hardware=hardware_from_dict(HW, "toy"), replicas=3, routing="least_loaded")
    cluster = build_cluster(config, setup)
    params = SamplingParams(max_tokens=2, ignore_eos=True)

    def add(i: int, rid: str, n: int = 8) -> None:
        cluster.engines[i].add_request(rid, None, params, prompt_token_ids=[5] * n)

    add(0, "a"), add(0, "b"), add(1, "c", n=30)
    assert cluster._route([7]) == 2  # pending tokens 20, 32, 0
    add(2, "d", n=40)
    assert cluster._route([7]) == 0  # 20, 32, 42: fewest pending tokens, not fewest requests
    rr = build_cluster(config, SimSetup(hardware=hardware_from_dict(HW, "toy"), replicas=3))
    assert [rr._route([7]) for k in range(5)] == [0, 1, 2, 0, 1]


def test_scheduling_ahead_takes_the_driver_off_the_loop(model_dir: Path, tmp_path: Path):
    """With the driver's own time, dispatch and token return large, a decode-heavy PP=2 run
    scheduled ahead (the ring: the link's latency only) is faster, with the same tokens;
    each micro-batch scheduled ahead starts on stage 0 after its source's last stage."""
    from sarathi_pp.sim.executor import Overheads
    from sarathi_pp.sim.setup import SimSetup, build_cluster

    slow = Overheads(driver_s=0.02, dispatch_s=0.02, return_s=0.02)
    out = {}
    for ahead in (False, True):
        config = make_config(
            model=str(model_dir), pipeline_parallel_size=2, chunk_size=128, schedule_ahead=ahead
        )
        setup = SimSetup(hardware=hardware_from_dict(HW, "toy"), overheads=slow)
        cluster = build_cluster(config, setup)
        assert cluster.engines[0].schedule_ahead is ahead
        run = tmp_path / f"ahead-{ahead}"
        out[ahead] = cluster.serve_run(_requests(8, prompt=64, output=24), run)
    assert out[True]["requests"]["num_generated_tokens"] == 8 * 24
    assert out[True]["requests"]["duration_s"] < 0.8 * out[False]["requests"]["duration_s"]
    log = load_log(tmp_path / "ahead-True" / "events.jsonl")
    first, last = log.by_mb(0), log.by_mb(1)
    ahead = [i for i in log.issues if i.ring is not None]
    assert ahead
    for i in ahead:
        assert first[i.mb].compute_start >= last[i.ring].compute_end


def test_scripted_costs_and_the_stages_handoff(sim_model_dir: Path, tmp_path: Path):
    """``ScriptedCostModel``: the stated times, stage by stage; ``Overheads.handoff_s``:
    each stage hands its output on for that long after computing (``send_end``) and takes
    the next micro-batch after it; the next stage has it a send later."""
    import sim_runs

    from sarathi_pp.sim.cost_model import ScriptedCostModel
    from sarathi_pp.sim.executor import Overheads

    def by_stage(s: int, mb: MicroBatch) -> float:
        return 1.0 + s  # stage 0: 1 s, stage 1: 2 s

    d = sim_runs.run(
        tmp_path / "run", sim_model_dir, sim_runs.requests([128] * 2, 1),
        by_stage, send_s=0.5, return_s=0.125, overheads=Overheads(handoff_s=0.25),
        chunk_size=128,
    )  # fmt: skip
    log = load_log(d / "events.jsonl")
    times = [
        [(e.input_ready, e.compute_start, e.compute_end, e.send_end) for e in stage]
        for stage in log.stages
    ]
    assert times[0] == [(0.0, 0.0, 1.0, 1.25), (0.0, 1.25, 2.25, 2.5)]
    assert times[1] == [(1.75, 1.75, 3.75, 4.0), (3.0, 4.0, 6.0, 6.25)]
    assert dict(log.dones) == {0: 4.125, 1: 6.375}  # the last handoff + the return
    model = ScriptedCostModel(3, by_stage, send_s=0.5, return_s=0.125)
    chunk = ScheduledChunk(0, 0, tuple(range(8)), True, (0,), SamplingParams(), 0)
    cost = model.costs(MicroBatch(0, (chunk,)))
    assert cost.compute_s == (1.0, 2.0, 3.0) and cost.send_s == (0.5, 0.5, 0.0)
    assert cost.return_s == 0.125
    with pytest.raises(ValueError, match="send_s must be a number >= 0"):
        ScriptedCostModel(2, by_stage, send_s=-1.0)
    with pytest.raises(ValueError, match="handoff_s must be a number >= 0"):
        Overheads(handoff_s=-0.1)


def test_simulated_prefix_caching_is_reported(model_dir: Path, tmp_path: Path, capsys):
    """The simulator drives the real block manager: a workload over one shared prefix hits
    it (summary, report), the simulated prefill work shrinks, and turning caching off
    (``--no-enable-prefix-caching``) reports no lookups."""
    from sarathi_pp.cli import main

    w = tmp_path / "w.yaml"
    w.write_text("num_requests: 8\nshared_prefix: {tokens: 320}\nprompt_tokens: 40\n"
                 "output_tokens: 4\n")  # fmt: skip
    runs = {}
    for flag in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        out = tmp_path / flag
        rc = main(["simulate", "--model", str(model_dir), "--hardware",
                   str(HW_DIR / "a6000.yaml"), "--pp", "2", "--workload", str(w),
                   "--schedulers", "sarathi", "--run-dir", str(out), "--no-progress", flag])  # fmt: skip
        assert rc == 0
        runs[flag] = summary_of(out / "sarathi")
        assert main(["report", str(out / "sarathi")]) == 0
    on = runs["--enable-prefix-caching"]["requests"]
    assert (
        on["prefix_cache"]["hit_tokens"] == 7 * 320
        and on["prefix_cache"]["queried_tokens"] == 8 * 360
    )
    assert "prefix cache: 2240 of 2880 prompt tokens cached" in capsys.readouterr().out
    assert runs["--no-enable-prefix-caching"]["requests"]["prefix_cache"] is None
    assert on["duration_s"] < runs["--no-enable-prefix-caching"]["requests"]["duration_s"]
