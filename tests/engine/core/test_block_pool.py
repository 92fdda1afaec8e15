"""BlockPool: ref counts, the free queue's order, lazy eviction and cache verification."""

from __future__ import annotations

import pytest

from tokenmill.engine.core import BlockHash, BlockHashChain, BlockPool, KVBlock


def _reader(tokens: list[int]):
    """``BlockHashChain.extend``'s token reader over a list."""
    return lambda start, stop: tokens[start:stop]


def _chain(tokens: list[int], block_size: int = 2) -> list[BlockHash]:
    chain = BlockHashChain(block_size, ("model",))
    chain.extend(_reader(tokens), len(tokens) // block_size)
    return chain.hashes


def _cache_chain(pool: BlockPool, blocks: list[KVBlock], hashes: list[BlockHash]) -> None:
    parent = None
    for block, block_hash in zip(blocks, hashes, strict=True):
        assert pool.cache(block, block_hash, parent)
        parent = block


def test_allocate_pops_front_and_sets_ref_counts() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 1
    with pytest.raises(ValueError):
        pool.allocate(2)
    pool.check_integrity()


def test_release_puts_uncached_blocks_first_and_cached_blocks_last() -> None:
    pool = BlockPool(5)
    blocks = pool.allocate(4)
    _cache_chain(pool, blocks[:2], _chain([1, 2, 3, 4]))
    pool.release(reversed(blocks))  # tail first, as the manager frees a request
    # Uncached 3 and 2 go to the front (each ahead of the last), cached 1 then 0 to the back.
    assert pool.free_block_ids() == [2, 3, 4, 1, 0]
    pool.check_integrity()
    with pytest.raises(RuntimeError):
        pool.release([blocks[0]])


def test_lru_eviction_is_lazy_and_in_free_order() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    b = pool.allocate(2)
    _cache_chain(pool, a, _chain([1, 2, 3, 4]))
    _cache_chain(pool, b, _chain([5, 6, 7, 8]))
    pool.release(reversed(a))
    pool.release(reversed(b))
    assert pool.free_block_ids() == [1, 0, 3, 2]
    assert pool.num_cached_blocks == 4  # freed, still cached
    (evicted,) = pool.allocate(1)
    assert evicted.block_id == 1 and evicted.block_hash is None
    assert pool.num_cached_blocks == 3
    pool.check_integrity()


def test_evicting_a_parent_uncaches_its_descendants() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    hashes = _chain([1, 2, 3, 4, 5, 6])
    _cache_chain(pool, blocks, hashes)
    pool.release(blocks)  # head first: block 0 is evicted before its children
    assert pool.free_block_ids() == [3, 0, 1, 2]
    pool.allocate(2)  # 3, then 0 whose eviction uncaches 1 and 2 and moves them forward
    assert pool.num_cached_blocks == 0
    assert sorted(pool.free_block_ids()) == [1, 2]
    pool.check_integrity()


def test_take_removes_a_free_cached_block_from_the_middle() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    _cache_chain(pool, blocks, _chain([1, 2, 3, 4, 5, 6]))
    pool.release(reversed(blocks))
    pool.take(blocks[1])
    assert blocks[1].ref_cnt == 1
    assert pool.free_block_ids() == [2, 0]
    pool.take(blocks[1])
    assert blocks[1].ref_cnt == 2
    pool.check_integrity()


def test_lookup_verifies_content_and_parent() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    hashes = _chain([1, 2, 3, 4])
    _cache_chain(pool, blocks, hashes)
    assert pool.lookup(hashes[0], None) is blocks[0]
    assert pool.lookup(hashes[1], blocks[0]) is blocks[1]
    assert pool.lookup(hashes[1], None) is None  # wrong parent
    forged = BlockHash(hashes[0].value, None, (9, 9), hashes[0].extra_keys)
    assert pool.lookup(forged, None) is None  # same key, other tokens
    other_model = BlockHash(hashes[0].value, None, hashes[0].token_ids, ("other",))
    assert pool.lookup(other_model, None) is None


def test_cache_keeps_the_existing_entry_for_a_taken_key() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    (h,) = _chain([1, 2])
    assert pool.cache(a, h, None)
    assert not pool.cache(b, h, None)
    assert b.block_hash is None and pool.lookup(h, None) is a
    with pytest.raises(RuntimeError):
        pool.cache(a, h, None)  # already cached
    pool.check_integrity()


def test_reset_prefix_cache_only_when_nothing_is_held() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    _cache_chain(pool, blocks, _chain([1, 2]))
    assert not pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 1
    pool.release(blocks)
    assert pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0
    pool.check_integrity()


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda pool: setattr(pool.blocks[0], "ref_cnt", 1),  # free but counted as held
        lambda pool: pool._free.pop(1),  # a free block lost
        lambda pool: pool._free.move_to_end(1, last=False),  # cached ahead of uncached
        lambda pool: setattr(pool.blocks[2], "block_hash", None),  # map entry without hash
        lambda pool: pool._children.clear(),
    ],
)
def test_check_integrity_catches_corruption(corrupt) -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    _cache_chain(pool, blocks[1:3], _chain([1, 2, 3, 4]))
    pool.release(reversed(blocks))
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(RuntimeError):
        pool.check_integrity()


def test_chain_append_hashes_the_blocks_after_the_known_ones() -> None:
    tokens = list(range(10, 22))  # 6 blocks of 2
    whole = _chain(tokens)
    piecewise = BlockHashChain(2, ("model",))
    piecewise.append(tokens[:2])
    piecewise.append(tokens[2:8])  # three blocks at once
    piecewise.extend(_reader(tokens), 5)  # reads only tokens[8:10]
    piecewise.extend(_reader(tokens), 3)  # fewer than known: no-op
    piecewise.append(tokens[10:12])
    assert piecewise.hashes == whole
    assert [h.parent for h in whole] == [None] + [h.value for h in whole[:-1]]
    with pytest.raises(ValueError, match="not whole blocks of 2"):
        piecewise.append([1, 2, 3])
    with pytest.raises(ValueError, match="cannot hash 7 blocks"):
        piecewise.extend(_reader(tokens), 7)
