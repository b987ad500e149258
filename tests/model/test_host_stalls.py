"""No per-step host stalls (Note [one upload per micro-batch], ``stages/worker/upload.py``):
a run through the engine with the stage's uploads swapped for a device-tensor stand-in, a
CPU tensor whose values the host cannot read (``.tolist()``, ``.item()``, ``bool()``,
``int()``, ``.cpu()``... raise), proves that nothing in a step waits for the device except
the sampled tokens' copy on the last stage, once per micro-batch that samples; and each
micro-batch is exactly one host-to-device copy. The tokens are those of the plain run."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from sarathi_pp import LLM, SamplingParams
from sarathi_pp.stages.kernels.cpu import fused
from sarathi_pp.stages.worker import last_stage, sampler

# greedy, and sampled with every per-row control the last stage applies on the device
PARAMS = [
    SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=7,
                   ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5,
                   logit_bias={5: 3.0, 200: -2.0}, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=1.0, seed=3, allowed_token_ids=[7, 8, 9, 10],
                   min_tokens=4, ignore_eos=True),
]  # fmt: skip
# Tensor methods that hand device values to the host (each waits for the device on CUDA)
HOST_READS = {
    "tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu",
    "nonzero", "__array__", "equal", "is_nonzero",
}  # fmt: skip


class HostSync(AssertionError):
    pass


class DeviceStandIn(torch.Tensor):
    """A tensor standing for one on a device: its values cannot be read on the host except
    inside ``allowed`` (the token copy), and what is computed from it is one too."""

    allowed_reads = 0  # reads still allowed (set around the sampled tokens' copy)
    reads = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        to_host = name == "to" and any(
            str(a) == "cpu" for a in (*args[1:], *(kwargs or {}).values())
        )
        if name in HOST_READS or to_host:
            if cls.allowed_reads <= 0:
                raise HostSync(f"the host read a device tensor: Tensor.{name}")
            cls.allowed_reads -= 1
            cls.reads += 1
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs or {})


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (3, 40, 21, 9)]


def generate(model_dir, instrument=None) -> list[list[int]]:
    with LLM(
        str(model_dir), max_model_len=128, dtype="float32", chunk_size=32, tile_align=False,
        block_size=16, **{"model.attention_backend": "torch"},
    ) as llm:  # fmt: skip
        if instrument is not None:
            instrument(llm.engine.executor.runner)
        return [o.outputs[0].token_ids for o in llm.generate(prompts(), PARAMS, use_tqdm=False)]


def test_a_run_reads_nothing_from_the_device_but_the_sampled_tokens(llama_dir, monkeypatch):
    # the torch ops and F.linear (what CUDA runs), which see the stand-in; the C kernels
    # of the CPU path read data pointers
    for switch in ("SARATHI_PP_CPU_GEMM", "SARATHI_PP_ONEDNN_LINEAR"):
        monkeypatch.setenv(switch, "0")
    # (the fused kernels' switch is read once per process: cached with the library)
    monkeypatch.setattr(fused, "fused_applies", lambda dtype, device: False)
    reference = generate(llama_dir)
    uploads: list[int] = []
    samples: list[int] = []

    def upload(host: torch.Tensor) -> torch.Tensor:
        uploads.append(host.numel())
        return host.clone().as_subclass(DeviceStandIn)

    def token_copy(tokens):
        # the one read a step may make: the sampled tokens' copy
        samples.append(len(tokens))
        DeviceStandIn.allowed_reads = 1
        try:
            return sampler.tokens_to_host(tokens)
        finally:
            assert DeviceStandIn.allowed_reads == 0, "the token copy did not read the device"
            DeviceStandIn.allowed_reads = 0

    monkeypatch.setattr(last_stage, "tokens_to_host", token_copy)
    executes: list[int] = []

    def instrument(runner):
        runner.upload = upload
        inner = runner.execute

        def execute(microbatch, hidden=None):
            executes.append(len(uploads))
            return inner(microbatch, hidden)

        runner.execute = execute

    got = generate(llama_dir, instrument)
    assert got == reference and len({tuple(t) for t in got}) > 1
    executes.append(len(uploads))
    # exactly one host-to-device copy per micro-batch
    assert all(b - a == 1 for a, b in zip(executes, executes[1:])), executes
    assert len(executes) > 8 and samples and DeviceStandIn.reads == len(samples)


def test_the_stand_in_catches_a_host_read():
    t = torch.arange(4).as_subclass(DeviceStandIn)
    x = (t * 2 + 1)[1:]
    for read in (lambda: x.tolist(), lambda: x[0].item(), lambda: bool(x[0]),
                 lambda: int(x[0]), lambda: x.cpu(), lambda: x.to("cpu")):  # fmt: skip
        with pytest.raises(HostSync):
            read()
    with contextlib.suppress(HostSync):
        DeviceStandIn.allowed_reads = 1
        assert x.tolist() == [3, 5, 7]
    DeviceStandIn.allowed_reads = 0
