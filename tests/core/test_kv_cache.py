"""BlockPool and KVCacheManager: ref counts, LRU eviction, chained hashes, prefix hits."""

from __future__ import annotations

import pytest

from asyncengine.core.kv.block_pool import BlockPool
from asyncengine.core.kv.hashing import hash_block_tokens, update_block_hashes
from asyncengine.core.kv.manager import KVCacheManager
from asyncengine.core.request import Request
from asyncengine.core.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   max_model_len=10_000)


def compute(kv: KVCacheManager, req: Request, num_new: int | None = None) -> None:
    """What the scheduler and a step do: allocate, compute, register the full blocks."""
    blocks, num_cached = [], req.num_computed_tokens
    if num_cached == 0:
        blocks, num_cached = kv.get_computed_blocks(req)
    num_new = req.num_tokens - num_cached if num_new is None else num_new
    assert kv.allocate_slots(req, num_new, blocks)
    req.num_computed_tokens = num_cached + num_new
    assert len(kv.get_block_ids(req.request_id)) == -(-req.num_computed_tokens // kv.block_size)
    kv.cache_full_blocks(req, req.num_computed_tokens)


# -- BlockPool ---------------------------------------------------------------------------------
def test_pool_free_list_is_the_eviction_lru() -> None:
    pool = BlockPool(4)
    b0, b1, b2, b3 = pool.allocate(4)
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    hashes = [bytes([i]) * 32 for i in range(3)]
    for block, h in zip((b0, b1, b2), hashes, strict=True):
        assert pool.cache_block(block, h)
    pool.free([b2, b0])  # b2 is freed first: it goes first
    pool.free([b3])  # no hash: reused before any cached block
    assert pool.num_free_blocks == 3
    assert pool.get_cached_block(hashes[2]) is b2  # freed blocks stay findable

    assert pool.allocate(1) == [b3]
    assert pool.allocate(1) == [b2]
    assert pool.get_cached_block(hashes[2]) is None and b2.block_hash is None  # evicted
    assert pool.get_cached_block(hashes[0]) is b0

    pool.touch([b0])  # a cached free block back into use
    assert b0.ref_cnt == 1 and pool.num_free_blocks == 0
    with pytest.raises(ValueError):
        pool.allocate(1)


def test_pool_ref_counts() -> None:
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.cache_block(b, b"h")
    pool.touch([b])  # a second request shares it
    pool.free([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free([b])
    assert b.ref_cnt == 0 and pool.num_free_blocks == 2
    assert pool.get_cached_block(b"h") is b


def test_pool_keeps_the_first_copy_of_a_hash() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, b"h")
    assert not pool.cache_block(b, b"h")
    assert pool.get_cached_block(b"h") is a and b.block_hash is None


def test_pool_reset_prefix_cache() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"a")
    pool.cache_block(b, b"b")
    pool.free([a])
    assert pool.reset_prefix_cache() is False  # b is in use and stays cached
    assert pool.get_cached_block(b"a") is None and pool.get_cached_block(b"b") is b
    pool.free([b])
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0 and pool.num_free_blocks == 3


# -- hashes ------------------------------------------------------------------------------------
def test_block_hash_is_a_stable_digest() -> None:
    # Pinned: a disk store keyed by these must survive restarts and other processes.
    first = hash_block_tokens(b"", [1, 2, 3, 4])
    assert first.hex() == "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72"
    assert hash_block_tokens(first, [5, 6, 7, 8]).hex() == (
        "4ebfa8a1f3c341517621838c6e1b9aa350307e3f00b3cbd1a07ef740f54396d6")


def test_chained_hashes_across_managers() -> None:
    tokens = list(range(100, 111))  # two full blocks and a partial one
    kv1, kv2 = KVCacheManager(8, BS), KVCacheManager(8, BS)
    r1, r2 = make_request("a", tokens), make_request("b", tokens)
    compute(kv1, r1)
    compute(kv2, r2)
    assert len(r1.block_hashes) == 2 and r1.block_hashes == r2.block_hashes
    # Same second block after a different first block: different hash.
    r3 = make_request("c", [0, 0, 0, 0] + tokens[4:])
    update_block_hashes(r3, BS)
    assert r3.block_hashes[0] != r1.block_hashes[0]
    assert r3.block_hashes[1] != r1.block_hashes[1]


def test_generated_tokens_become_cacheable() -> None:
    kv = KVCacheManager(8, BS)
    req = make_request("a", [1, 2, 3])
    compute(kv, req)
    req.append_output_token(4)  # fills block 0
    compute(kv, req, num_new=1)
    assert len(req.block_hashes) == 1
    other = make_request("b", [1, 2, 3, 4, 9])
    blocks, num_cached = kv.get_computed_blocks(other)
    assert num_cached == 4 and [b.block_id for b in blocks] == kv.get_block_ids("a")[:1]


# -- KVCacheManager ----------------------------------------------------------------------------
def test_prefix_hit_shares_blocks_and_counts_stats() -> None:
    kv = KVCacheManager(16, BS)
    a = make_request("a", list(range(10)))
    compute(kv, a)
    assert kv.prefix_cache_queries == 10 and kv.prefix_cache_hits == 0
    b = make_request("b", list(range(8)) + [50, 51, 52])
    blocks, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 8
    assert kv.allocate_slots(b, b.num_tokens - num_cached, blocks)
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
    assert kv.get_block_ids("b")[2] not in kv.get_block_ids("a")
    assert kv.prefix_cache_queries == 21 and kv.prefix_cache_hits == 8
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == kv.num_total_blocks


def test_last_token_is_never_served_from_cache() -> None:
    kv = KVCacheManager(8, BS)
    tokens = list(range(8))  # exactly two blocks
    compute(kv, make_request("a", tokens))
    blocks, num_cached = kv.get_computed_blocks(make_request("b", tokens))
    assert num_cached == 4 and len(blocks) == 1
    _, num_cached = kv.get_computed_blocks(make_request("c", tokens + [8]))
    assert num_cached == 8


def test_allocate_failure_changes_nothing() -> None:
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(8)))
    compute(kv, a)
    kv.free(a)  # two cached, free blocks
    b = make_request("b", list(range(8)) + list(range(50, 62)))  # needs 5 blocks, 2 of them hits
    blocks, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 8
    before = (kv.num_free_blocks, [blk.ref_cnt for blk in kv.pool.blocks],
              [blk.block_hash for blk in kv.pool.blocks], kv.prefix_cache_queries)
    assert not kv.allocate_slots(b, b.num_tokens - num_cached, blocks)
    after = (kv.num_free_blocks, [blk.ref_cnt for blk in kv.pool.blocks],
             [blk.block_hash for blk in kv.pool.blocks], kv.prefix_cache_queries)
    assert after == before and kv.get_block_ids("b") == []
    # Hits taken from the free list count against it: 2 hits + 2 new blocks fit exactly.
    assert kv.allocate_slots(b, 8, blocks)
    assert kv.num_free_blocks == 0


def test_free_evicts_the_tail_first() -> None:
    kv = KVCacheManager(3, BS)
    a = make_request("a", list(range(12)))
    compute(kv, a)
    ids = kv.get_block_ids("a")
    kv.free(a)
    fresh = make_request("x", [99])
    assert kv.allocate_slots(fresh, 1)
    assert kv.get_block_ids("x") == [ids[2]]  # the tail went first
    _, num_cached = kv.get_computed_blocks(make_request("b", list(range(12))))
    assert num_cached == 8  # the prefix survived


def test_prefix_caching_disabled() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    compute(kv, make_request("a", list(range(10))))
    blocks, num_cached = kv.get_computed_blocks(make_request("b", list(range(10))))
    assert (blocks, num_cached) == ([], 0)
    assert kv.pool.num_cached_blocks == 0 and kv.prefix_cache_queries == 0


def test_reset_prefix_cache() -> None:
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(10)))
    compute(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(make_request("b", list(range(10)))) == ([], 0)
    assert kv.usage == 0.0
