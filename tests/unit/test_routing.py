"""The replicas' router (``sarathi_pp/routing.py``): least pending tokens, prefix affinity
(Note [prefix affinity]), round robin, a replica taken out; the config's
``data_parallel_size`` checks."""

from __future__ import annotations

import pytest

from sarathi_pp.config import make_config
from sarathi_pp.routing import Router, pending_tokens, prefix_hashes
from sarathi_pp.sampling_params import SamplingParams
from sarathi_pp.sequence import Sequence

BLOCK = 4


def test_least_loaded_by_pending_tokens_lowest_index_on_tie():
    r = Router(3, "least_loaded")
    assert r.route([1, 2, 3], [50, 10, 30]) == 1
    assert r.route([1, 2, 3], [10, 50, 10]) == 0
    assert r.route([1, 2, 3], [20, 10, 10]) == 1


def test_prefix_affinity_prefers_the_longest_match_unless_far_busier():
    r = Router(3, "least_loaded", block_size=BLOCK)
    shared = list(range(10, 10 + 3 * BLOCK))  # three full blocks
    assert r.route(shared + [1], [0, 0, 0]) == 0
    # replica 0 holds 12 cached tokens: it wins while its extra load is under 12 ...
    assert r.cached_tokens(shared + [2]) == {0: 12, 1: 0, 2: 0}
    assert r.route(shared + [2], [11, 0, 5]) == 0
    # ... and loses once it is busier than the least loaded by more than the saving.
    assert r.route(shared + [3], [13, 0, 5]) == 1
    # Now both 0 and 1 hold it: the less loaded of the two.
    assert r.route(shared + [4], [13, 2, 0]) == 1
    # A prompt sharing only the first block matches 4 tokens.
    assert r.cached_tokens(shared[:BLOCK] + [99] * 8)[0] == BLOCK


def test_no_affinity_without_block_size_and_under_round_robin():
    plain = Router(2, "least_loaded")
    plain.route([1] * 8, [0, 0])
    assert plain.cached_tokens([1] * 8) == {0: 0, 1: 0}
    rr = Router(3, "round_robin", block_size=BLOCK)
    assert [rr.route([1] * 8, [0, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]


def test_prefix_memory_is_a_bounded_lru():
    r = Router(2, "least_loaded", block_size=BLOCK, max_prefixes=4)
    a, b = [1] * (2 * BLOCK), [2] * (3 * BLOCK)
    r.route(a, [0, 0])  # 2 hashes on 0
    r.route(b, [5, 0])  # 3 hashes on 1: a's longest prefix is evicted first
    assert len(r._prefixes) == 4
    assert r.cached_tokens(a) == {0: BLOCK, 1: 0}
    assert r.cached_tokens(b) == {0: 0, 1: 3 * BLOCK}


def test_a_removed_replica_is_never_chosen():
    r = Router(3, "least_loaded", block_size=BLOCK)
    p = [7] * (2 * BLOCK)
    assert r.route(p, [0, 5, 5]) == 0
    r.remove(0)
    assert r.live == [1, 2] and r.route(p, [0, 5, 4]) == 2
    rr = Router(3, "round_robin")
    rr.remove(1)
    assert [rr.route([1], [0, 0, 0]) for _ in range(3)] == [0, 2, 0]
    rr.remove(0), rr.remove(2)
    with pytest.raises(RuntimeError, match="no replica is left"):
        rr.route([1], [0, 0, 0])


def test_router_refuses_bad_arguments_by_name():
    with pytest.raises(ValueError, match="routing 'random'"):
        Router(2, "random")
    with pytest.raises(ValueError, match="num_replicas must be an integer >= 1, got 0"):
        Router(0)
    with pytest.raises(ValueError, match="block_size"):
        Router(2, block_size=0)


def test_pending_tokens_counts_unissued_and_the_outputs_to_come():
    s = Sequence(0, "a", [1] * 10, SamplingParams(max_tokens=5), 0.0)
    assert pending_tokens([s], max_model_len=100) == 15
    s.num_scheduled_tokens = 10
    s.append_token(3, 1.0)
    assert pending_tokens([s], max_model_len=100) == 1 + 4  # its new token, 4 more to come
    t = Sequence(1, "b", [1] * 10, SamplingParams(max_tokens=None), 0.0)
    assert pending_tokens([t], max_model_len=100) == 10 + 90


def test_prefix_hashes_are_chained_full_blocks():
    h = prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BLOCK)
    assert len(h) == 2
    assert prefix_hashes([9, 2, 3, 4, 5, 6, 7, 8], BLOCK)[1] != h[1]  # chained: block 0 differs


def test_data_parallel_size_in_the_config():
    assert make_config(data_parallel_size=2).parallel.executor_name == "ray"
    assert make_config().parallel.executor_name == "uniproc"
    assert (
        make_config(data_parallel_size=2, executor="ray_compiled").parallel.data_parallel_size == 2
    )
    with pytest.raises(ValueError, match=r"data_parallel_size=2 needs a Ray executor.*torchrun"):
        make_config(data_parallel_size=2, executor="torchrun")
    with pytest.raises(ValueError, match="not executor='uniproc'"):
        make_config(data_parallel_size=2, executor="uniproc")
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1, got 0"):
        make_config(data_parallel_size=0)
