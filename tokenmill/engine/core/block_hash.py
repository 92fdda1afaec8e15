"""Chained hashes of full KV blocks: the prefix cache's keys.

A block's KV depends on every token before it, so its key chains its parent's key:

    tokens:  [ t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 ]       block_size = 4
               block 0       block 1       partial: never hashed
    key0 = hash_block_tokens(None, (t0, t1, t2, t3), extra_keys)
    key1 = hash_block_tokens(key0, (t4, t5, t6, t7), extra_keys)

``extra_keys`` (the model, an adapter, ...) enter every key, the first one included, so two
models never share a block. A key is only an int and may collide; a ``BlockHash`` also keeps
what the key was made of, and the prefix cache compares that on every hit (see block_pool.py).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

__all__ = ["BlockHash", "BlockHashChain", "hash_block_tokens"]


def hash_block_tokens(
    parent: int | None, token_ids: tuple[int, ...], extra_keys: tuple[Hashable, ...]
) -> int:
    """Return the key of a full block whose parent block has key ``parent`` (None: first block).

    Python's tuple hash: fast and stable within a process, which is all an in-memory cache
    needs. Collisions are harmless because hits are verified against the stored content.
    """
    return hash((parent, token_ids, extra_keys))


class BlockHash(NamedTuple):
    """A full block's key together with what it was computed from.

    Equality compares all four fields (``value`` first, so most mismatches stop there). A
    named tuple: a decode step makes one per newly full block, and it builds in a quarter of
    a frozen dataclass's time.
    """

    value: int  # the key in the prefix cache map
    parent: int | None  # the previous block's key; None for a request's first block
    token_ids: tuple[int, ...]
    extra_keys: tuple[Hashable, ...]


class BlockHashChain:
    """The ``BlockHash`` of each full block of one request, grown as its tokens arrive.

    Each block is hashed once: ``extend`` only hashes blocks past those already known, so a
    request's prompt is never rehashed step after step. Token ids are assumed final once a
    block is hashed (a request's tokens only grow).
    """

    def __init__(self, block_size: int, extra_keys: tuple[Hashable, ...] = ()) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.extra_keys = extra_keys
        self.hashes: list[BlockHash] = []

    def __len__(self) -> int:
        return len(self.hashes)

    def extend(self, read: Callable[[int, int], Sequence[int]], num_blocks: int) -> None:
        """Hash blocks until ``num_blocks`` are known (fewer is a no-op). ``read(start,
        stop)`` gives the request's tokens at positions [start, stop) (at most those it has):
        only the tokens of blocks not hashed yet are read, so a decode step's newly full
        block costs its own tokens, not a copy of the whole sequence.

        Raises ValueError when the tokens do not fill ``num_blocks`` blocks.
        """
        bs, have = self.block_size, len(self.hashes)
        if num_blocks <= have:
            return
        token_ids = read(have * bs, num_blocks * bs)
        if len(token_ids) < (num_blocks - have) * bs:
            raise ValueError(
                f"cannot hash {num_blocks} blocks of {bs} tokens from "
                f"{have * bs + len(token_ids)} tokens"
            )
        self.append(token_ids)

    def append(self, token_ids: Sequence[int]) -> None:
        """Hash the whole blocks in ``token_ids``, the tokens right after the hashed blocks
        (from position ``len(self) * block_size``). Raises ValueError unless they fill whole
        blocks."""
        bs = self.block_size
        if len(token_ids) % bs:
            raise ValueError(f"{len(token_ids)} tokens are not whole blocks of {bs}")
        hashes, extra = self.hashes, self.extra_keys
        parent = hashes[-1].value if hashes else None
        # Each prompt's blocks are hashed on the engine thread as it is admitted: the blocks'
        # token tuples are cut in C (one iterator zipped with itself), and each BlockHash is
        # built by tuple.__new__, not the named tuple's Python-level constructor (12 blocks:
        # 6.9 -> 5.0 us).
        new = tuple.__new__
        for block_tokens in zip(*[iter(token_ids)] * bs, strict=True):
            value = hash_block_tokens(parent, block_tokens, extra)
            hashes.append(new(BlockHash, (value, parent, block_tokens, extra)))
            parent = value
