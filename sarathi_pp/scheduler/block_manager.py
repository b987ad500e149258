"""Paged KV cache bookkeeping: which physical blocks belong to which sequence (no tensors),
and the prefix cache: full blocks found again by their content.

The tensors live on each stage (``sarathi_pp/stages/model/kv_cache.py``); all stages share the
block ids decided here, so a stage only needs the block table carried by the micro-batch.
With pipeline parallelism every stage's cache therefore holds the same blocks, and a block
hit here is valid on every stage.

Prefix caching (vLLM V1's automatic prefix caching; ``cache.enable_prefix_caching``):

* A full block is named by a hash chained over its parent block's hash and its own token
  ids (``block_hashes``), so the same tokens at another position, or after other tokens, are
  another block. Nothing else changes a block's K/V here (no LoRA, no multi-modal input);
  a request's ``cache_salt`` starts its chain, so it shares blocks only with its salt.
* Blocks are reference-counted: a block hit by several sequences is shared, read-only (a
  sequence only ever writes the blocks past its hit, which it owns alone).
* A block becomes hittable (``publish``) only once the micro-batch that wrote its last token
  has completed, which means on every stage (each stage runs the micro-batches in issue
  order and hands on a micro-batch only after writing its K/V). From the start of the
  prefill that will write it until then it is *pending* (``expect``): a lookup that meets
  it says so, and the scheduler holds that request back until it is published
  (``Lookup.wait``) instead of computing the same tokens again. A block whose micro-batch
  is lost or fails is freed without ever being published.
* A freed block keeps its hash and stays findable until it is needed for new tokens: free
  blocks without a hash are used first, then cached ones, least recently used first.
* ``reset_prefix_cache`` forgets every hash (the stages' caches were replaced).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from sarathi_pp.sequence import Sequence

BlockHash = bytes


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)  # ceil


def hash_block(parent: BlockHash | None, token_ids: list[int]) -> BlockHash:
    """The name of a full block: a 128-bit BLAKE2b digest over the parent block's name and
    the block's token ids (collisions are as unlikely as vLLM's sha256 option's, and
    ``hash()`` would be 64 bits)."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def block_hashes(seq: Sequence, num_blocks: int, block_size: int) -> list[BlockHash]:
    """The chained names of ``seq``'s full blocks, at least its first ``num_blocks`` (as
    many as its tokens fill, if fewer): computed once per block and kept on the sequence
    (its tokens never change, preemption included), so the list may be longer."""
    hashes = seq.block_hashes
    num_blocks = min(num_blocks, len(seq.token_ids) // block_size)
    while len(hashes) < num_blocks:
        i = len(hashes)
        tokens = seq.token_ids[i * block_size : (i + 1) * block_size]
        if hashes:
            parent: BlockHash | None = hashes[-1]
        else:  # a salted request's chain starts from its salt (vLLM's ``cache_salt``)
            parent = None if seq.cache_salt is None else b"salt:" + seq.cache_salt.encode()
        hashes.append(hash_block(parent, tokens))
    return hashes


@dataclass(frozen=True)
class Lookup:
    """A prefix-cache lookup for a prefill about to start: the cached blocks it may take
    (published, in order from the first block), or ``wait``: the block after them is being
    written by a micro-batch in flight and will be published when it completes."""

    blocks: tuple[int, ...] = ()
    wait: bool = False


@dataclass
class PrefixCacheStats:
    """Lookups since the engine started, in tokens (vLLM's ``prefix_cache_queries`` and
    ``prefix_cache_hits``): every prompt token looked up, and those found cached."""

    queries: int = 0
    hits: int = 0
    requests: int = 0  # lookups (one per prefill start, recomputes included)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Free blocks without a hash. Pop from the end: recently freed blocks are reused
        # first (warm in cache).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._ref = [0] * num_blocks
        # Free blocks with a hash, least recently used first (evicted from the front).
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockHash, int] = {}  # published: hash -> block
        self._block_hash: dict[int, BlockHash] = {}  # published: block -> hash
        self._pending: dict[BlockHash, int] = {}  # written by a micro-batch in flight
        self._block_pending: dict[int, BlockHash] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds: never written or freed, cached or not."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by content (held or free)."""
        return len(self._cached)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def num_missing_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` still needs so that its first ``num_tokens`` tokens have slots."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_missing_blocks(seq, num_tokens) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give ``seq`` slots for its first ``num_tokens`` tokens."""
        missing = self.num_missing_blocks(seq, num_tokens)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {missing}, {self.num_free_blocks} free")
        for _ in range(missing):
            seq.block_table.append(self._take_free())

    def _take_free(self) -> int:
        if self._free:
            block = self._free.pop()
        else:  # evict the least recently used cached block
            block, _ = self._evictable.popitem(last=False)
            del self._cached[self._block_hash.pop(block)]
        self._ref[block] = 1
        return block

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s hold on its blocks. Its last blocks are freed first, so that they
        are evicted before the first ones (which more prompts share)."""
        for block in reversed(seq.block_table):
            self._ref[block] -= 1
            assert self._ref[block] >= 0, block
            if self._ref[block] > 0:
                continue
            if (h := self._block_pending.pop(block, None)) is not None:
                del self._pending[h]  # never written in full: never published
            if block in self._block_hash:
                self._evictable[block] = None
            else:
                self._free.append(block)
        seq.block_table = []
        seq.num_published_blocks = 0

    # --- the prefix cache ----------------------------------------------------------------
    def lookup(self, seq: Sequence) -> Lookup:
        """The cached blocks ``seq``'s prefill may start from: the longest run of published
        blocks from its first token, leaving at least one token to compute (its logits
        give the next token, as in vLLM). ``wait`` when the next block is pending."""
        if not self.enable_prefix_caching:
            return Lookup()
        num = (seq.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        for h in block_hashes(seq, num, self.block_size)[:num]:
            block = self._cached.get(h)
            if block is None:
                return Lookup(tuple(blocks), wait=h in self._pending)
            blocks.append(block)
        return Lookup(tuple(blocks))

    def num_new_blocks(self, hit: Lookup) -> int:
        """Free blocks that taking ``hit`` uses up (those no sequence holds)."""
        return sum(1 for b in hit.blocks if self._ref[b] == 0)

    def take_hit(self, seq: Sequence, hit: Lookup) -> int:
        """Start ``seq`` (no blocks yet) on the blocks of ``hit``; returns the tokens they
        hold, and counts the lookup."""
        assert not seq.block_table, seq
        for block in hit.blocks:
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1
            seq.block_table.append(block)
        seq.num_published_blocks = len(hit.blocks)
        hit_tokens = len(hit.blocks) * self.block_size
        self.stats.queries += seq.num_tokens
        self.stats.hits += hit_tokens
        self.stats.requests += 1
        return hit_tokens

    def expect(self, seq: Sequence) -> None:
        """``seq`` (just started) will write its blocks past its hit: those its known tokens
        fill are pending until published, so a lookup meeting them waits for them instead
        of computing them again (a request that starts in the same micro-batch included)."""
        if not self.enable_prefix_caching:
            return
        num = len(seq.token_ids) // self.block_size
        hashes = block_hashes(seq, num, self.block_size)
        for i in range(seq.num_published_blocks, num):
            h, block = hashes[i], seq.block_table[i]
            if h not in self._cached and h not in self._pending:
                self._pending[h] = block
                self._block_pending[block] = h

    def publish(self, seq: Sequence, end: int) -> None:
        """``seq``'s tokens up to ``end`` are written on every stage: its full blocks among
        them become hittable (a block whose content another block holds already is not:
        the first one written stays the one found)."""
        num = min(end, len(seq.token_ids)) // self.block_size
        if num <= seq.num_published_blocks or not self.enable_prefix_caching:
            return  # no block filled since (most decodes)
        hashes = block_hashes(seq, num, self.block_size)
        for i in range(seq.num_published_blocks, num):
            h, block = hashes[i], seq.block_table[i]
            if self._block_pending.get(block) == h:
                del self._block_pending[block]
                del self._pending[h]
            if h not in self._cached and block not in self._block_hash:
                self._cached[h] = block
                self._block_hash[block] = h
        seq.num_published_blocks = max(seq.num_published_blocks, num)

    def reset_prefix_cache(self) -> None:
        """Forget every hash (the stages' caches were replaced: nothing cached exists)."""
        assert not self._pending, "micro-batches in flight"
        self._free.extend(reversed(self._evictable))
        self._evictable.clear()
        self._cached.clear()
        self._block_hash.clear()

    def check(self) -> None:
        """Invariants (tests): every block free or held, never both; cached maps agree."""
        free = set(self._free) | set(self._evictable)
        assert len(free) == len(self._free) + len(self._evictable), "a block freed twice"
        for b in range(self.num_blocks):
            assert (b in free) == (self._ref[b] == 0), (b, self._ref[b])
            assert self._ref[b] >= 0
        assert all(b in self._block_hash for b in self._evictable)
        assert all(self._cached[h] == b for b, h in self._block_hash.items())
        assert all(self._pending[h] == b for b, h in self._block_pending.items())
        assert len(self._cached) == len(self._block_hash)
