"""KVCacheManager: per-request block tables over a BlockPool, and the prefix-cache logic.

Block ``i`` of a request's table holds token positions ``[i * block_size, (i + 1) * block_size)``.
The model runner turns a position into a slot of the flat KV cache:

    block_size = 4, block_table = [7, 2, 9]

    position p     0  1  2  3 | 4  5  6  7 | 8  9
    p // 4             0      |     1      |   2      index into the block table
    block id           7      |     2      |   9
    slot          28 29 30 31 | 8  9 10 11 | 36 37    block_table[p // 4] * 4 + p % 4

A prefix-cache hit gives a new request the leading blocks of its table, already computed:

    tokens         [ cached block | cached block | computed this step ..... ]
    num computed     0            ^hit tokens (returned by get_computed_blocks)
    the last token is always recomputed so that the model produces its logits

Per request the scheduler calls, in order:
    blocks, n = get_computed_blocks(req)        # new or preempted requests only
    if allocate_slots(req, num_new, blocks):    # then the scheduler adds n to
        ...                                     #   req.num_computed_tokens itself
    cache_blocks(req, req.num_computed_tokens)  # after the step computed the KV
    free(req)                                   # finished, preempted or aborted
Pure Python (no torch): the scheduler's tests run it with tiny block sizes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tokenmill.engine.core.block_hash import BlockHash, BlockHashChain
from tokenmill.engine.core.block_pool import BlockPool, KVBlock

__all__ = ["KVCacheManager", "KVRequest", "PrefixCacheStats"]


class KVRequest(Protocol):
    """What the manager reads from a request (``tokenmill.engine.core.request.Request`` fits)."""

    @property
    def request_id(self) -> str: ...

    def token_ids_between(self, start: int, stop: int) -> Sequence[int]:
        """The request's tokens at positions [start, stop) (prompt then output)."""
        ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache counters, counted once per request allocation (again after preemption)."""

    num_requests: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass
class _RequestState:
    chain: BlockHashChain
    block_ids: list[int] = field(default_factory=list)
    # Leading blocks already offered to the prefix cache (cached, or duplicates of an entry).
    num_cached_blocks: int = 0
    # The cache entry matching block num_cached_blocks - 1, and its hash when matched: if the
    # entry is evicted later its hash changes, and the chain can no longer be extended.
    parent: KVBlock | None = None
    parent_hash: BlockHash | None = None
    caching_stopped: bool = False
    counted: bool = False  # in PrefixCacheStats already


class KVCacheManager:
    """Hands out KV blocks to requests and shares computed full blocks between them.

    ``extra_keys`` enter every block key (e.g. the model name) so blocks are only shared
    between requests that would compute the same KV.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        extra_keys: tuple[Hashable, ...] = (),
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.extra_keys = tuple(extra_keys)
        self.pool = BlockPool(num_blocks)
        self._states: dict[str, _RequestState] = {}
        self._num_requests = 0
        self._queried_tokens = 0
        self._hit_tokens = 0

    # -- read-only views -------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can use: free ones, cached-but-unreferenced ones included."""
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._num_requests, self._queried_tokens, self._hit_tokens)

    def block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """A copy of the request's block table from index ``start`` (new blocks: old length).

        Raises KeyError for a request that holds no table.
        """
        state = self._states.get(request_id)
        if state is None:
            raise KeyError(f"request {request_id!r} has no KV blocks")
        return state.block_ids[start:]

    # -- prefix cache ----------------------------------------------------------------------

    def get_computed_blocks(self, request: KVRequest) -> tuple[list[int], int]:
        """Find the longest run of cached blocks matching the start of the request's tokens.

        Returns (block ids, number of tokens they hold). At most ``num_tokens - 1`` tokens,
        rounded down to full blocks, so at least the last token is computed. ([], 0) when
        prefix caching is off. Ref counts are untouched, so pass the ids straight on to
        ``allocate_slots``. Keeps the request's block hashes for later calls; ``free`` drops
        them, so call ``free`` for every request looked up, even if it is never allocated.
        """
        if not self.enable_prefix_caching:
            return [], 0
        state = self._states.get(request.request_id)
        if state is None:
            state = self._states[request.request_id] = self._new_state()
        max_blocks = max(0, request.num_tokens - 1) // self.block_size
        # Every full block's key at once: past the first miss they are not wasted, as the
        # request, once admitted, caches those blocks under them (one call instead of one
        # a block: admission is the engine thread's work in a batch job's steady state).
        state.chain.extend(request.token_ids_between, max_blocks)
        hits: list[int] = []
        parent: KVBlock | None = None
        lookup = self.pool.lookup
        for block_hash in state.chain.hashes[:max_blocks]:
            block = lookup(block_hash, parent)
            if block is None:
                break
            hits.append(block.block_id)
            parent = block
        return hits, len(hits) * self.block_size

    def cache_blocks(self, request: KVRequest, num_computed_tokens: int) -> None:
        """Offer the request's newly full blocks below ``num_computed_tokens`` to the cache.

        Call after the step that computed their KV. A block whose content is already cached
        (another request computed the same prefix) stays uncached: the existing entry is kept.
        Caching stops for the request if its chain breaks (a key taken by other content, or
        the entry matching its previous block evicted). Raises ValueError when
        ``num_computed_tokens`` exceeds the request's tokens or its allocated slots.
        """
        if not self.enable_prefix_caching:
            return
        state = self._states.get(request.request_id)
        if state is None:
            raise ValueError(f"request {request.request_id!r} has no KV blocks to cache")
        num_full = num_computed_tokens // self.block_size
        if state.caching_stopped or num_full <= state.num_cached_blocks:
            return  # no newly full block: most decode steps
        if num_computed_tokens > min(request.num_tokens, len(state.block_ids) * self.block_size):
            raise ValueError(
                f"request {request.request_id!r}: num_computed_tokens={num_computed_tokens} is "
                f"past its {request.num_tokens} tokens or {len(state.block_ids)} blocks"
            )
        state.chain.extend(request.token_ids_between, num_full)
        parent, parent_hash = state.parent, state.parent_hash
        # Once this call has cached one of the request's own blocks, no entry can sit under
        # it yet (it was uncached, so childless, until a moment ago): the later lookups
        # would miss, and are skipped (a prompt's blocks are cached at its admission, on
        # the engine thread).
        cached_own = False
        for j in range(state.num_cached_blocks, num_full):
            if parent is not None and parent.block_hash is not parent_hash:
                state.caching_stopped = True
                break
            block_hash = state.chain.hashes[j]
            own = self.pool.blocks[state.block_ids[j]]
            existing = None if cached_own else self.pool.lookup(block_hash, parent)
            if existing is not None:
                parent = existing
            elif self.pool.cache(own, block_hash, parent):
                cached_own = True
                parent = own
            else:
                state.caching_stopped = True
                break
            parent_hash = parent.block_hash
            state.num_cached_blocks = j + 1
        state.parent, state.parent_hash = parent, parent_hash

    def clear(self) -> None:
        """Forget every request's blocks and every cached block: all blocks free and
        uncached, as at the start. Only when no request runs (``Scheduler.clear``)."""
        self.pool = BlockPool(self.pool.num_blocks)
        self._states.clear()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block. Returns False, changing nothing, while blocks are held."""
        return self.pool.reset_prefix_cache()

    # -- allocation ------------------------------------------------------------------------

    def allocate_slots(
        self, request: KVRequest, num_new_tokens: int, new_computed_blocks: Sequence[int] = ()
    ) -> bool:
        """Grow the request's table to hold ``num_computed_tokens + hits + num_new_tokens``.

        ``new_computed_blocks`` are ``get_computed_blocks``' ids, allowed only while the
        request holds no blocks; they go first in the table (ref_cnt + 1). Fresh blocks
        follow, possibly evicting cached free blocks. Returns False, changing nothing, when
        too few blocks are free. Raises ValueError on stale or misplaced hit blocks.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        bs = self.block_size
        state = self._states.get(request.request_id)
        num_held = len(state.block_ids) if state is not None else 0
        if (
            not new_computed_blocks
            and state is not None
            and request.num_computed_tokens + num_new_tokens <= num_held * bs
        ):
            return True  # fits in the blocks it holds: most decode steps
        hits = [self.pool.blocks[i] for i in new_computed_blocks]
        if hits:
            self._check_hits(request, state, hits)
        total_tokens = request.num_computed_tokens + len(hits) * bs + num_new_tokens
        num_fresh = max(0, -(-total_tokens // bs) - num_held - len(hits))
        # Free hit blocks leave the free queue, so they cannot also count as fresh blocks.
        num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_fresh > self.pool.num_free_blocks - num_free_hits:
            return False

        if state is None:
            state = self._states[request.request_id] = self._new_state()
        if self.enable_prefix_caching and not state.counted:
            state.counted = True
            self._num_requests += 1
            self._queried_tokens += request.num_tokens
            self._hit_tokens += len(hits) * bs
        for block in hits:
            self.pool.take(block)
            state.block_ids.append(block.block_id)
        if hits:
            state.num_cached_blocks = len(hits)
            state.parent, state.parent_hash = hits[-1], hits[-1].block_hash
        state.block_ids.extend(b.block_id for b in self.pool.allocate(num_fresh))
        return True

    def append_blocks(self, requests: Sequence[KVRequest], counts: Sequence[int]) -> list[int]:
        """Give each of ``requests`` (running: each holds blocks already) ``counts[i]`` fresh
        blocks at the end of its table, in one pass: the decode rows whose next tokens start
        a new block, most steps a few of them. Returns the new block ids, request after
        request. Raises ValueError, changing nothing, when too few blocks are free."""
        total = sum(counts)
        if total > self.pool.num_free_blocks:
            raise ValueError(f"asked for {total} blocks, {self.pool.num_free_blocks} are free")
        ids = [block.block_id for block in self.pool.allocate(total)]
        at = 0
        for request, count in zip(requests, counts, strict=True):
            self._states[request.request_id].block_ids.extend(ids[at : at + count])
            at += count
        return ids

    def free(self, request: KVRequest) -> None:
        """Release the request's blocks (tail first, so its tail is evicted first) and forget
        its table and hashes. Freed cached blocks keep their KV for later hits. A request
        without state is a no-op."""
        state = self._states.pop(request.request_id, None)
        if state is not None:
            self.pool.release(self.pool.blocks[i] for i in reversed(state.block_ids))

    def _new_state(self) -> _RequestState:
        return _RequestState(BlockHashChain(self.block_size, self.extra_keys))

    def _check_hits(
        self, request: KVRequest, state: _RequestState | None, hits: list[KVBlock]
    ) -> None:
        rid = request.request_id
        if not self.enable_prefix_caching:
            raise ValueError(f"request {rid!r}: prefix-cache hits given with prefix caching off")
        if state is None or state.block_ids or request.num_computed_tokens:
            raise ValueError(
                f"request {rid!r}: hit blocks are only taken by a request with no blocks and no "
                "computed tokens, right after get_computed_blocks"
            )
        if len(hits) * self.block_size >= max(1, request.num_tokens):
            raise ValueError(f"request {rid!r}: hits must leave its last token to compute")
        state.chain.extend(request.token_ids_between, len(hits))
        parent: KVBlock | None = None
        for block, block_hash in zip(hits, state.chain.hashes[: len(hits)], strict=True):
            if self.pool.lookup(block_hash, parent) is not block:
                raise ValueError(
                    f"request {rid!r}: block {block.block_id} no longer caches its prefix; "
                    "call get_computed_blocks right before allocate_slots"
                )
            parent = block

    # -- checks ----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise RuntimeError naming the first broken invariant (tests call it after every
        operation): each block's ref_cnt is the number of tables holding it, no table repeats
        a block, blocks are conserved, plus the pool's own checks."""
        self.pool.check_integrity()
        held: Counter[int] = Counter()
        for rid, state in self._states.items():
            ids = state.block_ids
            if len(set(ids)) != len(ids):
                raise RuntimeError(f"request {rid!r} holds a block twice: {ids}")
            if not all(0 <= i < self.num_blocks for i in ids):
                raise RuntimeError(f"request {rid!r} holds an unknown block id: {ids}")
            if state.num_cached_blocks > len(ids):
                raise RuntimeError(f"request {rid!r} cached more blocks than it holds")
            held.update(ids)
        for block in self.pool.blocks:
            if block.ref_cnt != held[block.block_id]:
                raise RuntimeError(
                    f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
                    f"{held[block.block_id]} tables hold it"
                )
        num_held = sum(1 for b in self.pool.blocks if b.ref_cnt > 0)
        if num_held + self.pool.num_free_blocks != self.num_blocks:
            raise RuntimeError(
                f"{num_held} held + {self.pool.num_free_blocks} free != {self.num_blocks} blocks"
            )
        if not self.enable_prefix_caching and self.pool.num_cached_blocks:
            raise RuntimeError("prefix caching is off but blocks are cached")
