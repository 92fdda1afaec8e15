"""What every attention backend is told about a step (built once per step by the runner).

A step is a flat batch of ``num_tokens`` query tokens from ``B`` requests:

    tokens:           [ r0 r0 r0 r0 | r1 | r2 r2 ]      query_start_loc = [0, 4, 5, 7]
    request r0 seq:   [ cached/computed ... | 4 new ]   seq_lens[0] = context incl. new tokens
    block_tables[b]:  the request's KV block ids, padded with 0 to the batch's widest row
    slot_mapping[t]:  block_tables[b][pos // block_size] * block_size + pos % block_size

The runner puts decode rows first: a request's last token, and its draft tokens when it has
some (a multi-token step: 1 + k query tokens, all of its keys but those computed already). A
backend can send the leading ``num_decodes`` rows to a decode kernel and the rest (prefill
chunks) to a prefill kernel. A captured CUDA graph may left-pad every decode row to the same
query length; a padding token has slot -1 (nothing stored) and its output is not read.

A row with a tree of drafts (engine/core/draft_tree.py) is not a decode row: its tokens
see only their own branch, as ``tree_mask`` says per token (bit j: the row's step token j;
-1: plain causal, every other token), so a backend sends it where that mask is applied.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class CommonAttentionMetadata:
    # device tensors
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    # host copies the scheduler already knows (no device reads needed)
    query_lens_host: np.ndarray  # [B] int
    seq_lens_host: np.ndarray  # [B] int
    block_size: int
    num_decodes: int  # leading decode rows (see above)
    tree_mask: torch.Tensor | None = None  # [num_tokens] int64, when a row has a tree
    tree_mask_host: np.ndarray | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.query_lens_host.sum())

    @property
    def max_query_len(self) -> int:
        return int(self.query_lens_host.max(initial=0))

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens_host.max(initial=0))

    @property
    def max_decode_query_len(self) -> int:
        """Most query tokens of a decode row: 1 + the most draft tokens (0 without decodes)."""
        return int(self.query_lens_host[: self.num_decodes].max(initial=0))
