"""BlockPool: the KV blocks, their reference counts, the free queue and the prefix cache map.

Every block is either held (``ref_cnt > 0``, in one or more request block tables) or free
(``ref_cnt == 0``, in the free queue). A free block may still be *cached*: it keeps its
``block_hash`` and KV so a later request with the same prefix can take it back. Cached
blocks are evicted lazily, only when ``allocate`` pops them for new content.

    free queue (an OrderedDict: O(1) append, popleft and remove from the middle):

    front ─► [ uncached ... uncached | cached (least recently freed) ... cached ] ◄─ back
             reused first: they hold    evicted in LRU order; a freed request appends
             nothing worth keeping      its blocks tail first, so its tail goes first

Cached blocks form a forest: a block is cached under ``cache_parent``, the cached block of
the previous position that held the same prefix when it was registered. Evicting a block
uncaches its cached descendants too (no lookup could reach them: lookups walk from the first
block), so a cached block's parent is always the entry stored under its parent key, and it
has been since the child was registered. That is what makes a verified hit exact whatever
the hash function: ``lookup`` compares the stored content and the parent block itself.

Block 0 is an ordinary block: there is no reserved null block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from tokenmill.engine.core.block_hash import BlockHash

__all__ = ["BlockPool", "KVBlock"]


@dataclass(eq=False, slots=True)
class KVBlock:
    """One block of ``block_size`` token slots in every layer's KV cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set while the block is in the prefix cache
    cache_parent: KVBlock | None = field(default=None, repr=False)


class BlockPool:
    """Owns all ``num_blocks`` blocks; the manager asks it for blocks and gives them back."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}  # BlockHash.value -> block
        self._children: dict[int, set[int]] = {}  # block id -> ids cached under it

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out, cached-but-free ones included."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """Free block ids in reuse order: the first is the next ``allocate`` returns."""
        return list(self._free)

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Pop ``num_blocks`` blocks off the front of the free queue, each with ``ref_cnt`` 1.

        A popped cached block is evicted from the prefix cache here (lazy eviction).
        Raises ValueError when fewer blocks are free; callers check ``num_free_blocks``.
        """
        if num_blocks > len(self._free):
            raise ValueError(f"asked for {num_blocks} blocks, {len(self._free)} are free")
        out = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._uncache(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def take(self, block: KVBlock) -> None:
        """Add a reference to a (cached) block, out of the free queue if it was free."""
        if block.ref_cnt == 0:
            del self._free[block.block_id]
        block.ref_cnt += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference to each block, in order; a block at 0 joins the free queue.

        Cached blocks join the back (LRU order), uncached ones the front.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} released with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def lookup(self, block_hash: BlockHash, parent: KVBlock | None) -> KVBlock | None:
        """The cached block holding exactly ``block_hash``'s content after ``parent``, or None.

        ``parent`` is the block this lookup matched for the previous position (None for the
        first block). A colliding key with other content or another parent is a miss.
        """
        block = self._cached.get(block_hash.value)
        if block is None or block.block_hash != block_hash or block.cache_parent is not parent:
            return None
        return block

    def cache(self, block: KVBlock, block_hash: BlockHash, parent: KVBlock | None) -> bool:
        """Register a held, computed ``block`` under ``block_hash`` as a child of ``parent``.

        ``parent`` must be the cached block for ``block_hash.parent`` (None for a first block).
        Returns False, changing nothing, when the key is already taken: the existing entry is
        kept. Raises RuntimeError on a broken precondition.
        """
        if block.block_hash is not None or block.ref_cnt == 0:
            raise RuntimeError(f"block {block.block_id} must be held and uncached to be cached")
        if parent is None:
            ok = block_hash.parent is None
        else:
            ok = (
                parent.block_hash is not None
                and parent.block_hash.value == block_hash.parent
                and self._cached.get(block_hash.parent) is parent
            )
        if not ok:
            raise RuntimeError(f"block {block.block_id}: parent is not the cached parent entry")
        if block_hash.value in self._cached:
            return False
        self._cached[block_hash.value] = block
        block.block_hash = block_hash
        block.cache_parent = parent
        if parent is not None:
            self._children.setdefault(parent.block_id, set()).add(block.block_id)
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (returns False) while any block is held."""
        if len(self._free) != len(self.blocks):
            return False
        for block in self.blocks:
            block.block_hash = None
            block.cache_parent = None
        self._cached.clear()
        self._children.clear()
        return True

    def _uncache(self, block: KVBlock) -> None:
        """Evict ``block`` and its cached descendants from the prefix cache."""
        stack = [block]
        while stack:
            b = stack.pop()
            if b.block_hash is None:
                raise RuntimeError(f"block {b.block_id} is not cached")
            del self._cached[b.block_hash.value]
            if b.cache_parent is not None:
                siblings = self._children[b.cache_parent.block_id]
                siblings.discard(b.block_id)
                if not siblings:
                    del self._children[b.cache_parent.block_id]
            b.block_hash = None
            b.cache_parent = None
            if b.block_id in self._free:  # now worthless: reuse it before any cached block
                self._free.move_to_end(b.block_id, last=False)
            for child_id in self._children.pop(b.block_id, ()):
                child = self.blocks[child_id]
                child.cache_parent = None  # its parent's index entry is gone already
                stack.append(child)

    def check_integrity(self) -> None:
        """Raise RuntimeError naming the first broken pool invariant.

        The free queue holds exactly the ref_cnt-0 blocks, each once, uncached ones first;
        the cache map's blocks carry the key they are stored under and every block with a
        hash is in the map; each cached block's parent is the entry under its parent key.
        """
        for i, block in enumerate(self.blocks):
            if block.block_id != i:
                raise RuntimeError(f"blocks[{i}] has block_id {block.block_id}")
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {i} has ref_cnt {block.ref_cnt}")
            if (block.ref_cnt == 0) != (i in self._free):
                raise RuntimeError(
                    f"block {i} with ref_cnt {block.ref_cnt} is "
                    f"{'' if i in self._free else 'not '}in the free queue"
                )
        seen_cached = False
        for i, block in self._free.items():
            if block is not self.blocks[i]:
                raise RuntimeError(f"free queue entry {i} is not block {i}")
            if block.block_hash is not None:
                seen_cached = True
            elif seen_cached:
                raise RuntimeError(f"uncached free block {i} queued behind a cached one")
        for key, block in self._cached.items():
            if block.block_hash is None or block.block_hash.value != key:
                raise RuntimeError(f"block {block.block_id} stored under key {key} lacks that key")
        children: dict[int, set[int]] = {}
        for block in self.blocks:
            h = block.block_hash
            if h is None:
                if block.cache_parent is not None:
                    raise RuntimeError(f"uncached block {block.block_id} has a cache parent")
                continue
            if self._cached.get(h.value) is not block:
                raise RuntimeError(f"block {block.block_id} has a hash but is not in the map")
            parent = block.cache_parent
            if h.parent is None:
                if parent is not None:
                    raise RuntimeError(f"first block {block.block_id} has a cache parent")
            elif parent is None or self._cached.get(h.parent) is not parent:
                raise RuntimeError(
                    f"cached block {block.block_id}: parent is not the entry under its key"
                )
            else:
                children.setdefault(parent.block_id, set()).add(block.block_id)
        if children != self._children:
            raise RuntimeError("cache children index disagrees with the blocks' parents")
