"""Paged attention with the Triton kernels (the GPU path).

Per layer: the step's K/V go into the paged cache (``store_kv``), then either
  * decode-only steps (every request has one query token): split-K flash-decoding over each
    request's blocks, all query heads of a KV head's GQA group together; or
  * any step with a prefill chunk: the varlen prefill kernel, which also serves the decode
    rows mixed into that step (a query of length 1 is just a short chunk).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.engine.attention.metadata import CommonAttentionMetadata


@dataclass(frozen=True)
class TritonAttentionMetadata:
    common: CommonAttentionMetadata
    decode_only: bool
    num_splits: int


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, num_kv_heads: int) -> None:
        # Imported here so the CPU path never needs Triton.
        from tokenmill.kernels.kv_store import store_kv
        from tokenmill.kernels.paged_decode_attention import paged_decode_attention
        from tokenmill.kernels.paged_prefill_attention import paged_prefill_attention

        self._store_kv = store_kv
        self._decode = paged_decode_attention
        self._prefill = paged_prefill_attention
        self.num_kv_heads = num_kv_heads
        self.split_keys = 0  # set by set_max_model_len

    def set_max_model_len(self, max_model_len: int) -> None:
        """Fix decode's split-K boundaries for this engine: every request's keys split at
        multiples of ``split_keys``, so its result depends on nothing but its own length
        (eager and CUDA-graph steps, any batch, give the same tokens). At most 8 splits a
        request at the longest context; at least 256 keys a split."""
        self.split_keys = max(256, -(-max_model_len // 8))

    def build(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        decode_only = common.max_query_len == 1
        splits = 1
        if decode_only:
            splits = max(1, -(-common.max_seq_len // self.split_keys))
        return TritonAttentionMetadata(common, decode_only, splits)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: TritonAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        c = meta.common
        self._store_kv(k, v, k_cache, v_cache, c.slot_mapping)
        if meta.decode_only:
            return self._decode(
                q,
                k_cache,
                v_cache,
                c.block_tables,
                c.seq_lens,
                scale,
                meta.num_splits,
                split_keys=self.split_keys,
            )
        return self._prefill(
            q,
            k_cache,
            v_cache,
            c.block_tables,
            c.query_start_loc,
            c.seq_lens,
            c.max_query_len,
            scale,
        )
