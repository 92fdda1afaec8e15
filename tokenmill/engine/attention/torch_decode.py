"""Decode attention in plain torch: every one-token row of a step in a few batched matmuls.

Each decode row's KV blocks are gathered whole (one ``index_select`` per cache, the cheapest
copy there is) into [Bd, W * block_size, Hkv, d], W the widest row's block count. Only the
first L = max seq_len keys are read; keys past a row's own seq_len get -inf from an additive
mask built once per step:

    block_ids (row-major, W = 3 blocks a row, short rows padded with block 0)
        row 0: [ 7  2  9 ]   seq_len 40: its keys are blocks 7, 2, 9 back to back
        row 1: [ 4  0  0 ]   seq_len  5: keys 5.. masked
    key_mask[b, 0, j] = 0 if j < seq_len[b] else -inf              [Bd, 1, W * block_size]

On CPU in fp32 the scores are Hkv batched matmuls, one per KV head, its G = Hq / Hkv query
heads the rows of each matrix:

    scores[h]: [Bd, G, L] = mask + scale * q[:, h] [Bd, G, d] @ K[:, :L, h]^T [Bd, d, L]
    out[h]:    [Bd, G, d] = softmax(scores[h]) @ V[:, :L, h] [Bd, L, d]

K[:, :L, h] is a strided view of the gathered blocks (row stride Hkv * d), which BLAS reads as
is: no transposed copy. SDPA's CPU kernel instead runs a pair of tiny GEMMs per (row, head);
at 1,024 rows of a 2-KV-head, d = 16 model the matmuls take ~0.9 ms a layer against its ~1.45,
and they are on par at d = 64..128 (bench: tests/engine/test_torch_decode.py's shapes).
Elsewhere (CUDA, or half precision, whose scores SDPA accumulates in fp32) one SDPA call over
the same gathered blocks and mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.engine.attention.metadata import CommonAttentionMetadata

__all__ = ["DecodeRows", "build_decode_rows", "decode_attention"]


@dataclass(frozen=True)
class DecodeRows:
    """The step's one-token rows, as ``decode_attention`` reads them.

    token_idx:  slice | [Bd] long   each row's query token in the step (a slice when the
                                    decode rows lead the batch, as the runner orders them)
    block_ids:  [Bd * W] long       row b's blocks at [b * W, (b + 1) * W)
    key_mask:   [Bd, 1, W * bs]     float32, 0 where key j < seq_len[b], -inf past it
    num_keys:   int                 L = the longest row's seq_len; keys past it are not read
    """

    token_idx: torch.Tensor | slice
    block_ids: torch.Tensor
    key_mask: torch.Tensor
    num_keys: int


def build_decode_rows(
    common: CommonAttentionMetadata, rows: np.ndarray, token_starts: np.ndarray
) -> DecodeRows:
    """Decode metadata for ``rows`` (ascending request indices with one query token each,
    at least one); ``token_starts[i]`` is request i's first token in the step."""
    device = common.slot_mapping.device
    bs = common.block_size
    n = len(rows)
    num_keys = int(common.seq_lens_host[rows].max())
    width = -(-num_keys // bs)
    if rows[-1] == n - 1:  # ascending and distinct: rows 0..n-1, so views, no gathers
        token_idx: torch.Tensor | slice = slice(0, n)
        table = common.block_tables[:n, :width]
        lens = common.seq_lens[:n]
    else:
        index = torch.from_numpy(rows).to(device)
        token_idx = torch.from_numpy(token_starts[rows]).to(device)
        table = common.block_tables[index, :width]
        lens = common.seq_lens[index]
    keys = torch.arange(width * bs, device=device)
    key_mask = torch.zeros(n, 1, width * bs, device=device)
    key_mask.masked_fill_(keys >= lens[:, None, None], float("-inf"))
    return DecodeRows(
        token_idx=token_idx,
        block_ids=table.long().reshape(-1),
        key_mask=key_mask,
        num_keys=num_keys,
    )


def decode_attention(
    q: torch.Tensor,  # [Bd, Hq, d]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, d]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, d]
    rows: DecodeRows,
    scale: float,
) -> torch.Tensor:  # [Bd, Hq, d]
    """Attention of each decode row's query over its own cached keys (this step's included)."""
    bd, n_q, d = q.shape
    n_kv = k_cache.shape[2]
    keys = k_cache.index_select(0, rows.block_ids).view(bd, -1, n_kv, d)
    vals = v_cache.index_select(0, rows.block_ids).view(bd, -1, n_kv, d)
    # keys, vals: [Bd, W * bs, Hkv, d]
    if q.device.type != "cpu" or q.dtype != torch.float32:
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [Bd, Hq, 1, d]
            keys.transpose(1, 2),
            vals.transpose(1, 2),
            attn_mask=rows.key_mask.to(q.dtype).unsqueeze(1),  # [Bd, 1, 1, W * bs]
            scale=scale,
            enable_gqa=True,
        )
        return o.squeeze(2)

    length = rows.num_keys
    keys, vals = keys[:, :length], vals[:, :length]  # [Bd, L, Hkv, d]
    mask = rows.key_mask[:, :, :length]  # [Bd, 1, L]
    group = n_q // n_kv
    qh = q.view(bd, n_kv, group, d)
    scores = q.new_empty(n_kv, bd, group, length)
    for h in range(n_kv):
        torch.baddbmm(mask, qh[:, h], keys[:, :, h].transpose(1, 2), alpha=scale, out=scores[h])
    probs = torch.softmax(scores, dim=-1)
    out = q.new_empty(n_kv, bd, group, d)
    for h in range(n_kv):
        torch.bmm(probs[h], vals[:, :, h], out=out[h])
    return out.transpose(0, 1).reshape(bd, n_q, d)
