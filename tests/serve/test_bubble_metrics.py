"""``/metrics``' per-stage bubbles at PP=2 (two Ray stage actors) equal ``sarathi-pp report
RUN_DIR --interval`` over the interval ``/metrics`` names, on the run dir the server wrote."""

from __future__ import annotations

import re
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from serving import running_server  # noqa: E402

from sarathi_pp.cli import main  # noqa: E402
from sarathi_pp.report.bubbles import BUBBLE_CLASSES  # noqa: E402
from sarathi_pp.report.interval import interval_bubbles  # noqa: E402
from sarathi_pp.report.log import load_log  # noqa: E402

SAMPLE = re.compile(r"^(sarathi_pp_\w+)\{([^}]*)\} (\S+)$", re.M)


def _gauges(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for name, labels, value in SAMPLE.findall(text):
        pairs = tuple(sorted(tuple(p.split("=", 1)) for p in labels.split(",")))
        out[name, tuple((k, v.strip('"')) for k, v in pairs)] = float(value)
    return out


def _complete(base_url: str, prompt: str, results: list) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0}
    r = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
    results.append((r.status_code, r.text))


def test_metrics_bubbles_equal_the_report_over_the_same_interval(
    ray_cluster, llama_dir, tmp_path, capsys
):
    run_dir = tmp_path / "served"
    with running_server(
        llama_dir, pipeline_parallel_size=2, run_dir=str(run_dir), max_model_len=256,
        chunk_size=32, tile_align=False,
    ) as server:  # fmt: skip
        prompts = [f"p{i} " * (3 + 4 * i) for i in range(6)]  # 9 to 69 bytes
        results: list = []
        threads = [
            threading.Thread(target=_complete, args=(server.base_url, p, results)) for p in prompts
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [code for code, _ in results] == [200] * 6, results
        time.sleep(0.2)  # idle a moment: the window ends with no_work
        gauges = _gauges(httpx.get(server.base_url + "/metrics").text)
    start = gauges["sarathi_pp_bubble_interval_seconds", (("edge", "start"),)]
    end = gauges["sarathi_pp_bubble_interval_seconds", (("edge", "end"),)]
    assert end - start == pytest.approx(60.0)
    expected = interval_bubbles(load_log(run_dir / "events.jsonl"), start, end)
    for s in (0, 1):
        busy = gauges["sarathi_pp_stage_busy_fraction", (("stage", str(s)),)]
        assert busy == pytest.approx(expected.fractions[s]["busy"], abs=1e-9)
        assert 0 < busy < 1
        for c in BUBBLE_CLASSES:
            got = gauges["sarathi_pp_stage_bubble_fraction", (("class", c), ("stage", str(s)))]
            assert got == pytest.approx(expected.fractions[s][c], abs=1e-9), (s, c)
    assert expected.fractions[0]["no_work"] > 0.5  # most of the minute had no request
    # The command line prints the same figures.
    assert main(["report", str(run_dir), f"--interval={start!r}:{end!r}"]) == 0
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("0 "))
    assert f"{100 * expected.bubble_fraction(0):.2f}%" in row
