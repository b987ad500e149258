"""A pipeline stage: a slice of the model's layers, its KV cache, the runner that turns a
micro-batch into tensors, and (on the last stage) the sampler. Four rooms, laid out as vLLM
lays out the same parts:

- ``worker/``: the stage process (``PipelineStage``: the one stage loop, for a Ray actor and
  a torchrun rank alike) and its compute (``ModelRunner``: metadata, model, sampler,
  penalties), the machine probe, fault injection and the profiler that drives the runner;
- ``model/``: the model and its layers (``llama``, ``decoder_layer``, ``linear``, ``rope``),
  the attention backends and the paged KV cache;
- ``loader/``: weights from a Hugging Face folder (safetensors), the builtin models and the
  GGUF import;
- ``kernels/cpu/``: the CPU kernels as C files, each with its Python wrapper.

Imports go down that list, never up (``worker > model > loader | kernels``; the import
contracts in ``pyproject.toml``).
"""
