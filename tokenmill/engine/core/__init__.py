"""The engine's core: requests, the step scheduler, the KV cache manager and its block pool.

One package, pure Python (no torch), so the scheduling logic is tested on CPU with tiny block
sizes. The model runner reads what it produces (``SchedulerOutput``, block tables).
"""

from __future__ import annotations

from tokenmill.engine.core.block_hash import BlockHash, BlockHashChain, hash_block_tokens
from tokenmill.engine.core.block_pool import BlockPool, KVBlock
from tokenmill.engine.core.kv_cache_manager import KVCacheManager, KVRequest, PrefixCacheStats

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
