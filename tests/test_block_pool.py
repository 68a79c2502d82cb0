"""BlockPool: ref counts, free / evictable transitions, LRU order, the prefix index."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from paxkv.cache.block_pool import NULL_BLOCK, BlockPool


def holders_of(pool: BlockPool, held: list[int]) -> list[int]:
    counts = [0] * pool.num_blocks
    for b in held:
        counts[b] += 1
    return counts


def test_constructor_and_null_block():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, reserve_null_block=True)
    assert BlockPool(0).num_available == 0  # an empty host pool is allowed
    pool = BlockPool(4, reserve_null_block=True)
    assert pool.num_usable == 3 and pool.num_available == 3 and pool.num_used == 0
    assert pool.get_new_blocks(3) == [1, 2, 3]  # never the null block
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.get_new_block()
    with pytest.raises(ValueError):
        pool.free([NULL_BLOCK])
    with pytest.raises(ValueError):
        pool.touch([NULL_BLOCK])
    assert BlockPool(3).get_new_blocks(3) == [0, 1, 2]


def test_ref_counts_and_double_free():
    pool = BlockPool(4)
    b = pool.get_new_block()
    assert pool.ref_count(b) == 1 and pool.num_used == 1
    pool.touch([b, b])
    assert pool.ref_count(b) == 3
    pool.free([b, b])
    assert pool.ref_count(b) == 1 and pool.num_free == 3  # still held
    pool.free([b])
    assert pool.ref_count(b) == 0 and pool.num_free == 4 and pool.num_used == 0
    with pytest.raises(ValueError, match="double free"):
        pool.free([b])
    with pytest.raises(ValueError, match="free"):
        pool.touch([b])  # a free block holds nothing to share
    pool.check_invariants(holders_of(pool, []))


def test_free_list_is_a_stack():
    pool = BlockPool(5, reserve_null_block=True)
    a, b, c = pool.get_new_blocks(3)
    pool.free([b, a])
    assert pool.get_new_block() == a  # released last, handed out first
    assert pool.get_new_block() == b
    assert pool.get_new_block() == 4
    pool.check_invariants(holders_of(pool, [a, b, c, 4]))


def test_cached_block_goes_evictable_and_back():
    pool = BlockPool(4, enable_caching=True, reserve_null_block=True)
    b, other = pool.get_new_blocks(2)
    assert pool.cache_block(b, "k")
    assert pool.num_cached == 1 and pool.get_cached_block("k") == b
    pool.free([b, other])
    assert pool.num_evictable == 1 and pool.num_free == 2 and pool.num_available == 3
    assert pool.get_cached_block("k") == b  # still served while evictable
    pool.touch([b])  # a prefix hit takes it back
    assert pool.ref_count(b) == 1 and pool.num_evictable == 0 and pool.num_available == 2
    pool.check_invariants(holders_of(pool, [b]))


def test_new_blocks_come_from_the_free_list_before_evicting():
    pool = BlockPool(4, enable_caching=True, reserve_null_block=True)
    x, y, z = pool.get_new_blocks(3)
    pool.cache_block(x, "x")
    pool.free([x, y])
    assert pool.get_new_block() == y
    assert pool.num_evictions == 0 and pool.get_cached_block("x") == x
    assert pool.get_new_block() == x  # nothing free is left: evict
    assert pool.num_evictions == 1
    pool.check_invariants(holders_of(pool, [x, y, z]))


def test_lru_eviction_order_and_index_after_eviction():
    pool = BlockPool(5, enable_caching=True, reserve_null_block=True)
    blocks = pool.get_new_blocks(4)
    for i, b in enumerate(blocks):
        pool.cache_block(b, ("key", i))
    pool.free([blocks[2], blocks[0], blocks[3], blocks[1]])  # released in this order
    pool.touch([blocks[0]])  # a hit, released again: now the most recently used
    pool.free([blocks[0]])
    order = [pool.get_new_block() for _ in range(4)]
    assert order == [blocks[2], blocks[3], blocks[1], blocks[0]]
    assert pool.num_evictions == 4 and pool.num_cached == 0
    # Evicted blocks leave the index and come back unregistered, so they can take a new key.
    assert all(pool.get_cached_block(("key", i)) is None for i in range(4))
    assert pool.cache_block(order[0], ("key", 0))
    assert pool.get_cached_block(("key", 0)) == order[0]
    pool.check_invariants(holders_of(pool, order))


def test_cache_block_keeps_one_block_per_key():
    pool = BlockPool(4, enable_caching=True, reserve_null_block=True)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, "k")
    assert not pool.cache_block(b, "k")      # second copy of a prefix: not registered
    assert not pool.cache_block(a, "other")  # a registered block keeps its key
    assert pool.get_cached_block("other") is None
    pool.free([b])
    assert pool.num_free == 2 and pool.num_evictable == 0  # the copy is freed normally
    with pytest.raises(ValueError, match="not held"):
        pool.cache_block(b, "j")
    pool.check_invariants(holders_of(pool, [a]))


def test_caching_off_never_registers():
    pool = BlockPool(3)
    b = pool.get_new_block()
    with pytest.raises(ValueError, match="no prefix index"):
        pool.cache_block(b, "k")
    pool.free([b])
    assert pool.num_evictable == 0 and pool.get_cached_block("k") is None


def test_get_new_blocks_is_all_or_nothing():
    pool = BlockPool(4, reserve_null_block=True)
    pool.get_new_block()
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(3)
    assert pool.num_available == 2 and pool.num_used == 1


def test_reset_prefix_cache_drops_only_evictable_blocks():
    pool = BlockPool(5, enable_caching=True, reserve_null_block=True)
    held, dropped = pool.get_new_blocks(2)
    pool.cache_block(held, "held")
    pool.cache_block(dropped, "dropped")
    pool.free([dropped])
    assert pool.reset_prefix_cache() == 1
    assert pool.num_evictable == 0 and pool.num_free == 3
    assert pool.get_cached_block("dropped") is None
    assert pool.get_cached_block("held") == held
    pool.check_invariants(holders_of(pool, [held]))


def test_check_invariants_catches_a_wrong_holder_count():
    pool = BlockPool(3)
    b = pool.get_new_block()
    with pytest.raises(AssertionError, match="ref count"):
        pool.check_invariants(holders_of(pool, [b, b]))


# ---------------------------------------------------------------- property test
# Weighted so that pools fill up, blocks get cached and released, and evictions happen.
OPS = ("new",) * 3 + ("free",) * 3 + ("cache",) * 3 + ("touch", "hit", "reset")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), num_blocks=st.integers(1, 6), caching=st.booleans(),
       null=st.booleans())
def test_random_operations_match_a_model(data, num_blocks, caching, null):
    """Against a plain model of the contract: the free stack, the LRU list, keys kept by
    cached blocks until they are evicted or reset."""
    pool = BlockPool(num_blocks, enable_caching=caching, reserve_null_block=null)
    first = 1 if null else 0
    held: list[int] = []                   # one entry per reference
    free = list(range(num_blocks - 1, first - 1, -1))
    lru: list[int] = []                    # evictable, least recently released first
    key_of: dict[int, int] = {}            # block -> key it is registered under
    for _ in range(data.draw(st.integers(10, 80), label="num_ops")):
        op = data.draw(st.sampled_from(OPS), label="op")
        if op == "new":
            if not free and not lru:
                with pytest.raises(RuntimeError):
                    pool.get_new_block()
                continue
            expect = free.pop() if free else lru.pop(0)
            key_of.pop(expect, None)
            assert pool.get_new_block() == expect
            held.append(expect)
        elif op == "touch" and held:
            b = data.draw(st.sampled_from(held), label="b")
            pool.touch([b])
            held.append(b)
        elif op == "free" and held:
            b = held.pop(data.draw(st.integers(0, len(held) - 1), label="i"))
            pool.free([b])
            if b not in held:
                (lru if b in key_of else free).append(b)
        elif op == "cache" and held and caching:
            b = data.draw(st.sampled_from(held), label="b")
            key = data.draw(st.integers(0, 4), label="key")
            fresh = b not in key_of and key not in key_of.values()
            assert pool.cache_block(b, key) == fresh
            if fresh:
                key_of[b] = key
        elif op == "hit":
            key = data.draw(st.integers(0, 4), label="key")
            b = pool.get_cached_block(key)
            owner = [blk for blk, k in key_of.items() if k == key]
            assert [b] == owner if owner else b is None
            if b is not None:
                pool.touch([b])
                if b in lru:
                    lru.remove(b)
                held.append(b)
        elif op == "reset":
            assert pool.reset_prefix_cache() == len(lru)
            for b in lru:
                del key_of[b]
            free.extend(lru)
            lru.clear()
        pool.check_invariants(holders_of(pool, held))
        assert pool.num_free == len(free) and pool.num_evictable == len(lru)
        assert pool.num_used == len(set(held)) and pool.num_cached == len(key_of)
