"""Inter-stage transport: point-to-point send/recv of a micro-batch's hidden states between
neighbouring pipeline stages over ``torch.distributed`` (NCCL on CUDA, gloo on CPU).

- ``dist_setup``: the stages' process group (rank = stage_idx, world size = number of
  stages): ``node_ip``/``rendezvous_listener`` for the rendezvous (rank 0's TCP store
  listens on that address only), ``bind_gloo_to_loopback`` when every stage is on this
  machine, ``pick_backend``, ``init_stage_group``/``destroy_stage_group``.
- ``p2p``: ``StageTransport``, asynchronous sends to stage s+1 and checked, time-limited
  receives from stage s-1 (``StageCommError``, ``StageTimeoutError``, ``StageMismatchError``).
- ``objects``: ``ObjectChannel``, torchrun's control messages between ranks (length header
  checked against ``MAX_MESSAGE_BYTES`` before anything is allocated).
- ``codec``: those messages as plain data (msgpack; no pickle): micro-batches, step
  results, stage events, stage memory, tuples of them; ``CodecError`` says where a
  message is malformed.

A single-stage engine needs no transport. Nothing here imports the scheduler.
"""
