"""The profiling forward (Note [profiling forward], ``stages/worker/memory_probe.py``) with a
fake memory probe: the micro-batch it runs (the largest the policy issues, the last stage
sampling ``max_num_seqs`` rows), what it returns (the peak above the start plus the other
micro-batches in flight), the temporary KV cache gone after, and the executor's M_A taken
from it. Executors other than uniproc refuse ``activation_memory: profile``."""

from __future__ import annotations

import pytest

from sarathi_pp import LLM, load_config
from sarathi_pp.checkpoint import Checkpoint
from sarathi_pp.stages.worker.memory_probe import profiling_microbatch


class FakeProbe:
    """Counts what the stage asks; the "peak" is what it is told."""

    def __init__(self, allocated: int, peak: int) -> None:
        self.figures = (allocated, peak)
        self.resets = 0

    def reset_peak(self) -> None:
        self.resets += 1

    def allocated(self) -> int:
        return self.figures[0]

    def peak(self) -> int:
        return self.figures[1]


def test_the_profiling_microbatch_spreads_rows_over_sampling_sequences():
    mb, blocks = profiling_microbatch(rows=70, num_seqs=4, max_model_len=64, block_size=16)
    assert [c.num_tokens for c in mb.chunks] == [18, 18, 17, 17]
    assert mb.num_prefill_tokens == 70 and all(c.do_sample for c in mb.chunks)
    assert blocks == 8 and sorted(b for c in mb.chunks for b in c.block_table) == list(range(8))
    # sequences no longer than max_model_len: more of them where needed
    mb, _ = profiling_microbatch(rows=100, num_seqs=1, max_model_len=40, block_size=16)
    assert [c.num_tokens for c in mb.chunks] == [34, 33, 33]


def test_the_executor_takes_m_a_from_the_profiling_forward(llama_dir, monkeypatch):
    with LLM(
        str(llama_dir), max_model_len=128, dtype="float32", chunk_size=48, max_num_seqs=6,
        num_microbatches_in_flight=2,
    ) as llm:  # fmt: skip
        ex = llm.engine.executor
        runner = ex.runner
        real_kv = runner.kv
        runner.kv = None  # as before the cache: the profiling forward makes its own
        seen = []
        inner = runner.execute

        def execute(microbatch, hidden=None):
            seen.append((microbatch.num_tokens, len(microbatch.sampled_seq_ids)))
            assert runner.kv is not None and runner.kv.num_blocks >= 6  # the temporary cache
            return inner(microbatch, hidden)

        monkeypatch.setattr(runner, "execute", execute)
        probe = FakeProbe(allocated=1_000, peak=51_000)
        memory = ex.profiled([llm.engine.stage_memory[0]], probe)
        hidden = llm.engine.checkpoint.spec.hidden_size
        assert seen == [(48, 6)]  # chunk_size rows, max_num_seqs of them sampled
        assert probe.resets == 1 and runner.kv is None  # the temporary cache is dropped
        # the peak above the start + one more micro-batch in flight waiting (48 x hidden x 4 B)
        assert memory[0].activation_bytes == 50_000 + 48 * hidden * 4
        assert memory[0].param_bytes == llm.engine.stage_memory[0].param_bytes
        runner.kv = real_kv


@pytest.mark.parametrize("executor", ["ray", "torchrun"])
def test_other_executors_refuse_profile(executor, llama_dir):
    from sarathi_pp.executors.ray import RayExecutor
    from sarathi_pp.executors.torchrun import TorchrunExecutor

    config = load_config(
        None, model=str(llama_dir), pipeline_parallel_size=2,
        **{"cache.activation_memory": "profile"},
    )  # fmt: skip
    cls = RayExecutor if executor == "ray" else TorchrunExecutor
    match = f"runs on the single-process executor only.*not on {executor}"
    with pytest.raises(ValueError, match=match):
        cls(config, Checkpoint.__new__(Checkpoint))
