"""Inter-stage transport: point-to-point send/recv of a micro-batch's hidden states between
neighbouring pipeline stages over ``torch.distributed`` (NCCL on CUDA, gloo on CPU).

- ``dist_setup``: the stages' process group (rank = stage_idx, world size = number of
  stages): ``node_ip``/``free_port`` for the rendezvous, ``pick_backend``,
  ``init_stage_group``/``destroy_stage_group``.
- ``p2p``: ``StageTransport``, asynchronous sends to stage s+1 and checked, time-limited
  receives from stage s-1 (``StageCommError``, ``StageTimeoutError``, ``StageMismatchError``).

A single-stage engine needs no transport. Nothing here imports the scheduler.
"""
