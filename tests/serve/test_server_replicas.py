"""``sarathi-pp serve`` over data-parallel replicas (``data_parallel_size=2`` on Ray):
``/health`` says how many replicas serve (200 while one does, ``degraded`` once one is lost,
503 when none is left); ``/metrics`` has each replica's figures by a ``replica`` label; a
replica lost mid-run costs no request."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
from serving import MODEL, running_server


def _complete(base: str, i: int) -> httpx.Response:
    body = {"model": MODEL, "prompt": [5 + i, 9, 40] * (1 + i), "max_tokens": 12, "temperature": 0}
    return httpx.post(base + "/v1/completions", json={**body, "ignore_eos": True}, timeout=120)


def _metric(text: str, line_start: str) -> float:
    return float(next(ln for ln in text.splitlines() if ln.startswith(line_start)).split()[-1])


def test_health_and_metrics_per_replica_and_a_lost_one(ray_cluster, llama_dir):
    overrides = dict(data_parallel_size=2, max_stage_restarts=0, max_model_len=128)
    with running_server(llama_dir, **overrides) as server:
        base, engine = server.base_url, server.engine_loop.engine
        assert httpx.get(base + "/health").json() == {
            "status": "ok", "replicas": 2, "replicas_live": 2,
        }  # fmt: skip
        with ThreadPoolExecutor(4) as pool:
            first = list(pool.map(lambda i: _complete(base, i), range(4)))
        assert all(r.status_code == 200 for r in first)
        text = httpx.get(base + "/metrics").text
        served = [
            _metric(text, f'sarathi_pp_replica_requests_total{{replica="{i}"}}') for i in (0, 1)
        ]
        assert served[0] > 0 and served[1] > 0 and sum(served) == 4
        assert (
            _metric(text, 'sarathi_pp_replica_stage_busy_seconds_total{replica="1",stage="0"}') > 0
        )
        # each replica's pipeline has its bubble window (the last minute's fractions)
        for i in (0, 1):
            busy = f'sarathi_pp_replica_stage_busy_fraction{{replica="{i}",stage="0"}}'
            assert _metric(text, busy) > 0

        # Replica 1's stage dies (no restart allowed): its requests finish on replica 0.
        ray_cluster.kill(engine.engines[1].executor.actors[0])
        with ThreadPoolExecutor(4) as pool:
            second = list(pool.map(lambda i: _complete(base, i), range(4)))
        assert [r.status_code for r in second] == [200] * 4
        assert [r.json()["choices"][0]["text"] for r in second] == [
            r.json()["choices"][0]["text"] for r in first
        ]
        assert engine.replicas_lost == [1]
        health = httpx.get(base + "/health")
        assert health.status_code == 200
        assert health.json() == {"status": "degraded", "replicas": 2, "replicas_live": 1}
        text = httpx.get(base + "/metrics").text
        assert _metric(text, 'sarathi_pp_replica_up{replica="1"}') == 0
        assert _metric(text, 'sarathi_pp_replica_up{replica="0"}') == 1

        # The last one too: the server says so.
        ray_cluster.kill(engine.engines[0].executor.actors[0])
        assert _complete(base, 0).status_code >= 500
        assert httpx.get(base + "/health").status_code == 503
