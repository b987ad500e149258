"""Inter-stage transport: point-to-point send/recv of a micro-batch's hidden states between
neighbouring pipeline stages over ``torch.distributed`` (NCCL on CUDA, gloo on CPU).

Filled by the pipeline-parallel runtime; a single-stage engine needs no transport.
"""
