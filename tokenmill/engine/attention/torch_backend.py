"""Paged attention in plain torch: the reference backend and the CPU path.

Decode rows (one query token) are batched: their block tables gather K/V into a padded
[Bd, L, Hkv, d] view, masked past each row's length, and one SDPA call covers them all.
Prefill rows (several query tokens, possibly starting mid-sequence after a prefix-cache hit
or an earlier chunk) run one SDPA call each with a causal mask offset by the cached part:

    keys:     0 1 2 3 4 5 6        (seq_len = 7, 3 cached + 4 new)
    query 3:  x x x x . . .        query i sees keys j <= seq_len - q_len + i
    query 6:  x x x x x x x
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.engine.attention.metadata import CommonAttentionMetadata


@dataclass(frozen=True)
class PrefillRow:
    token_start: int
    token_end: int
    seq_len: int
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)]
    mask: torch.Tensor | None  # [q_len, seq_len] bool; None when the whole sequence is new


@dataclass(frozen=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [T]
    decode_token_idx: torch.Tensor | slice | None  # [Bd] token index of each decode row
    decode_block_tables: torch.Tensor | None  # [Bd, max_blocks]
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, max_blocks * block_size] bool
    prefills: tuple[PrefillRow, ...]


class TorchAttentionBackend:
    name = "torch"

    def build(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        device = common.slot_mapping.device
        bs = common.block_size
        decode_rows = [i for i, q in enumerate(common.query_lens_host) if q == 1]
        starts = [0]
        for q in common.query_lens_host:
            starts.append(starts[-1] + q)

        decode_idx = decode_bt = decode_mask = None
        if decode_rows:
            rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
            width = -(-max(common.seq_lens_host[i] for i in decode_rows) // bs)
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
        for i, q_len in enumerate(common.query_lens_host):
            if q_len == 1:
                continue
            seq_len = common.seq_lens_host[i]
            mask = None
            if seq_len != q_len:
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

        for row in meta.prefills:
            qr = q[row.token_start : row.token_end].transpose(0, 1)  # [Hq, q_len, d]
            if row.mask is None:  # the whole sequence is this step's tokens
                kr = k[row.token_start : row.token_end]
                vr = v[row.token_start : row.token_end]
            else:
                kr = k_cache.index_select(0, row.block_ids).view(-1, n_kv, d)[: row.seq_len]
                vr = v_cache.index_select(0, row.block_ids).view(-1, n_kv, d)[: row.seq_len]
            o = F.scaled_dot_product_attention(
                qr.unsqueeze(0),
                kr.transpose(0, 1).unsqueeze(0),
                vr.transpose(0, 1).unsqueeze(0),
                attn_mask=row.mask,
                is_causal=row.mask is None,
                scale=scale,
                enable_gqa=True,
            )
            out[row.token_start : row.token_end] = o[0].transpose(0, 1)
        return out
