"""The router of data-parallel replicas: which copy of the pipeline takes a request.

One policy for the runtime (``engine/replicas.py``: ``parallel.data_parallel_size`` engines)
and the simulator (``sim/cluster.py``), so what a simulated deployment routes is what the
runtime routes. Pure Python, no torch: it sees each replica's load and the request's
prompt token ids, nothing else.

Policies (``ROUTINGS``):

- ``round_robin``: request k to replica k mod R (among the replicas still live);
- ``least_loaded``: the replica with the fewest pending tokens (``pending_tokens``: the
  prompt tokens not yet issued plus the output tokens still to come, over its unfinished
  requests), the lowest index on a tie. With prefix affinity on (the engine's
  ``cache.enable_prefix_caching``) a request goes where a prefix of its prompt went before,
  by Note [prefix affinity].

Note [prefix affinity]: the router remembers, per replica, the hashes of the block-aligned
prefixes of the prompts it sent there (a hash chained block by block, as the block manager
names cached blocks), in one LRU of at most ``max_prefixes`` entries. A new request's cost
on replica i is ``pending_tokens[i] - cached_tokens[i]``, where ``cached_tokens[i]`` is the
length of the longest block-aligned prefix of its prompt sent to i: the prefill a cache hit
saves is work the replica does not have to do. The request goes to the replica of least
cost (then the longest match, then the lowest index). So the replica holding the prefix
wins unless its pending tokens exceed the least loaded replica's by more than the prefill
the hit saves: a replica far busier than the others does not take every request of a
popular prefix. The router's memory is a guess about the replica's cache (it may have
evicted the blocks since): a wrong guess costs only the prefill that would have run anyway.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from sarathi_pp.sequence import Sequence as Seq

ROUTINGS = ("round_robin", "least_loaded")
# The LRU's bound (prefix hashes remembered, over all replicas): a hash and a replica set
# each, so a few MB at most.
DEFAULT_MAX_PREFIXES = 65536


def pending_tokens(seqs: Iterable[Seq], max_model_len: int) -> int:
    """Tokens still to compute for ``seqs`` (a replica's unfinished sequences): each one's
    tokens not yet issued (its prompt, or all of it again after a preemption) plus the
    output tokens it may still generate (``max_tokens``, or up to ``max_model_len``)."""
    total = 0
    for s in seqs:
        limit = s.params.max_tokens
        if limit is None:
            limit = max_model_len - s.num_prompt_tokens
        total += s.num_pending_tokens + max(0, limit - s.num_output_tokens)
    return total


def prefix_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hash of each full block-aligned prefix of ``token_ids`` (shortest first)."""
    out: list[int] = []
    h = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hash((h, tuple(token_ids[start : start + block_size])))
        out.append(h)
    return out


class Router:
    """Picks a replica per request (``route``); ``remove`` takes a replica out for good."""

    def __init__(
        self,
        num_replicas: int,
        routing: str = "least_loaded",
        block_size: int | None = None,
        max_prefixes: int = DEFAULT_MAX_PREFIXES,
    ) -> None:
        """``block_size``: the prefix-affinity granularity (``None``: no affinity)."""
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}")
        if routing not in ROUTINGS:
            raise ValueError(f"unknown routing {routing!r}; valid: {', '.join(ROUTINGS)}")
        if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
            raise ValueError(f"block_size must be an integer >= 1 or None, got {block_size!r}")
        if not isinstance(max_prefixes, int) or max_prefixes < 1:
            raise ValueError(f"max_prefixes must be an integer >= 1, got {max_prefixes!r}")
        self.routing = routing
        self.live = list(range(num_replicas))
        self.block_size = block_size
        self.max_prefixes = max_prefixes
        self._prefixes: OrderedDict[int, set[int]] = OrderedDict()  # hash -> replicas, LRU
        self._count = 0  # requests routed (round_robin)

    @property
    def affinity(self) -> bool:
        return self.block_size is not None and self.routing == "least_loaded"

    def remove(self, replica_idx: int) -> None:
        """Route nothing more to ``replica_idx`` (it is gone); forget its prefixes."""
        if replica_idx in self.live:
            self.live.remove(replica_idx)
        for replicas in self._prefixes.values():
            replicas.discard(replica_idx)

    def route(self, token_ids: Sequence[int], loads: Sequence[int]) -> int:
        """The replica for a request of prompt ``token_ids``, given every replica's pending
        tokens ``loads`` (indexed by replica); remembers the choice for affinity."""
        if not self.live:
            raise RuntimeError("no replica is left to route to")
        if self.routing == "round_robin":
            choice = self.live[self._count % len(self.live)]
        else:
            hashes = self._hashes(token_ids)
            cached = self._cached_tokens(hashes)
            choice = min(self.live, key=lambda i: (loads[i] - cached[i], -cached[i], i))
            self._remember(hashes, choice)
        self._count += 1
        return choice

    def cached_tokens(self, token_ids: Sequence[int]) -> dict[int, int]:
        """Per live replica: the longest block-aligned prefix of ``token_ids`` sent there
        (tokens), as the router remembers it."""
        return self._cached_tokens(self._hashes(token_ids))

    def _hashes(self, token_ids: Sequence[int]) -> list[int]:
        if self.block_size is None or self.routing != "least_loaded":  # no affinity
            return []
        return prefix_hashes(token_ids, self.block_size)

    def _cached_tokens(self, hashes: list[int]) -> dict[int, int]:
        cached = dict.fromkeys(self.live, 0)
        assert self.block_size is not None or not hashes
        for n, h in enumerate(hashes, start=1):
            replicas = self._prefixes.get(h)
            if not replicas:
                break  # chained: no longer prefix can match where this one does not
            for i in replicas:
                if i in cached:
                    cached[i] = n * (self.block_size or 0)
        return cached

    def _remember(self, hashes: list[int], replica_idx: int) -> None:
        for h in reversed(hashes):  # the shortest used last: evicted last (a longer one
            # is of no use without it: the chain)
            self._prefixes.setdefault(h, set()).add(replica_idx)
            self._prefixes.move_to_end(h)
        while len(self._prefixes) > self.max_prefixes:
            self._prefixes.popitem(last=False)
