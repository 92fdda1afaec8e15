"""Paged attention in plain torch: the reference backend and the CPU path.

Decode rows (one query token) are batched: their block tables gather K/V into a padded
[Bd, L, Hkv, d] view, masked past each row's length, and one SDPA call covers them all.
Fresh prefills (the whole sequence is this step's tokens) are padded into groups of similar
length and run as one causal SDPA call a group. Prefill rows that continue a cached prefix or
an earlier chunk run one SDPA call each with a causal mask offset by the cached part:

    keys:     0 1 2 3 4 5 6        (seq_len = 7, 3 cached + 4 new)
    query 3:  x x x x . . .        query i sees keys j <= seq_len - q_len + i
    query 6:  x x x x x x x
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.engine.attention.interface import AttentionBackend
from tokenmill.engine.attention.metadata import CommonAttentionMetadata


@dataclass(frozen=True)
class PrefillRow:
    token_start: int
    token_end: int
    seq_len: int
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)]
    mask: torch.Tensor  # [q_len, seq_len] bool: causal, offset by the cached part


@dataclass(frozen=True)
class FreshPrefillGroup:
    """Requests whose whole sequence is this step's tokens, padded to one length L and run
    as one causal SDPA call. A padded query row only sees keys at or before it, so the real
    rows never see padding; the padding rows' outputs are dropped.

        token_index: [G, L]  flat token index of (request, position); padding -> the row's first
        out_index:   [n]     flat token index of every real (request, position)
        keep:        [G * L] True at real positions (row-major), selecting them from the output
    """

    token_index: torch.Tensor
    out_index: torch.Tensor
    keep: torch.Tensor


# Group fresh prefills so that one group's [G, H, L, L] score tiles stay moderate.
_MAX_GROUP_TOKENS = 1 << 14


@dataclass(frozen=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [T]
    decode_token_idx: torch.Tensor | slice | None  # [Bd] token index of each decode row
    decode_block_tables: torch.Tensor | None  # [Bd, max_blocks]
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, max_blocks * block_size] bool
    prefills: tuple[PrefillRow, ...]  # rows continuing a cached or earlier-computed prefix
    fresh_groups: tuple[FreshPrefillGroup, ...] = ()


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def build(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        device = common.slot_mapping.device
        bs = common.block_size
        query_lens = common.query_lens_host.tolist()
        seq_lens = common.seq_lens_host.tolist()
        decode_rows = [i for i, q in enumerate(query_lens) if q == 1]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)

        decode_idx = decode_bt = decode_mask = None
        if decode_rows:
            rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
            width = -(-max(seq_lens[i] for i in decode_rows) // bs)
            if decode_rows == list(range(len(decode_rows))):
                decode_idx = slice(0, len(decode_rows))  # decode rows lead: a view, no gather
            else:
                decode_idx = torch.tensor(
                    [starts[i] for i in decode_rows], dtype=torch.long, device=device
                )
            decode_bt = common.block_tables[rows, :width].long()
            lens = common.seq_lens[rows].long()
            keys = torch.arange(width * bs, device=device)
            decode_mask = (keys[None, :] < lens[:, None])[:, None, None, :]

        prefills = []
        fresh: list[int] = []
        for i, q_len in enumerate(query_lens):
            if q_len == 1:
                continue
            seq_len = seq_lens[i]
            if seq_len == q_len:
                fresh.append(i)
                continue
            q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
            mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
            prefills.append(
                PrefillRow(
                    token_start=starts[i],
                    token_end=starts[i] + q_len,
                    seq_len=seq_len,
                    block_ids=common.block_tables[i, : -(-seq_len // bs)].long(),
                    mask=mask,
                )
            )
        return TorchAttentionMetadata(
            slot_mapping=common.slot_mapping,
            decode_token_idx=decode_idx,
            decode_block_tables=decode_bt,
            decode_mask=decode_mask,
            prefills=tuple(prefills),
            fresh_groups=_fresh_groups(fresh, starts, query_lens, device),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [NB, BS, Hkv, d]
        n_kv, d = k.shape[1], k.shape[2]
        k_cache.view(-1, n_kv, d).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, n_kv, d).index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)

        if meta.decode_token_idx is not None:
            bt = meta.decode_block_tables
            b = bt.shape[0]
            flat = bt.flatten()  # index_select copies whole blocks: ~2x faster than k_cache[bt]
            keys = k_cache.index_select(0, flat).view(b, -1, n_kv, d).transpose(1, 2)
            vals = v_cache.index_select(0, flat).view(b, -1, n_kv, d).transpose(1, 2)
            # keys, vals: [Bd, Hkv, L, d]
            qd = q[meta.decode_token_idx].unsqueeze(2)  # [Bd, Hq, 1, d]
            o = F.scaled_dot_product_attention(
                qd, keys, vals, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
            )
            out[meta.decode_token_idx] = o.squeeze(2)

        for group in meta.fresh_groups:
            g, length = group.token_index.shape
            idx = group.token_index
            # [G, L, H, d] -> [G, H, L, d]
            qg, kg, vg = (x[idx].transpose(1, 2) for x in (q, k, v))
            o = F.scaled_dot_product_attention(
                qg, kg, vg, is_causal=True, scale=scale, enable_gqa=True
            )  # [G, Hq, L, d]
            o = o.transpose(1, 2).reshape(g * length, q.shape[1], d)
            out[group.out_index] = o[group.keep]

        for row in meta.prefills:
            qr = q[row.token_start : row.token_end].transpose(0, 1)  # [Hq, q_len, d]
            kr = k_cache.index_select(0, row.block_ids).view(-1, n_kv, d)[: row.seq_len]
            vr = v_cache.index_select(0, row.block_ids).view(-1, n_kv, d)[: row.seq_len]
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


def _fresh_groups(
    rows: list[int], starts: list[int], query_lens: list[int], device: torch.device
) -> tuple[FreshPrefillGroup, ...]:
    """Batch fresh prefills by similar length (sorted), each group under _MAX_GROUP_TOKENS
    padded tokens, so one SDPA call serves many requests."""
    groups: list[FreshPrefillGroup] = []
    batch: list[int] = []
    for i in sorted(rows, key=lambda r: query_lens[r]) + [-1]:
        if batch and (i < 0 or (len(batch) + 1) * query_lens[i] > _MAX_GROUP_TOKENS):
            length = max(query_lens[r] for r in batch)
            pos = torch.arange(length)
            lens = torch.tensor([query_lens[r] for r in batch])
            first = torch.tensor([starts[r] for r in batch])
            keep = pos[None, :] < lens[:, None]  # [G, L]
            index = torch.where(keep, first[:, None] + pos[None, :], first[:, None])
            groups.append(
                FreshPrefillGroup(
                    token_index=index.to(device),
                    out_index=index[keep].to(device),
                    keep=keep.flatten().to(device),
                )
            )
            batch = []
        if i >= 0:
            batch.append(i)
    return tuple(groups)
