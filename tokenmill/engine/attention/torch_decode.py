"""Decode attention in plain torch: a step's rows of few query tokens in a few batched matmuls.

A decode row has Q query tokens (1, or its last token and Q - 1 drafts; a short chunk works
the same) at the end of its seq_len keys. Its KV blocks are gathered whole (one
``index_select`` per cache, the cheapest copy there is) into [Bd, W * block_size, Hkv, d],
W the widest row's block count. Only the first L = max seq_len keys are read; queries are
padded to the batch's widest Qm by repeating a row's last one, and an additive mask built
once per step hides each query's future and other rows' padding:

    block_ids (row-major, W = 3 blocks a row, short rows padded with block 0)
        row 0: [ 7  2  9 ]   seq_len 40: its keys are blocks 7, 2, 9 back to back
        row 1: [ 4  0  0 ]   seq_len  5: keys 5.. masked
    key_mask[b, i, j] = 0 if j <= seq_len[b] - Q[b] + min(i, Q[b] - 1) else -inf
                                                               [Bd, Qm, W * block_size]
    row 1 with Q = 3:  query 0  x x x . . .      (keys 0..2; query 2 sees 0..4, as
                       query 2  x x x x x .       does padding query 3)

On CPU in fp32 the scores are Hkv batched matmuls, one per KV head, the Qm x G queries
(G = Hq / Hkv) that share it the rows of each matrix:

    scores[h]: [Bd, Qm * G, L] = mask + scale * q_h [Bd, Qm * G, d] @ K[:, :L, h]^T [Bd, d, L]
    out[h]:    [Bd, Qm * G, d] = softmax(scores[h]) @ V[:, :L, h] [Bd, L, d]

K[:, :L, h] is a strided view of the gathered blocks (row stride Hkv * d), which BLAS reads as
is: no transposed copy. SDPA's CPU kernel instead runs a pair of tiny GEMMs per (row, head):
at 1,024 one-token rows of a 2-KV-head, d = 16 model the matmuls took ~0.9 ms a layer against
SDPA's ~1.45, and about the same at d = 64..128. Elsewhere (CUDA, or half precision, whose
scores SDPA accumulates in fp32) one SDPA call over the same gathered blocks and mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.engine.attention.metadata import CommonAttentionMetadata
from tokenmill.engine.attention.scratch import ScratchBuffers

__all__ = ["MAX_DECODE_QUERY_LEN", "DecodeRows", "build_decode_rows", "decode_attention"]

# Rows of up to this many query tokens (not whole fresh prompts) are batched here; longer
# chunks would pad the batch's other rows too far.
MAX_DECODE_QUERY_LEN = 16


@dataclass(frozen=True)
class DecodeRows:
    """Rows with a few query tokens each, as ``decode_attention`` reads them.

    token_idx:  slice | [Bd * Qm] long  each (row, query) token in the step, padding
                                        repeating the row's last; a slice when every row
                                        has one token and they lead the batch
    out_index:  [n] long | None         the real tokens of token_idx (None when Qm = 1)
    keep:       [Bd * Qm] bool | None   where they sit in it
    block_ids:  [Bd * W] long           row b's blocks at [b * W, (b + 1) * W)
    key_mask:   [Bd, Qm, W * bs]        float32, 0 where query i of row b sees key j
    num_keys:   int                     L = the longest row's seq_len; later keys are not read
    """

    token_idx: torch.Tensor | slice
    out_index: torch.Tensor | None
    keep: torch.Tensor | None
    block_ids: torch.Tensor
    key_mask: torch.Tensor
    num_keys: int

    @property
    def num_queries(self) -> int:
        """Qm, the most query tokens of a row."""
        return self.key_mask.shape[1]


def build_decode_rows(
    common: CommonAttentionMetadata, rows: np.ndarray, token_starts: np.ndarray
) -> DecodeRows:
    """Metadata for ``rows`` (ascending request indices, at least one, each with at most
    MAX_DECODE_QUERY_LEN query tokens); ``token_starts[i]`` is request i's first token."""
    device = common.slot_mapping.device
    bs = common.block_size
    n = len(rows)
    q_lens, seq_lens = common.query_lens_host[rows], common.seq_lens_host[rows]  # [Bd]
    num_queries = int(q_lens.max())
    num_keys = int(seq_lens.max())
    width = -(-num_keys // bs)
    leading = rows[-1] == n - 1  # ascending and distinct: rows 0..n-1
    picked = None if leading else torch.from_numpy(rows).to(device)
    table = common.block_tables[:n] if picked is None else common.block_tables[picked]
    out_index = keep = None
    if num_queries == 1 and leading:
        token_idx: torch.Tensor | slice = slice(0, n)
        visible = common.seq_lens[:n, None]  # [Bd, 1] on the device already
    else:
        pos = np.minimum(np.arange(num_queries), q_lens[:, None] - 1)  # [Bd, Qm]
        index = token_starts[rows, None] + pos
        token_idx = torch.from_numpy(index.reshape(-1)).to(device)
        if num_queries > 1:
            real = np.arange(num_queries) < q_lens[:, None]
            out_index = torch.from_numpy(index[real]).to(device)
            keep = torch.from_numpy(real.reshape(-1)).to(device)
        # the lengths on the device: a row behind a drafted step moved there (sampled_rows.py)
        lens = common.seq_lens[:n] if picked is None else common.seq_lens[picked]
        visible = lens.long()[:, None] + torch.from_numpy(1 + pos - q_lens[:, None]).to(device)
    keys = torch.arange(width * bs, device=device)
    key_mask = torch.zeros(n, num_queries, width * bs, device=device)
    key_mask.masked_fill_(keys >= visible[:, :, None], float("-inf"))
    return DecodeRows(
        token_idx=token_idx,
        out_index=out_index,
        keep=keep,
        block_ids=table[:, :width].to(device=device, dtype=torch.long).reshape(-1),
        key_mask=key_mask,
        num_keys=num_keys,
    )


def decode_attention(
    q: torch.Tensor,  # [T, Hq, d], the whole step
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, d]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, d]
    rows: DecodeRows,
    scale: float,
    out: torch.Tensor,  # [T, Hq, d]
    scratch: ScratchBuffers,
) -> None:
    """Attention of the rows' queries over their own cached keys (this step's included),
    written into their tokens of ``out``; the CPU path keeps its temporaries in ``scratch``."""
    _, n_q, d = q.shape
    _, bs, n_kv, _ = k_cache.shape
    bd, qm = rows.key_mask.shape[:2]
    qr = q[rows.token_idx].view(bd, qm, n_q, d)
    if q.device.type != "cpu" or q.dtype != torch.float32:
        keys = k_cache.index_select(0, rows.block_ids).view(bd, -1, n_kv, d).to(q.dtype)
        vals = v_cache.index_select(0, rows.block_ids).view(bd, -1, n_kv, d).to(q.dtype)
        # keys, vals: [Bd, W * bs, Hkv, d]
        o = F.scaled_dot_product_attention(
            qr.transpose(1, 2),  # [Bd, Hq, Qm, d]
            keys.transpose(1, 2),
            vals.transpose(1, 2),
            attn_mask=rows.key_mask.to(q.dtype).unsqueeze(1),  # [Bd, 1, Qm, W * bs]
            scale=scale,
            enable_gqa=True,
        ).transpose(1, 2)  # [Bd, Qm, Hq, d]
        _write(out, o, rows)
        return

    blocks = (len(rows.block_ids), bs, n_kv, d)
    keys = _gather(k_cache, rows.block_ids, scratch.get("k", blocks, q))
    vals = _gather(v_cache, rows.block_ids, scratch.get("v", blocks, q))
    length = rows.num_keys
    keys = keys.view(bd, -1, n_kv, d)[:, :length]  # [Bd, L, Hkv, d], strided
    vals = vals.view(bd, -1, n_kv, d)[:, :length]
    group = n_q // n_kv
    mask = rows.key_mask[:, :, :length]  # [Bd, Qm, L]
    if qm > 1:
        mask = mask.repeat_interleave(group, dim=1)  # [Bd, Qm * G, L], (query, head) order
    qh = qr.view(bd, qm, n_kv, group, d)
    scores = scratch.get("scores", (n_kv, bd, qm * group, length), q)
    for h in range(n_kv):
        q_h = qh[:, :, h].reshape(bd, qm * group, d)  # a view when Qm = 1
        torch.baddbmm(mask, q_h, keys[:, :, h].transpose(1, 2), alpha=scale, out=scores[h])
    probs = torch.softmax(scores, dim=-1, out=scratch.get("probs", scores.shape, q))
    # bmm into a strided output falls back to one matmul per row: a contiguous one first
    oh = scratch.get("out", (n_kv, bd, qm * group, d), q)
    for h in range(n_kv):
        torch.bmm(probs[h], vals[:, :, h], out=oh[h])
    _write(out, oh.view(n_kv, bd, qm, group, d).permute(1, 2, 0, 3, 4), rows)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
    """The blocks ``block_ids`` of ``cache`` in ``into`` (the model's dtype; an FP8 cache is
    converted on the way)."""
    if cache.dtype == into.dtype:
        return torch.index_select(cache, 0, block_ids, out=into)
    return into.copy_(cache.index_select(0, block_ids))


def _write(out: torch.Tensor, o: torch.Tensor, rows: DecodeRows) -> None:
    """o: [Bd, Qm, Hq, d] (any strides; Hq may still be split as Hkv, G) into out's tokens."""
    if rows.keep is None:  # Qm = 1: one token a row
        if isinstance(rows.token_idx, slice):
            out[rows.token_idx].view(o.shape).copy_(o)
        else:
            out[rows.token_idx] = o.reshape(-1, *out.shape[1:])
    else:
        out[rows.out_index] = o.reshape(-1, *out.shape[1:])[rows.keep]
