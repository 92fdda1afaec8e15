"""KVCacheManager: allocation, prefix-cache hits, eviction, and random operation sequences.

The random runs keep a shadow KV cache: each computed slot records the token prefix its KV
depends on, so every hit is checked to serve exactly the requester's own prefix.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import pytest

from tokenmill.engine.core import KVCacheManager, block_hash
from tokenmill.engine.core.request import Request
from tokenmill.engine.sampling_params import SamplingParams


@dataclass
class FakeRequest:
    """Only what the manager's KVRequest protocol asks for."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    # Test-side bookkeeping, invisible to the manager.
    hits: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def token_ids_between(self, start: int, stop: int) -> list[int]:
        return self.all_token_ids[start:stop]


def _snapshot(mgr: KVCacheManager) -> tuple:
    pool = mgr.pool
    return (
        pool.free_block_ids(),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        {rid: list(s.block_ids) for rid, s in mgr._states.items()},
        mgr.prefix_cache_stats,
    )


def _run_prefill(mgr: KVCacheManager, req: FakeRequest) -> list[int]:
    """Admit ``req`` with its prefix hits, compute all of it and cache its full blocks."""
    hits, num_hit_tokens = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, req.num_tokens - num_hit_tokens, hits)
    req.num_computed_tokens = req.num_tokens
    mgr.cache_blocks(req, req.num_computed_tokens)
    mgr.check_integrity()
    return hits


def test_allocation_grows_the_table_block_by_block() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    req = FakeRequest("a", list(range(10)))
    assert mgr.allocate_slots(req, 5)
    assert mgr.block_ids("a") == [0, 1]
    req.num_computed_tokens = 5
    assert mgr.allocate_slots(req, 3)  # 8 tokens: still 2 blocks
    assert mgr.block_ids("a") == [0, 1]
    req.num_computed_tokens = 8
    assert mgr.allocate_slots(req, 2)
    assert mgr.block_ids("a", start=2) == [2]
    assert mgr.num_free_blocks == 5 and mgr.usage == pytest.approx(3 / 8)
    mgr.check_integrity()
    mgr.free(req)
    assert mgr.num_free_blocks == 8 and mgr.usage == 0.0
    with pytest.raises(KeyError):
        mgr.block_ids("a")
    mgr.check_integrity()


def test_works_with_the_engine_request() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=2, extra_keys=("model",))
    first = Request("r0", [1, 2, 3, 4, 5], SamplingParams())
    second = Request("r1", [1, 2, 3, 4, 6], SamplingParams())
    assert mgr.allocate_slots(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    mgr.cache_blocks(first, first.num_computed_tokens)
    hits, num_hit_tokens = mgr.get_computed_blocks(second)
    assert hits == mgr.block_ids("r0")[:2] and num_hit_tokens == 4
    mgr.check_integrity()


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_hit_after_free_reuses_the_blocks(block_size: int) -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=block_size)
    prompt = list(range(100, 100 + 3 * block_size + 1))
    first = FakeRequest("a", prompt)
    _run_prefill(mgr, first)
    first_blocks = mgr.block_ids("a")
    mgr.free(first)
    mgr.check_integrity()
    second = FakeRequest("b", prompt + [7])
    hits = _run_prefill(mgr, second)
    num_full = len(prompt) // block_size  # all of first's full blocks were cached
    assert hits == first_blocks[:num_full]
    assert mgr.block_ids("b")[:num_full] == first_blocks[:num_full]
    stats = mgr.prefix_cache_stats
    assert stats.num_requests == 2
    assert stats.queried_tokens == len(prompt) + len(prompt) + 1
    assert stats.hit_tokens == num_full * block_size
    assert stats.hit_rate == pytest.approx(stats.hit_tokens / stats.queried_tokens)


def test_shared_blocks_are_ref_counted() -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=2)
    a = FakeRequest("a", [1, 2, 3, 4, 5])
    _run_prefill(mgr, a)
    b = FakeRequest("b", [1, 2, 3, 4, 9])
    assert _run_prefill(mgr, b) == mgr.block_ids("a")[:2]
    assert [mgr.pool.blocks[i].ref_cnt for i in mgr.block_ids("a")] == [2, 2, 1]
    mgr.free(a)
    assert [mgr.pool.blocks[i].ref_cnt for i in mgr.block_ids("b")] == [1, 1, 1]
    mgr.check_integrity()


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_fully_cached_prompt_leaves_the_last_token_to_compute(block_size: int) -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=block_size)
    prompt = list(range(3 * block_size))  # exactly 3 full blocks
    first = FakeRequest("a", prompt)
    _run_prefill(mgr, first)
    hits, num_hit_tokens = mgr.get_computed_blocks(FakeRequest("b", list(prompt)))
    assert num_hit_tokens == 2 * block_size  # (num_tokens - 1) rounded down to blocks
    assert hits == mgr.block_ids("a")[:2]
    single = FakeRequest("c", prompt[:1])
    assert mgr.get_computed_blocks(single) == ([], 0)
    mgr.free(single)


def test_lru_evicts_the_least_recently_freed_tail_first() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=2)
    a = FakeRequest("a", [1, 2, 3, 4, 5, 6])
    b = FakeRequest("b", [7, 8, 9, 10, 11, 12])
    _run_prefill(mgr, a)
    _run_prefill(mgr, b)
    a_blocks, b_blocks = mgr.block_ids("a"), mgr.block_ids("b")
    mgr.free(a)
    mgr.free(b)
    assert mgr.pool.free_block_ids() == a_blocks[::-1] + b_blocks[::-1]
    filler = FakeRequest("f", [0])
    assert mgr.allocate_slots(filler, 2 * 2)  # two blocks: a's tail, then a's middle
    assert mgr.block_ids("f") == a_blocks[:0:-1]
    mgr.check_integrity()
    assert mgr.get_computed_blocks(FakeRequest("a2", a.all_token_ids + [0]))[1] == 2
    assert mgr.get_computed_blocks(FakeRequest("b2", b.all_token_ids + [0]))[1] == 6


def test_freed_uncached_blocks_are_reused_before_cached_ones() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    cached = FakeRequest("c", [1, 2, 3, 4, 5])
    _run_prefill(mgr, cached)  # blocks 0, 1 cached; 2 holds a partial block
    mgr.free(cached)
    assert mgr.pool.free_block_ids()[:2] == [2, 3]
    fresh = FakeRequest("f", [9, 9, 9])
    assert mgr.allocate_slots(fresh, 3)
    assert mgr.block_ids("f") == [2, 3]
    assert mgr.get_computed_blocks(FakeRequest("c2", cached.all_token_ids))[1] == 4


def test_allocation_failure_changes_nothing() -> None:
    mgr = KVCacheManager(num_blocks=5, block_size=2)
    a = FakeRequest("a", [1, 2, 3, 4, 5])
    _run_prefill(mgr, a)
    mgr.free(a)
    b = FakeRequest("b", [1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12])
    hits, num_hit_tokens = mgr.get_computed_blocks(b)
    assert len(hits) == 2
    before = _snapshot(mgr)
    # 11 tokens = 6 blocks > 5: refused, hits not taken, nothing evicted, nothing counted.
    assert not mgr.allocate_slots(b, b.num_tokens - num_hit_tokens, hits)
    assert _snapshot(mgr) == before
    mgr.check_integrity()
    held = FakeRequest("h", [0])
    assert mgr.allocate_slots(held, 1)
    before = _snapshot(mgr)
    assert not mgr.allocate_slots(held, 2 * 5 + 1)  # 6 blocks: 5 more, 4 free
    assert _snapshot(mgr) == before


def test_append_blocks_gives_running_requests_blocks_as_allocate_slots_would() -> None:
    """The decode rows that start new blocks get them in one call: the same blocks, in the
    same order, as one allocate_slots call per row; too few free blocks change nothing."""
    mgrs = [KVCacheManager(num_blocks=12, block_size=4) for _ in range(2)]
    for mgr in mgrs:
        for rid in "abc":
            req = FakeRequest(rid, list(range(8)))
            assert mgr.allocate_slots(req, 8)
            req.num_computed_tokens = 8
    rows = [FakeRequest("a", list(range(9)), 8), FakeRequest("c", list(range(9)), 8)]
    for req, count in zip(rows, (1, 2), strict=True):
        assert mgrs[0].allocate_slots(req, 4 * count - 3)  # 1 and 5 more tokens: 1, 2 blocks
    assert mgrs[1].append_blocks(rows, [1, 2]) == [6, 7, 8]
    assert _snapshot(mgrs[1]) == _snapshot(mgrs[0])
    mgrs[1].check_integrity()
    before = _snapshot(mgrs[1])
    with pytest.raises(ValueError, match="asked for 4 blocks, 3 are free"):
        mgrs[1].append_blocks(rows, [2, 2])
    assert _snapshot(mgrs[1]) == before


def test_free_hit_blocks_are_not_counted_twice() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    a = FakeRequest("a", [1, 2, 3, 4, 5])
    _run_prefill(mgr, a)
    mgr.free(a)  # all 4 blocks free, 2 of them cached
    b = FakeRequest("b", [1, 2, 3, 4] + [6] * 5)  # 9 tokens: 5 blocks, 2 from the cache
    hits, n = mgr.get_computed_blocks(b)
    assert n == 4
    before = _snapshot(mgr)
    assert not mgr.allocate_slots(b, b.num_tokens - n, hits)  # 3 fresh, only 2 others free
    assert _snapshot(mgr) == before
    b.all_token_ids.pop()  # 8 tokens: 4 blocks fit exactly
    assert mgr.allocate_slots(b, b.num_tokens - n, hits)
    assert mgr.block_ids("b")[:2] == hits and mgr.num_free_blocks == 0
    mgr.check_integrity()


def test_stale_or_misplaced_hits_are_rejected() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    a = FakeRequest("a", [1, 2, 3])
    _run_prefill(mgr, a)
    mgr.free(a)
    b = FakeRequest("b", [1, 2, 3])
    hits, _ = mgr.get_computed_blocks(b)
    assert hits
    evictor = FakeRequest("e", [0])
    assert mgr.allocate_slots(evictor, 8)  # evicts every cached block
    with pytest.raises(ValueError, match="no longer caches"):
        mgr.allocate_slots(b, 1, hits)
    with pytest.raises(ValueError):
        mgr.allocate_slots(evictor, 0, hits)  # a request that already holds blocks
    mgr.check_integrity()


def test_duplicate_prefix_computed_concurrently_keeps_the_first_entry() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    a = FakeRequest("a", [1, 2, 3, 4, 5])
    b = FakeRequest("b", [1, 2, 3, 4, 6])
    for req in (a, b):  # both admitted before either computed anything: no hits
        assert mgr.get_computed_blocks(req) == ([], 0)
        assert mgr.allocate_slots(req, req.num_tokens)
    for req in (a, b):
        req.num_computed_tokens = req.num_tokens
        mgr.cache_blocks(req, req.num_computed_tokens)
        mgr.check_integrity()
    assert mgr.pool.num_cached_blocks == 2
    assert all(mgr.pool.blocks[i].block_hash is None for i in mgr.block_ids("b"))
    c = FakeRequest("c", [1, 2, 3, 4, 7, 8, 9])
    assert mgr.get_computed_blocks(c)[0] == mgr.block_ids("a")[:2]
    # b's later blocks still chain onto a's entries: b's third block gets cached.
    b.all_token_ids += [10]
    assert mgr.allocate_slots(b, 1)
    b.num_computed_tokens = b.num_tokens
    mgr.cache_blocks(b, b.num_computed_tokens)
    assert mgr.pool.blocks[mgr.block_ids("b")[2]].block_hash is not None
    d = FakeRequest("d", [1, 2, 3, 4, 6, 10, 0])
    assert mgr.get_computed_blocks(d)[0] == mgr.block_ids("a")[:2] + mgr.block_ids("b")[2:3]
    mgr.check_integrity()


def test_extra_keys_separate_models() -> None:
    one = KVCacheManager(num_blocks=4, block_size=2, extra_keys=("m1",))
    a = FakeRequest("a", [1, 2, 3])
    _run_prefill(one, a)
    h = one.pool.blocks[one.block_ids("a")[0]].block_hash
    chain = block_hash.BlockHashChain(2, ("m2",))
    chain.extend(lambda start, stop: [1, 2][start:stop], 1)
    assert chain.hashes[0] != h
    assert one.pool.lookup(chain.hashes[0], None) is None


def test_forged_collisions_are_never_served(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_hash, "hash_block_tokens", lambda parent, tokens, extra: 0)
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    a = FakeRequest("a", [1, 2, 3, 4, 5])
    _run_prefill(mgr, a)
    # Every key is 0: a's first block holds it; its second block cannot be cached.
    assert mgr.pool.num_cached_blocks == 1
    assert mgr.get_computed_blocks(FakeRequest("x", [9, 9, 3, 4, 5])) == ([], 0)
    assert mgr.get_computed_blocks(FakeRequest("y", [1, 2, 9, 9, 5]))[1] == 2
    mgr.check_integrity()


def test_collision_through_an_evicted_parent_is_never_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A key made of the block's last token only: (1, 2) and (9, 2) collide, and so do their
    # children (3, 4). a's second block must not be served after (9, 2) to anyone.
    monkeypatch.setattr(block_hash, "hash_block_tokens", lambda parent, tokens, extra: tokens[-1])
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    a = FakeRequest("a", [1, 2, 3, 4, 5])
    _run_prefill(mgr, a)
    a0, a1, _ = mgr.block_ids("a")
    mgr.free(a)
    mgr.pool.take(mgr.pool.blocks[a1])  # keep a's second block cached, only the first goes
    evicted = mgr.pool.allocate(3)  # the uncached free blocks, then a0
    assert a0 in [b.block_id for b in evicted]
    mgr.pool.release(evicted + [mgr.pool.blocks[a1]])
    assert mgr.pool.blocks[a1].block_hash is None  # uncached along with its parent
    e = FakeRequest("e", [9, 2, 3, 4, 5])
    assert _run_prefill(mgr, e) == []
    f = FakeRequest("f", [9, 2, 3, 4, 6])
    assert _run_prefill(mgr, f) == mgr.block_ids("e")[:2]
    mgr.check_integrity()


def test_prefix_caching_disabled() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=2, enable_prefix_caching=False)
    a = FakeRequest("a", [1, 2, 3, 4, 5])
    assert _run_prefill(mgr, a) == []
    assert mgr.pool.num_cached_blocks == 0
    mgr.free(a)
    assert mgr.get_computed_blocks(FakeRequest("b", [1, 2, 3, 4, 5])) == ([], 0)
    assert mgr.prefix_cache_stats.queried_tokens == 0
    with pytest.raises(ValueError):
        mgr.allocate_slots(FakeRequest("c", [1, 2, 3]), 1, [0])
    mgr.check_integrity()


def test_reset_prefix_cache() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    a = FakeRequest("a", [1, 2, 3])
    _run_prefill(mgr, a)
    assert not mgr.reset_prefix_cache()
    mgr.free(a)
    assert mgr.reset_prefix_cache()
    assert mgr.get_computed_blocks(FakeRequest("b", [1, 2, 3])) == ([], 0)
    mgr.check_integrity()


def test_check_integrity_catches_a_wrong_ref_count() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    _run_prefill(mgr, FakeRequest("a", [1, 2, 3]))
    mgr._states["a"].block_ids.append(3)  # a table entry without a reference
    with pytest.raises(RuntimeError, match="block 3"):
        mgr.check_integrity()


# -- random operation sequences ---------------------------------------------------------


def _compute(mgr: KVCacheManager, req: FakeRequest, n: int, kv: dict[int, tuple]) -> None:
    """Pretend the model computed ``n`` tokens: write their KV into the shadow cache."""
    bs = mgr.block_size
    table = mgr.block_ids(req.request_id)
    for p in range(req.num_computed_tokens, req.num_computed_tokens + n):
        block = mgr.pool.blocks[table[p // bs]]
        assert block.ref_cnt == 1 and block.block_hash is None, "writing into a shared block"
        kv[block.block_id * bs + p % bs] = tuple(req.all_token_ids[: p + 1])
    req.num_computed_tokens += n
    mgr.cache_blocks(req, req.num_computed_tokens)


def _check_hits(mgr: KVCacheManager, req: FakeRequest, hits: list[int], kv: dict) -> None:
    bs = mgr.block_size
    for j, block_id in enumerate(hits):
        for p in range(j * bs, (j + 1) * bs):
            assert kv[block_id * bs + p % bs] == tuple(req.all_token_ids[: p + 1])


def _random_run(seed: int, block_size: int, num_blocks: int, enable: bool = True) -> int:
    """Seeded admit / step / preempt / finish sequence; returns the prefix-cache hit tokens."""
    rng = random.Random(seed)
    mgr = KVCacheManager(num_blocks, block_size, enable, extra_keys=("model",))
    kv: dict[int, tuple] = {}
    vocab = 3  # few token values: many shared prefixes and, with weak hashes, collisions
    prefixes = [
        [rng.randrange(vocab) for _ in range(rng.randint(0, 3 * block_size))] for _ in range(3)
    ]
    waiting: deque[FakeRequest] = deque()
    running: list[FakeRequest] = []
    for step in range(400):
        op = rng.random()
        if op < 0.2 and len(waiting) + len(running) < 8:
            tail = [rng.randrange(vocab) for _ in range(rng.randint(1, 2 * block_size))]
            waiting.append(FakeRequest(f"r{step}", rng.choice(prefixes) + tail))
        elif op < 0.45 and waiting:
            req = waiting[0]
            hits, num_hit_tokens = mgr.get_computed_blocks(req)
            assert num_hit_tokens == len(hits) * block_size <= req.num_tokens - 1
            _check_hits(mgr, req, hits, kv)
            chunk = rng.randint(1, req.num_tokens - num_hit_tokens)
            if mgr.allocate_slots(req, chunk, hits):
                req.num_computed_tokens += num_hit_tokens
                _compute(mgr, req, chunk, kv)
                running.append(waiting.popleft())
            elif rng.random() < 0.3:  # abort a request that never got blocks
                mgr.free(waiting.popleft())
        elif op < 0.85 and running:
            req = rng.choice(running)
            if req.num_computed_tokens == req.num_tokens:  # decode: sample, then compute it
                req.all_token_ids.append(rng.randrange(vocab))
            chunk = rng.randint(1, req.num_tokens - req.num_computed_tokens)
            if mgr.allocate_slots(req, chunk):
                _compute(mgr, req, chunk, kv)
            else:  # preempt by recompute
                mgr.free(req)
                req.num_computed_tokens = 0
                running.remove(req)
                waiting.append(req)
        elif running:
            mgr.free(running.pop(rng.randrange(len(running))))
        elif not waiting and rng.random() < 0.1:
            assert mgr.reset_prefix_cache()
        mgr.check_integrity()
    for req in running + list(waiting):
        mgr.free(req)
    mgr.check_integrity()
    assert mgr.num_free_blocks == num_blocks
    return mgr.prefix_cache_stats.hit_tokens


@pytest.mark.parametrize("block_size", [1, 2, 4])
@pytest.mark.parametrize("seed", range(8))
def test_random_operations_keep_integrity(seed: int, block_size: int) -> None:
    hit_tokens = _random_run(seed, block_size, num_blocks=24 // block_size + 4)
    assert hit_tokens > 0  # the run exercised the cache


@pytest.mark.parametrize(
    "weak_hash",
    [
        lambda parent, tokens, extra: 0,
        lambda parent, tokens, extra: tokens[-1],
        lambda parent, tokens, extra: hash((parent, sum(tokens) % 2)),
    ],
)
@pytest.mark.parametrize("block_size", [1, 2, 4])
@pytest.mark.parametrize("seed", range(4))
def test_random_operations_with_colliding_hashes(
    seed: int, block_size: int, weak_hash, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(block_hash, "hash_block_tokens", weak_hash)
    _random_run(seed, block_size, num_blocks=24 // block_size + 4)


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_random_operations_without_prefix_caching(block_size: int) -> None:
    assert _random_run(0, block_size, num_blocks=16, enable=False) == 0
