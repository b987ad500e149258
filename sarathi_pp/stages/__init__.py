"""A pipeline stage: a slice of the model's layers, its KV cache, the runner that turns a
micro-batch into tensors, and (on the last stage) the sampler."""
