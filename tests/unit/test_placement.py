"""The placement rule on hand-made resources: every ``auto`` resolved one way, for every
executor, the planner, the profiler and the benchmark's peer (pure Python, no device)."""

from __future__ import annotations

import pytest

from sarathi_pp.config import GiB, make_config
from sarathi_pp.model_spec import ModelSpec
from sarathi_pp.placement import Resources, partition_layers, resolve_placement

SPEC = ModelSpec(
    architecture="LlamaForCausalLM", vocab_size=259, hidden_size=1024, intermediate_size=2816,
    num_layers=8, num_heads=16, num_kv_heads=4, head_dim=64, rms_norm_eps=1e-5,
    rope_theta=10000.0,
)  # fmt: skip
CPU = Resources(num_cpu_cores=8)
H100 = Resources(num_cpu_cores=8, num_cuda_devices=2, cuda_memory_bytes=80 * GiB, cuda_bf16=True)


def place(resources: Resources, **config):
    return resolve_placement(make_config(**config), SPEC, resources)


def test_cpu_defaults():
    p = place(CPU)
    assert (p.device, p.dtype, p.block_size, p.num_stages) == ("cpu", "float32", 16, 1)
    assert (p.memory_bytes, p.memory_source) == (4 * GiB, "cpu_memory_budget")
    assert p.num_threads is None and "torch's default" in p.threads_source  # one stage
    assert p.layer_ranges == ((0, 8),)


def test_cpu_stages_share_the_cores():
    p = place(CPU, pipeline_parallel_size=3)
    assert p.num_threads == 2 and p.threads_source == "usable cores 8 // 3 stages"
    assert list(p.layer_ranges) == partition_layers(SPEC, 3)
    assert place(Resources(num_cpu_cores=1), pipeline_parallel_size=2).num_threads == 1
    set_ = place(CPU, pipeline_parallel_size=2, num_threads_per_stage=3)
    assert (set_.num_threads, set_.threads_source) == (3, "parallel.num_threads_per_stage")


def test_cuda_when_every_stage_gets_a_device():
    p = place(H100, pipeline_parallel_size=2, gpu_memory_utilization=0.5)
    assert (p.device, p.dtype, p.num_threads) == ("cuda", "bfloat16", None)
    assert p.memory_bytes == 40 * GiB and "gpu_memory_utilization 0.5" in p.memory_source
    assert place(H100, pipeline_parallel_size=3).device == "cpu"  # 2 devices, 3 stages
    no_bf16 = Resources(num_cuda_devices=1, cuda_memory_bytes=GiB, cuda_bf16=False)
    assert place(no_bf16).dtype == "float32"
    assert place(H100, dtype="float16").dtype == "float16"


def test_block_size_follows_flash_attn_unless_set():
    flash = Resources(num_cuda_devices=1, cuda_memory_bytes=GiB, cuda_bf16=True, flash_attn=True)
    assert place(flash).block_size == 256
    assert place(flash, device="cpu").block_size == 16  # flash-attn runs on CUDA only
    assert place(flash, block_size=32).block_size == 32
    assert place(flash, dtype="float32").block_size == 16  # flash-attn takes fp16/bf16 only
    assert place(flash, **{"model.attention_backend": "flex_paged"}).block_size == 16
    assert place(flash, **{"model.attention_backend": "flash_attn"}).block_size == 256
    p = place(flash, **{"model.attention_backend": "torch", "model.strict_attention_backend": True})
    assert (p.attention_backend, p.strict_attention_backend) == ("torch", True)


def test_cuda_asked_for_and_missing_names_the_counts():
    with pytest.raises(ValueError, match=r"needs 2 CUDA device\(s\), one per stage; the Ray "
                       r"cluster has 1"):  # fmt: skip
        place(Resources(num_cuda_devices=1, description="the Ray cluster"), device="cuda",
              pipeline_parallel_size=2)  # fmt: skip
    with pytest.raises(ValueError, match="CUDA device memory of this machine is unknown"):
        place(Resources(num_cuda_devices=1), device="cuda")


def test_more_stages_than_layers():
    with pytest.raises(ValueError, match="8 decoder layers over 9 stages"):
        place(CPU, pipeline_parallel_size=9)


def test_a_replica_sees_its_share_of_the_ray_clusters_gpus():
    """``data_parallel_size`` replicas each need their own GPUs: one GPU for two replicas of
    one stage is none each (``auto`` then places them on CPU, ``cuda`` is refused by the
    placement rule), not one each with the second waiting for the first's."""
    from types import SimpleNamespace

    from sarathi_pp.executors.ray import _cluster_resources

    fake_ray = SimpleNamespace(cluster_resources=lambda: {"GPU": 3, "CPU": 8})
    one = _cluster_resources(fake_ray, "cpu", 1, 1.0)
    two = _cluster_resources(fake_ray, "cpu", 1, 1.0, num_replicas=2)
    four = _cluster_resources(fake_ray, "cpu", 1, 1.0, num_replicas=4)
    assert (one.num_cuda_devices, two.num_cuda_devices, four.num_cuda_devices) == (3, 1, 0)
    assert "2 replicas" in two.description
