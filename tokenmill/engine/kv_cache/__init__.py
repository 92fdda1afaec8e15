"""Paged KV cache bookkeeping: block pool, chained block hashes, prefix cache. Pure Python."""

from __future__ import annotations

from tokenmill.engine.kv_cache.block_hash import BlockHash, BlockHashChain, hash_block_tokens
from tokenmill.engine.kv_cache.block_pool import BlockPool, KVBlock
from tokenmill.engine.kv_cache.kv_cache_manager import KVCacheManager, KVRequest, PrefixCacheStats

__all__ = [
    "BlockHash",
    "BlockHashChain",
    "BlockPool",
    "KVBlock",
    "KVCacheManager",
    "KVRequest",
    "PrefixCacheStats",
    "hash_block_tokens",
]
