"""The CPU memory budgets of the stages against the machine's memory: refused at start with
the figures when they do not fit; the machine's figure read from cgroup and /proc files."""

from __future__ import annotations

import re

import pytest

from sarathi_pp.config import GiB, make_config
from sarathi_pp.model_spec import ModelSpec
from sarathi_pp.placement import Resources, resolve_placement
from sarathi_pp.stages.worker.device import machine_memory_bytes

SPEC = ModelSpec(
    architecture="LlamaForCausalLM", vocab_size=259, hidden_size=64, intermediate_size=128,
    num_layers=8, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
    rope_theta=10000.0,
)  # fmt: skip
MEMINFO = "MemTotal:       24683656 kB\nMemFree:        22583828 kB\nMemAvailable:   23996248 kB\n"


def place(resources: Resources, **config):
    return resolve_placement(make_config(**config), SPEC, resources)


def test_budgets_that_fit_are_accepted():
    machine = Resources(num_cpu_cores=8, memory_bytes=24 * GiB)
    assert place(machine, pipeline_parallel_size=4).memory_bytes == 4 * GiB  # 16 of 24 GiB
    assert place(machine, pipeline_parallel_size=6).memory_bytes == 4 * GiB  # exactly 24 GiB
    assert place(Resources(num_cpu_cores=8), pipeline_parallel_size=8).num_stages == 8  # unknown


def test_budgets_past_the_machine_are_refused_with_the_figures():
    machine = Resources(num_cpu_cores=8, memory_bytes=24 * GiB)
    want = (
        f"cache.cpu_memory_budget={4 * GiB} bytes (4.0 GiB) x 7 stage(s) = {28 * GiB} bytes "
        f"(28.0 GiB) is more than the {24 * GiB} bytes (24.0 GiB) this machine has (its cgroup "
        f"memory limit, or MemTotal without one): set cache.cpu_memory_budget to at most "
        f"{24 * GiB // 7} bytes"
    )
    with pytest.raises(ValueError, match=re.escape(want)):
        place(machine, pipeline_parallel_size=7)
    with pytest.raises(
        ValueError,
        match=r"x 1 stage\(s\) = \d+ bytes \(32\.0 GiB\) is more than .* the Ray cluster has",
    ):
        place(
            Resources(memory_bytes=24 * GiB, description="the Ray cluster"),
            cpu_memory_budget=32 * GiB,
        )


def test_cuda_stages_are_not_held_to_the_cpu_budget():
    h100 = Resources(num_cuda_devices=8, cuda_memory_bytes=80 * GiB, memory_bytes=GiB)
    assert place(h100, pipeline_parallel_size=8).device == "cuda"
    with pytest.raises(ValueError, match="x 8 stage"):
        place(h100, pipeline_parallel_size=8, device="cpu")


@pytest.mark.parametrize(
    "v2, v1, want",
    [
        (None, None, 24683656 * 1024),  # no cgroup: MemTotal
        ("max\n", None, 24683656 * 1024),  # v2 without a limit
        ("8589934592\n", None, 8 * GiB),  # v2 limit
        (None, "4294967296\n", 4 * GiB),  # v1 limit
        (None, "9223372036854771712\n", 24683656 * 1024),  # v1 "unlimited"
        ("2147483648\n", "4294967296\n", 2 * GiB),  # v2 wins
        ("garbage", None, 24683656 * 1024),
    ],
)
def test_machine_memory_from_cgroup_and_meminfo(tmp_path, v2, v1, want):
    paths = {"cgroup_v2": tmp_path / "memory.max", "cgroup_v1": tmp_path / "limit_in_bytes"}
    for key, text in (("cgroup_v2", v2), ("cgroup_v1", v1)):
        if text is not None:
            paths[key].write_text(text)
    (tmp_path / "meminfo").write_text(MEMINFO)
    assert machine_memory_bytes(**paths, meminfo=tmp_path / "meminfo") == want


def test_machine_memory_without_meminfo(tmp_path):
    missing = tmp_path / "missing"
    assert machine_memory_bytes(missing, missing, missing) is None
    (tmp_path / "v1").write_text("4294967296")
    assert machine_memory_bytes(missing, tmp_path / "v1", missing) == 4 * GiB
    (tmp_path / "meminfo").write_text("MemFree: 5 kB\n")  # no MemTotal line
    assert machine_memory_bytes(missing, missing, tmp_path / "meminfo") is None


def test_this_machine_has_room_for_the_tests_largest_pipeline():
    # The suite runs up to 4 stages at the default 4 GiB budget.
    memory = machine_memory_bytes()
    assert memory is None or memory >= 4 * 4 * GiB, f"{memory} bytes: PP=4 tests would be refused"


def test_a_device_without_the_memory_asked_is_named_with_the_figures():
    from sarathi_pp.stages.worker.device import free_memory_error

    what = "stage 1's KV cache (100 blocks of 16 tokens)"
    assert free_memory_error(10 * GiB, 80 * GiB, 10 * GiB, what, "cuda:1") is None
    error = free_memory_error(3 * GiB, 80 * GiB, 60 * GiB, what, "cuda:1")
    assert error is not None
    assert error.startswith(
        "stage 1's KV cache (100 blocks of 16 tokens) needs 60.00 GiB but cuda:1 has 3.00 GiB "
        "free of 80.00 GiB: another process holds memory on the device"
    )
    assert "gpu_memory_utilization" in error
