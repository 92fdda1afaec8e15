"""Paged attention in plain torch: the reference backend and the CPU path.

Rows of one query token, and rows of a few (a request's last token and its drafts, or a short
chunk), run batched in ``torch_decode``: their blocks gathered, each query's invisible keys
masked, in batched matmuls (CPU, fp32) or one SDPA call. Fresh prefills (the whole sequence is
this step's tokens) are padded into groups of similar length and run as one causal SDPA call a
group. Longer chunks that continue a cached prefix or an earlier chunk run one SDPA call each
with a causal mask offset by the cached part:

    keys:     0 1 2 3 4 5 6        (seq_len = 7, 3 cached + 4 new)
    query 3:  x x x x . . .        query i sees keys j <= seq_len - q_len + i
    query 6:  x x x x x x x

A row with a tree of drafts runs that way too, its mask narrowed to each token's branch
(``tree_mask``, kernels/tree_mask.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.engine.attention.interface import AttentionBackend
from tokenmill.engine.attention.metadata import CommonAttentionMetadata
from tokenmill.engine.attention.scratch import ScratchBuffers
from tokenmill.engine.attention.torch_decode import (
    MAX_DECODE_QUERY_LEN,
    DecodeRows,
    build_decode_rows,
    decode_attention,
)
from tokenmill.kernels.fp8_kv import to_kv_cache
from tokenmill.kernels.tree_mask import tree_visible

__all__ = ["TorchAttentionBackend", "TorchAttentionMetadata"]


@dataclass(frozen=True)
class PrefillRow:
    token_start: int
    token_end: int
    seq_len: int
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)]
    mask: torch.Tensor  # [q_len, seq_len] bool: causal, offset by the cached part


@dataclass(frozen=True)
class FreshPrefillGroup:
    """G requests whose whole sequence is this step's tokens, run as one causal SDPA call over
    [G, H, L, d]. Rows shorter than L are padded: a padded query row only sees keys at or
    before it, so the real rows never see padding; the padding rows' outputs are dropped.

        token_index: [G, L]  flat token index of (request, position); padding -> the row's first
        out_index:   [n]     flat token index of every real (request, position)
        keep:        [G * L] True at real positions (row-major), selecting them from the output

    When all G requests have length L and sit back to back in the step, the group is the token
    span [start, start + G * L), already in (request, position) order: the three index tensors
    are None and views of q, k, v and the output replace the gathers.
    """

    start: int
    shape: tuple[int, int]  # (G, L)
    token_index: torch.Tensor | None = None
    out_index: torch.Tensor | None = None
    keep: torch.Tensor | None = None


# Group fresh prefills so that one group's [G, H, L, L] score tiles stay moderate.
_MAX_GROUP_TOKENS = 1 << 14


@dataclass(frozen=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [T]
    decodes: tuple[DecodeRows, ...]  # one-token rows; rows of a few tokens (drafts)
    prefills: tuple[PrefillRow, ...]  # longer chunks continuing a cached prefix
    fresh_groups: tuple[FreshPrefillGroup, ...] = ()


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    max_decode_query_len = MAX_DECODE_QUERY_LEN

    def __init__(self) -> None:
        self.scratch = ScratchBuffers()

    def build(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        device = common.slot_mapping.device
        bs = common.block_size
        query_lens = common.query_lens_host
        seq_lens = common.seq_lens_host
        starts = np.zeros(len(query_lens) + 1, dtype=np.int64)  # [B + 1] token offsets
        np.cumsum(query_lens, out=starts[1:])
        tree = _tree_rows(common.tree_mask_host, starts)  # [B] rows with a tree of drafts
        fresh = (seq_lens == query_lens) & (query_lens > 1) & ~tree
        few = ~fresh & ~tree & (query_lens > 1) & (query_lens <= MAX_DECODE_QUERY_LEN)
        batches = [np.flatnonzero(query_lens == 1), np.flatnonzero(few)]

        prefills = []
        long = ~fresh & (query_lens > MAX_DECODE_QUERY_LEN)
        for i in np.flatnonzero(long | tree).tolist():
            q_len, seq_len, start = int(query_lens[i]), int(seq_lens[i]), int(starts[i])
            q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
            mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
            if tree[i]:
                masks = common.tree_mask[start : start + q_len]
                mask = mask & tree_visible(masks, seq_len - q_len, seq_len)
            prefills.append(
                PrefillRow(
                    token_start=start,
                    token_end=start + q_len,
                    seq_len=seq_len,
                    block_ids=common.block_tables[i, : -(-seq_len // bs)].long(),
                    mask=mask,
                )
            )
        return TorchAttentionMetadata(
            slot_mapping=common.slot_mapping,
            decodes=tuple(build_decode_rows(common, rows, starts) for rows in batches if len(rows)),
            prefills=tuple(prefills),
            fresh_groups=_fresh_groups(np.flatnonzero(fresh), starts, query_lens, device),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: TorchAttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        if kv_stored:  # this backend names no rope_kv_slots: nothing else stores its K/V
            raise ValueError("the torch attention backend stores K/V itself (kv_stored given)")
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [NB, BS, Hkv, d]
        n_q, n_kv, d = q.shape[1], k.shape[1], k.shape[2]
        _store(k_cache, meta.slot_mapping, k)
        _store(v_cache, meta.slot_mapping, v)
        if out is None:
            out = torch.empty_like(q)

        for rows in meta.decodes:
            decode_attention(q, k_cache, v_cache, rows, scale, out, self.scratch)

        for group in meta.fresh_groups:
            g, length = group.shape
            if group.token_index is None:
                span = slice(group.start, group.start + g * length)
                # [G * L, H, d] -> [G, H, L, d], views
                qg, kg, vg = (x[span].view(g, length, -1, d).transpose(1, 2) for x in (q, k, v))
            else:
                idx = group.token_index
                qg, kg, vg = (x[idx].transpose(1, 2) for x in (q, k, v))  # [G, H, L, d]
            o = F.scaled_dot_product_attention(
                qg, kg, vg, is_causal=True, scale=scale, enable_gqa=True
            ).transpose(1, 2)  # [G, L, Hq, d]
            if group.token_index is None:
                out[span].view(g, length, n_q, d).copy_(o)
            else:
                out[group.out_index] = o.reshape(g * length, n_q, d)[group.keep]

        for row in meta.prefills:
            qr = q[row.token_start : row.token_end].transpose(0, 1)  # [Hq, q_len, d]
            kr = k_cache.index_select(0, row.block_ids).view(-1, n_kv, d)[: row.seq_len]
            vr = v_cache.index_select(0, row.block_ids).view(-1, n_kv, d)[: row.seq_len]
            kr, vr = kr.to(q.dtype), vr.to(q.dtype)  # an FP8 cache: back to the model's dtype
            o = F.scaled_dot_product_attention(
                qr.unsqueeze(0),
                kr.transpose(0, 1).unsqueeze(0),
                vr.transpose(0, 1).unsqueeze(0),
                attn_mask=row.mask,
                scale=scale,
                enable_gqa=True,
            )
            out[row.token_start : row.token_end] = o[0].transpose(0, 1)
        return out


def _tree_rows(tree_mask: np.ndarray | None, starts: np.ndarray) -> np.ndarray:
    """[B] whether each row has a token with a tree mask (not -1)."""
    if tree_mask is None:
        return np.zeros(len(starts) - 1, dtype=np.bool_)
    seen = np.concatenate([[0], np.cumsum(tree_mask != -1)])
    return seen[starts[1:]] > seen[starts[:-1]]


def _fresh_groups(
    rows: np.ndarray, starts: np.ndarray, query_lens: np.ndarray, device: torch.device
) -> tuple[FreshPrefillGroup, ...]:
    """Batch fresh prefills by similar length (sorted), each group under _MAX_GROUP_TOKENS
    padded tokens, so one SDPA call serves many requests."""
    order = rows[np.argsort(query_lens[rows], kind="stable")]
    lens = query_lens[order].tolist()
    groups: list[FreshPrefillGroup] = []
    begin = 0
    while begin < len(order):
        end = begin + 1  # lens ascend, so the group's padded length is lens[end - 1]
        while end < len(order) and (end - begin + 1) * lens[end] <= _MAX_GROUP_TOKENS:
            end += 1
        groups.append(_fresh_group(order[begin:end], starts, query_lens, device))
        begin = end
    return tuple(groups)


def _fresh_group(
    batch: np.ndarray, starts: np.ndarray, query_lens: np.ndarray, device: torch.device
) -> FreshPrefillGroup:
    lens, first = query_lens[batch], starts[batch]  # [G]
    length = int(lens.max())
    shape = (len(batch), length)
    if (lens == length).all() and (np.diff(first) == length).all():
        return FreshPrefillGroup(start=int(first[0]), shape=shape)
    pos = np.arange(length)
    keep = pos[None, :] < lens[:, None]  # [G, L]
    index = np.where(keep, first[:, None] + pos[None, :], first[:, None])
    return FreshPrefillGroup(
        start=int(first[0]),
        shape=shape,
        token_index=torch.from_numpy(index).to(device),
        out_index=torch.from_numpy(index[keep]).to(device),
        keep=torch.from_numpy(keep.reshape(-1)).to(device),
    )


def _store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Write ``x`` [T, Hkv, d] into the flat slots of ``cache`` [NB, BS, Hkv, d], rounded as
    the cache holds it (an FP8 cache: through a byte view, as CPU index_copy_ has no fp8)."""
    flat = cache.view(-1, *cache.shape[2:])
    x = to_kv_cache(x, cache.dtype)
    if cache.dtype == torch.float8_e4m3fn:
        flat, x = flat.view(torch.uint8), x.view(torch.uint8)
    flat.index_copy_(0, slots, x)
