"""Two Ray nodes on one machine (``ray.cluster_utils.Cluster``, one CPU each): PP=2 puts one
stage on each node and DP=2 one replica on each, as Ray itself reports where each stage
actor runs, and both give the tokens of one stage in one process.

The cluster runs in a child process (this file run as a script): the test session's own
Ray (``conftest.ray_cluster``) stays as it is, and the child's ``finally`` stops every
raylet it started; the test then checks that none is left.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

GREEDY_KW = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 40, 3] * k for k in (1, 3, 7, 12)]
BASE = dict(max_model_len=128, chunk_size=16, dtype="float32")


def _processes_of(session: str) -> list[str]:
    """The command lines of processes still running for the Ray session ``session`` (its
    raylets, GCS and workers name its session folder in their arguments); Linux's /proc."""
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            cmd = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if session in cmd:
            out.append(cmd)
    return out


def test_two_nodes_one_stage_or_replica_each(llama_dir: Path, tmp_path: Path):
    out = tmp_path / "multinode.json"
    proc = subprocess.run(
        [sys.executable, __file__, str(llama_dir), str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert len(set(got["nodes"])) == 2
    # PP=2: stage 0 and stage 1 on different nodes; DP=2: each replica on its own node.
    assert len(set(got["pp2_stage_nodes"])) == 2
    assert len(set(got["dp2_replica_nodes"])) == 2
    assert got["pp2"] == got["pp1"] and got["dp2"] == got["pp1"]
    assert got["session"].startswith("session_")
    deadline = time.monotonic() + 15  # killed processes take a moment to go
    while _processes_of(got["session"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes_of(got["session"])  # nothing of the two-node cluster is left


def _node_of(ray, actor) -> str:
    """The node Ray says the actor runs on."""
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def main(model_dir: str, out: str) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from sarathi_pp import LLM, SamplingParams

    greedy = SamplingParams(**GREEDY_KW)
    with LLM(model_dir, **BASE) as pp1:  # the oracle: one stage in this process
        ref = [o.outputs[0].token_ids for o in pp1.generate(PROMPTS, greedy, use_tqdm=False)]
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    result: dict = {"pp1": ref}
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING")
        result["nodes"] = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        result["session"] = ray.get_runtime_context().get_session_name()
        with LLM(model_dir, pipeline_parallel_size=2, **BASE) as pp2:
            actors = pp2.engine.executor.actors
            result["pp2_stage_nodes"] = [_node_of(ray, a) for a in actors]
            outs = pp2.generate(PROMPTS, greedy, use_tqdm=False)
            result["pp2"] = [o.outputs[0].token_ids for o in outs]
        with LLM(model_dir, data_parallel_size=2, **BASE) as dp2:
            engines = dp2.engine.engines
            result["dp2_replica_nodes"] = [_node_of(ray, e.executor.actors[0]) for e in engines]
            outs = dp2.generate(PROMPTS, greedy, use_tqdm=False)
            result["dp2"] = [o.outputs[0].token_ids for o in outs]
    finally:
        ray.shutdown()
        cluster.shutdown()
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
