"""Paged decode attention: flash-decoding (split-K) over a paged KV cache, and its reference.

A decode request has one query token, or a few: its last token and k draft tokens after it
(multi-token steps, speculative decoding). Its keys/values live in fixed-size cache blocks
named by its row of ``block_tables``. Shapes (T query tokens of B requests; T = B when every
request has one):

    q             [T, Hq, d]                 query tokens, request by request (any strides)
    query_start_loc [B + 1] int32            request b's tokens are rows qsl[b] .. qsl[b+1]-1
                                             (None: one token a request, row b)
    k/v_cache     [num_blocks, BS, Hkv, d]   e.g. kv_cache[0] / kv_cache[1] of the engine's
                                             [2, num_blocks, BS, Hkv, d] (strides are used)
    block_tables  [B, max_blocks] int32      cache block of each BS-token slice of a request
    seq_lens      [B] int32                  keys per request, its query tokens' own included
    out           [T, Hq, d]
    workspace     partial_out [T, Hq, S, d] fp32, lse [T, Hq, S] fp32   (S = num_splits,
                  the most splits of a request; P = split_programs <= S share them)

Query token i of a request with q tokens sees keys j < seq_len - q + 1 + i (causal: the last
one sees every key, the first all but the q - 1 after it):

    keys:        0 1 2 3 4 5 6          seq_len = 7, q = 3 (the last known token, 2 drafts)
    query 0 (p4) x x x x x . .
    query 2 (p6) x x x x x x x

Algorithm (two kernels, grid sized from B, Hkv, P, S only, so the launch is CUDA-graph safe):

1. ``_split_kernel``, grid (B, Hkv, P). The request's keys are cut into splits (below);
   program (b, h, p) takes request b, KV head h and the p-th run of consecutive splits
   (cdiv(splits, P) of them), for all G = Hq // Hkv query heads of that KV head and all q
   query tokens of the request at once (a tile of q * G query rows): every K/V tile is read
   from HBM once per request and GQA group, not once per head or token. Keys are walked in
   tiles of BLOCK_N rows; an online softmax in fp32 keeps the running max m, sum l and
   output acc; at each split's last tile the program stores acc / l and lse = m + log(l)
   for that split and starts afresh, as a program of the split's own would: the bits do
   not depend on P. A query token that sees none of a split's keys stores lse = -inf and
   a zero output.
2. ``_merge_kernel``, grid (B, Hq): for each query token of request b, out = sum_s
   exp(lse_s - M) * o_s / sum_s exp(lse_s - M) over the request's own splits (the
   workspace past them is never read), in one pass split after split (a running max M
   rescales what came before: ``_fold_split``); -inf splits weigh 0, and an empty request
   (seq_len 0, a padded graph row) gets zeros rather than NaN. With S == 1 the split kernel
   writes ``out`` itself, and with P == 1 (a full batch) each program folds its splits in
   registers as they end, with the same ops, and writes ``out``: no workspace traffic and
   no second kernel.

Splitting is per request, so a short request is not split into a long request's slices and
the result of a request never depends on the rest of the batch (or on block_tables' width):
either fixed splits (``split_keys``, the engine's), SPLITS_PER_TIER of split_keys keys from
the sequence start, then as many of twice that, and so on (a request's result then depends
on its own length alone, whatever S and P), or its n_tiles = cdiv(seq_len, BLOCK_N) key
tiles cut into S runs of cdiv(n_tiles, S) tiles.
Example: seq_len = 19, BLOCK_SIZE = 4, BLOCK_N = 8, S = 4 -> 3 tiles, 1 tile per split:

    token             0..3    4..7    8..11   12..15  16..18
    block_tables[b]  [   7   |   2   |   9   |   4   |  5 x  ]   x: past seq_len, masked
    key tile         [      t0       |      t1       |  t2   ]
    split            [      s0       |      s1       |  s2   ]   s3: none (never merged)
    program (P = 2)  [             p0                |  p1   ]

A tile may span several cache blocks (BS < BLOCK_N: every row looks up its own block id) or
sit inside one (BS % BLOCK_N == 0: one block id per tile). Rows of a tile are d contiguous
elements, Hkv * d apart within a block: BLOCK_N coalesced rows per load.

Scores use ``tl.dot`` on a [R_PAD, d] query tile (R = Q_MAX * G query rows, R_PAD =
max(16, next_pow2(R)); rows past a request's tokens are zero and never stored) against the
[BLOCK_N, d] key tile, and [R_PAD, BLOCK_N] @ [BLOCK_N, d] for the values. Padding R = 1..8
to 16 wastes tensor-core work, but decode is bandwidth bound (~16 FLOP per KV byte against a
bf16 ridge of ~190), and the alternative, a broadcast-multiply-sum over a [G, BLOCK_N, d]
register tile, spills registers for G > 1.
The same padding makes a few draft tokens nearly free: G = 3 with 1 + 4 tokens is 15 rows.

An FP8 cache (``kv_cache_dtype: fp8``) halves the bytes, but turning e4m3 into bf16 takes
several instructions a value while e4m3 -> fp16 is one hardware conversion per pair (sm_89+);
with bf16 the B=256, 4k-context step read its half bytes no faster than bf16 read its full
ones (0.916 against 0.962 ms on the H200). So with a 16-bit q the scores and P @ V run in fp16:
e4m3 values are exact in fp16, P in [0, 1] keeps more bits there than in bf16, and q is
clamped to fp16's range (+-65504) before its one conversion.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from tokenmill.kernels.launch_log import launch
from tokenmill.kernels.paged_inputs import check_paged_inputs
from tokenmill.kernels.tile_block_ids import tile_block_ids

__all__ = [
    "DecodeWorkspace",
    "choose_num_splits",
    "choose_split_programs",
    "fixed_split_count",
    "paged_decode_attention",
    "paged_decode_attention_ref",
]

_LOG2E = 1.4426950408889634
_LN2 = tl.constexpr(0.6931471805599453)
MAX_SPLITS = 64
WORKSPACE_DTYPE = torch.float32  # the split partials (DecodeWorkspace)
# Fixed splits (``split_keys``) grow with the key position: SPLITS_PER_TIER of split_keys
# keys, then as many twice as long, ... (256-key splits: 8 up to 2,048 keys, 512 up to 6,144,
# 35 splits cover 40,960), so short requests split finely and a long context still needs few.
TIER_SPLITS = 8
SPLITS_PER_TIER = tl.constexpr(TIER_SPLITS)  # the kernels' name for it
# Programs a SM that choose_split_programs aims at (enough loads in flight to fill HBM).
PROGRAMS_PER_SM = 4
# An FP8 cache's tiles take half the bytes and a conversion each: on the H200 (B=256, 4k
# keys, block_n 64) 2 warps read it at 77-87% of the copy ceiling where 4 read 52-62%
# (session 14, BENCHMARKS.md). A bf16 cache at 4 warps is at the ceiling already.
FP8_NUM_WARPS = 2
MIN_TOKENS_PER_SPLIT = 256  # below this, a split's fixed cost (q load, merge) outweighs its keys


@triton.jit
def _query_tokens(qsl_ptr, b, QUERY_MAX: tl.constexpr):
    """(first row, count) of request b's query tokens: row b alone when QUERY_MAX == 1."""
    if QUERY_MAX == 1:
        q_start = b
        q_len = tl.full([], 1, tl.int32)  # a tensor either way (a jit function's result)
    else:
        q_start = tl.load(qsl_ptr + b)
        q_len = tl.load(qsl_ptr + b + 1) - q_start
    return q_start, q_len


@triton.jit
def _split_start(split, base_tiles, growing):
    """First key tile of a request's split ``split``: splits of ``base_tiles`` tiles, or
    (``growing``) SPLITS_PER_TIER of them, then SPLITS_PER_TIER twice as long, and so on."""
    tier = tl.where(growing, split // SPLITS_PER_TIER, 0)
    in_tier = split - tier * SPLITS_PER_TIER
    return base_tiles * (SPLITS_PER_TIER * ((1 << tier) - 1) + in_tier * (1 << tier))


@triton.jit
def _split_of_tile(tile, base_tiles, growing):
    """The split holding key tile ``tile`` (>= 0), the inverse of _split_start. Tile t is in
    tier k when 2^k <= u < 2^(k+1), u = t // (base * SPLITS_PER_TIER) + 1: k = floor(log2 u),
    from a float log2 corrected by one either way (u < 2^24 is exact in float32)."""
    u = tile // (base_tiles * SPLITS_PER_TIER) + 1
    tier = tl.floor(tl.log2(u.to(tl.float32))).to(tl.int32)
    tier = tl.where((1 << (tier + 1)) <= u, tier + 1, tier)
    tier = tl.where((1 << tier) > u, tier - 1, tier)
    tier = tl.where(growing, tier, 0)
    first = base_tiles * SPLITS_PER_TIER * ((1 << tier) - 1)
    return tier * SPLITS_PER_TIER + (tile - first) // (base_tiles << tier)


@triton.jit
def _split_geometry(seq_len, num_splits, split_tiles, BLOCK_N: tl.constexpr):
    """(key tiles read, splits, their base length in tiles, growing) of a request with
    ``seq_len`` keys: the fixed, growing splits of ``split_tiles`` tiles (see _split_start),
    or (split_tiles == 0) its tiles cut into num_splits equal runs. Never more than
    num_splits splits (the workspace's width): fixed splits that do not cover the request
    leave its keys past them unread (the caller's error)."""
    n_tiles = tl.cdiv(seq_len, BLOCK_N)
    growing = split_tiles > 0
    base = tl.where(growing, split_tiles, tl.maximum(tl.cdiv(n_tiles, num_splits), 1))
    n_splits = tl.where(n_tiles > 0, _split_of_tile(n_tiles - 1, base, growing) + 1, 0)
    n_splits = tl.minimum(n_splits, num_splits)
    read = tl.minimum(n_tiles, _split_start(n_splits, base, growing))
    return read, n_splits, base, growing


@triton.jit(do_not_specialize=["max_blocks", "num_splits", "split_tiles", "stride_btb"])
def _split_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, o_ptr, lse_ptr, out_ptr,
    # sizes
    qk_scale,  # softmax scale * log2(e): scores are exponentiated with exp2
    max_blocks,  # block_tables.shape[1]
    num_splits,  # not a constexpr: callers pick it per step, that must not recompile
    split_tiles,  # > 0: every split covers this many tiles from the sequence start (fixed
    #               boundaries: a request's result depends only on its own length); 0: each
    #               request's tiles are divided into num_splits equal runs
    # strides
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_btb, stride_btn,
    stride_ob, stride_oh, stride_os, stride_od,  # partial_out, or out itself when S == 1
    stride_lb, stride_lh, stride_ls,
    stride_yb, stride_yh, stride_yd,  # out (read with FUSE_MERGE only)
    # meta-parameters
    GROUP: tl.constexpr,  # query heads per KV head
    QUERY_MAX: tl.constexpr,  # most query tokens of one request (1: qsl_ptr is unused)
    ROWS_PAD: tl.constexpr,  # max(16, next_pow2(QUERY_MAX * GROUP)): tl.dot needs M >= 16
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,  # keys per tile
    STORE_LSE: tl.constexpr,  # False when S == 1: o_ptr is out
    DOT_FP32: tl.constexpr,  # dots in fp32 (fp32 inputs; bf16 in the interpreter)
    FP16_DOTS: tl.constexpr,  # an FP8 cache with 16-bit q: q, K, V and P go through fp16
    PREFETCH_IDS: tl.constexpr,  # load the next tile's block ids one iteration early
    FUSE_MERGE: tl.constexpr,  # one program a (request, KV head): it merges its splits
):  # fmt: skip
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    program = tl.program_id(2)  # of num_programs: each takes a run of the request's splits
    num_programs = tl.num_programs(2)

    # Clamp to the table's width: a bad seq_len must not read past a row of block_tables.
    seq_len = tl.minimum(tl.load(seq_lens_ptr + b), max_blocks * BLOCK_SIZE)
    n_tiles, n_splits, base, growing = _split_geometry(seq_len, num_splits, split_tiles, BLOCK_N)
    splits_each = tl.cdiv(n_splits, num_programs)
    split = program * splits_each  # this program's first split, and its tiles:
    tile_start = _split_start(split, base, growing)
    tile_end = tl.minimum(_split_start(split + splits_each, base, growing), n_tiles)
    split_end = _split_start(split + 1, base, growing)

    # Query rows of the tile: token i of the request, head g of the GQA group.
    offs_r = tl.arange(0, ROWS_PAD)
    offs_i = offs_r // GROUP
    offs_g = offs_r % GROUP
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_start, q_len = _query_tokens(qsl_ptr, b, QUERY_MAX)
    mask_r = (offs_r < QUERY_MAX * GROUP) & (offs_i < q_len)
    q_heads = kv_head * GROUP + offs_g
    q_rows = q_start + offs_i  # [ROWS_PAD] row of q / out / the workspace
    # Token i sees keys < seq_len - q_len + 1 + i (the last token sees them all).
    key_limit = seq_len - q_len + 1 + offs_i  # [ROWS_PAD]

    q_ptrs = (
        q_ptr
        + q_rows[:, None].to(tl.int64) * stride_qb
        + q_heads[:, None] * stride_qh
        + offs_d[None, :] * stride_qd
    )
    q = tl.load(q_ptrs, mask=mask_r[:, None], other=0.0)  # [ROWS_PAD, HEAD_DIM]
    if FP16_DOTS:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh

    m_i = tl.full([ROWS_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS_PAD], dtype=tl.float32)
    acc = tl.zeros([ROWS_PAD, HEAD_DIM], dtype=tl.float32)
    # FUSE_MERGE: the merge of this program's finished splits (_fold_split)
    mrg_m = tl.full([ROWS_PAD], float("-inf"), dtype=tl.float32)
    mrg_acc = tl.zeros([ROWS_PAD, HEAD_DIM], dtype=tl.float32)
    mrg_den = tl.zeros([ROWS_PAD], dtype=tl.float32)

    # Every tile in [tile_start, tile_end) holds at least one key < seq_len, but an early
    # query token may see none of a split's keys: its running max stays -inf, and the
    # exponents subtract a 0 instead (exp2(-inf) = 0), never -inf - -inf.
    if PREFETCH_IDS:  # the first tile's block ids (clamped to a real tile: empty splits)
        blk_next = tile_block_ids(
            bt_row, tl.minimum(tile_start, tl.maximum(n_tiles - 1, 0)) * BLOCK_N, seq_len,
            stride_btn, BLOCK_N, BLOCK_SIZE,
        )  # fmt: skip
    for t in range(tile_start, tile_end):
        offs_tok = t * BLOCK_N + offs_n  # token positions of this tile's rows
        mask_n = offs_tok < seq_len
        if PREFETCH_IDS:
            # This tile's ids came one iteration early; load the next tile's now, so its K/V
            # loads need not wait on them (the last tile reloads its own).
            blk = blk_next
            blk_next = tile_block_ids(
                bt_row, tl.minimum(t + 1, tile_end - 1) * BLOCK_N, seq_len, stride_btn,
                BLOCK_N, BLOCK_SIZE,
            )  # fmt: skip
        else:
            blk = tile_block_ids(bt_row, t * BLOCK_N, seq_len, stride_btn, BLOCK_N, BLOCK_SIZE)
        slot = offs_tok % BLOCK_SIZE
        k_rows = blk * stride_kb + slot * stride_kt  # [BLOCK_N] (or a scalar block term)
        v_rows = blk * stride_vb + slot * stride_vt
        k = tl.load(
            k_head + k_rows[:, None] + offs_d[None, :] * stride_kd,
            mask=mask_n[:, None],
            other=0.0,
        )  # [BLOCK_N, HEAD_DIM]
        v = tl.load(
            v_head + v_rows[:, None] + offs_d[None, :] * stride_vd,
            mask=mask_n[:, None],
            other=0.0,
        )  # [BLOCK_N, HEAD_DIM]
        k = k.to(q.dtype)  # an FP8 cache's keys and values become q's dtype (see FP16_DOTS)
        v = v.to(q.dtype)

        if DOT_FP32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale
        s = tl.where(offs_tok[None, :] < key_limit[:, None], s, float("-inf"))  # [ROWS_PAD, N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)  # P in 16 bits, as flash attention does
        acc = acc * alpha[:, None] + pv
        m_i = m_new
        if (t + 1 == split_end) | (t + 1 == tile_end):
            # The split's last tile: its result out, and a fresh softmax for the next one, as
            # a program of its own would start it (the same bits whatever the program count).
            if FUSE_MERGE:  # merged here, in registers, as _merge_splits merges stored ones
                o, lse = _split_result(acc, l_i, m_i)
                mrg_m, mrg_acc, mrg_den = _fold_split(mrg_m, mrg_acc, mrg_den, o, lse)
            else:
                _store_split(
                    o_ptr, lse_ptr, acc, l_i, m_i, q_rows, q_heads, mask_r, offs_d, split,
                    stride_ob, stride_oh, stride_os, stride_od, stride_lb, stride_lh, stride_ls,
                    STORE_LSE,
                )  # fmt: skip
            split += 1
            split_end = _split_start(split + 1, base, growing)
            m_i = tl.full([ROWS_PAD], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([ROWS_PAD], dtype=tl.float32)
            acc = tl.zeros([ROWS_PAD, HEAD_DIM], dtype=tl.float32)
    if not STORE_LSE:
        if n_tiles == 0:  # an empty request (a padded graph row): zeros, as the merge gives
            _store_split(
                o_ptr, lse_ptr, acc, l_i, m_i, q_rows, q_heads, mask_r, offs_d, 0,
                stride_ob, stride_oh, stride_os, stride_od, stride_lb, stride_lh, stride_ls,
                STORE_LSE,
            )  # fmt: skip
    if FUSE_MERGE:  # (no splits, an empty request: zeros)
        out = mrg_acc / tl.where(mrg_den > 0.0, mrg_den, 1.0)[:, None]
        out_ptrs = out_ptr + q_rows[:, None].to(tl.int64) * stride_yb + q_heads[:, None] * stride_yh
        tl.store(out_ptrs + offs_d[None, :] * stride_yd, out, mask=mask_r[:, None])


@triton.jit
def _split_result(acc, l_i, m_i):
    """A split's normalized output and its natural-log sum of exponentials (-inf, and a zero
    output, for a query row that saw none of its keys)."""
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]  # not 0/0
    # m_i is in log2 units (scores were scaled by log2(e)); lse is in natural-log units.
    lse = m_i * _LN2 + tl.log(tl.where(has_keys, l_i, 1.0))
    return out, tl.where(has_keys, lse, float("-inf"))


@triton.jit
def _fold_split(m, acc, den, o, lse):
    """The merge of splits so far (running max m, sum acc of weighted outputs, sum den of
    weights) with the next split's (o, lse): one pass, split after split in order. -inf
    splits weigh 0; a first split of lse x gives exactly (x, o, 1)."""
    new = tl.maximum(m, lse)
    ref = tl.where(new == float("-inf"), 0.0, new)  # none yet: exp(-inf) = 0, not NaN
    old_w = tl.exp(m - ref)
    w = tl.exp(lse - ref)
    return new, acc * old_w[:, None] + o * w[:, None], den * old_w + w


@triton.jit
def _merge_splits(
    part_ptr, lse_ptr, out_ptr, rows, heads, mask, offs_d, n_splits,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_lb, stride_lh, stride_ls,
    stride_ob, stride_oh, stride_od,
):  # fmt: skip
    """out[row, head] for each (rows, heads) pair under ``mask``: the stored splits 0 ..
    n_splits - 1 folded in order (_fold_split, as a program merging its own splits folds
    them in registers: the same bits); a row with none (or no keys at all) gets zeros."""
    rows = rows.to(tl.int64)
    lse_rows = lse_ptr + rows * stride_lb + heads * stride_lh
    part_rows = part_ptr + rows[:, None] * stride_pb + heads[:, None] * stride_ph
    part_rows += offs_d[None, :] * stride_pd
    m = tl.full(rows.shape, float("-inf"), dtype=tl.float32)
    acc = tl.zeros([rows.shape[0], offs_d.shape[0]], dtype=tl.float32)
    denom = tl.zeros(rows.shape, dtype=tl.float32)
    for s in range(n_splits):
        lse = tl.load(lse_rows + s * stride_ls, mask=mask, other=float("-inf"))
        o = tl.load(part_rows + s * stride_ps, mask=mask[:, None], other=0.0)
        m, acc, denom = _fold_split(m, acc, denom, o, lse)
    out = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
    out_ptrs = out_ptr + rows[:, None] * stride_ob + heads[:, None] * stride_oh
    tl.store(out_ptrs + offs_d[None, :] * stride_od, out, mask=mask[:, None])


@triton.jit
def _store_split(
    o_ptr, lse_ptr, acc, l_i, m_i, q_rows, q_heads, mask_r, offs_d, split,
    stride_ob, stride_oh, stride_os, stride_od, stride_lb, stride_lh, stride_ls,
    STORE_LSE: tl.constexpr,
):  # fmt: skip
    """A split's normalized output (and its lse, when there are several splits)."""
    out, lse = _split_result(acc, l_i, m_i)
    o_ptrs = (
        o_ptr
        + q_rows[:, None].to(tl.int64) * stride_ob
        + q_heads[:, None] * stride_oh
        + split * stride_os
        + offs_d[None, :] * stride_od
    )
    tl.store(o_ptrs, out, mask=mask_r[:, None])
    if STORE_LSE:
        tl.store(
            lse_ptr + q_rows * stride_lb + q_heads * stride_lh + split * stride_ls,
            lse,
            mask=mask_r,
        )


@triton.jit(do_not_specialize=["max_blocks", "num_splits", "split_tiles"])
def _merge_kernel(
    # pointers
    part_ptr, lse_ptr, out_ptr, seq_lens_ptr, qsl_ptr,
    # sizes
    max_blocks, num_splits, split_tiles,  # as the split kernel's
    # strides
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_lb, stride_lh, stride_ls,
    stride_ob, stride_oh, stride_od,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QUERY_MAX: tl.constexpr,
    QUERY_PAD: tl.constexpr,  # next_pow2(QUERY_MAX)
):  # fmt: skip
    # Program (b, head) merges the request's own splits for each of its query tokens, summed
    # one after another in split order: a request's result is the same bits whatever the
    # call's split count (the workspace past its splits is never read, nor written). Loads
    # and work follow the splits that exist, not a padded width (session 13 padded a tree
    # reduction to MAX_SPLITS instead).
    b = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.minimum(tl.load(seq_lens_ptr + b), max_blocks * BLOCK_SIZE)
    n_splits = _split_geometry(seq_len, num_splits, split_tiles, BLOCK_N)[1]
    q_start, q_len = _query_tokens(qsl_ptr, b, QUERY_MAX)
    offs_i = tl.arange(0, QUERY_PAD)
    _merge_splits(
        part_ptr, lse_ptr, out_ptr, q_start + offs_i, head + 0 * offs_i, offs_i < q_len,
        tl.arange(0, HEAD_DIM), n_splits,
        stride_pb, stride_ph, stride_ps, stride_pd, stride_lb, stride_lh, stride_ls,
        stride_ob, stride_oh, stride_od,
    )  # fmt: skip


@dataclass(frozen=True)
class DecodeWorkspace:
    """Preallocated split-K scratch, reusable across calls (and CUDA-graph replays).

    partial_out: [max_batch, Hq, num_splits, d] fp32, each split's normalized output.
    lse: [max_batch, Hq, num_splits] fp32, each split's natural-log sum of exp(scale * q.k).
    A call with batch B <= max_batch uses rows [:B].
    """

    partial_out: Tensor
    lse: Tensor

    @staticmethod
    def shapes(
        max_batch: int, num_q_heads: int, num_splits: int, head_dim: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(partial_out, lse) shapes for these sizes; both fp32 (WORKSPACE_DTYPE)."""
        lse = (max_batch, num_q_heads, num_splits)
        return (*lse, head_dim), lse

    @staticmethod
    def nbytes(max_batch: int, num_q_heads: int, num_splits: int, head_dim: int) -> int:
        """Device bytes ``allocate`` takes for these sizes, without allocating: what an
        engine sizing its KV cache from free memory must leave for the workspace."""
        shapes = DecodeWorkspace.shapes(max_batch, num_q_heads, num_splits, head_dim)
        return sum(math.prod(shape) for shape in shapes) * WORKSPACE_DTYPE.itemsize

    @staticmethod
    def allocate(
        max_batch: int, num_q_heads: int, num_splits: int, head_dim: int, device: torch.device
    ) -> DecodeWorkspace:
        part, lse = DecodeWorkspace.shapes(max_batch, num_q_heads, num_splits, head_dim)
        return DecodeWorkspace(
            partial_out=torch.empty(part, dtype=WORKSPACE_DTYPE, device=device),
            lse=torch.empty(lse, dtype=WORKSPACE_DTYPE, device=device),
        )


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132) -> int:
    """Splits per request so that batch * num_kv_heads * splits programs fill the GPU.

    Aims at ~4 programs per SM (enough loads in flight to saturate HBM), but never makes a
    split shorter than MIN_TOKENS_PER_SPLIT keys of ``max_seq_len``, nor more than MAX_SPLITS.
    A pure function of its arguments, so a CUDA graph captured for (batch, max_seq_len) keeps
    a fixed grid. Raises ValueError for non-positive sizes.
    """
    if batch < 1 or num_kv_heads < 1 or num_sms < 1 or max_seq_len < 0:
        raise ValueError(
            f"choose_num_splits: batch={batch}, num_kv_heads={num_kv_heads}, "
            f"num_sms={num_sms} must be >= 1 and max_seq_len={max_seq_len} >= 0"
        )
    wanted = -(-4 * num_sms // (batch * num_kv_heads))
    useful = max(1, max_seq_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, useful, MAX_SPLITS))


def fixed_split_count(num_keys: int, split_keys: int) -> int:
    """Splits of a request of ``num_keys`` keys under fixed, growing splits of ``split_keys``
    (a multiple of the kernel's tile; the host's mirror of _split_geometry): the splits a
    call's ``num_splits`` must cover for it. 0 for no keys."""
    if num_keys <= 0:
        return 0
    u = (num_keys - 1) // (split_keys * TIER_SPLITS) + 1
    tier = u.bit_length() - 1  # 2^tier <= u < 2^(tier + 1)
    first = split_keys * TIER_SPLITS * ((1 << tier) - 1)
    return tier * TIER_SPLITS + (num_keys - 1 - first) // (split_keys << tier) + 1


def choose_split_programs(
    batch: int, num_kv_heads: int, num_splits: int, num_sms: int, per_sm: int = PROGRAMS_PER_SM
) -> int:
    """Programs per (request, KV head) sharing its splits: enough that batch * num_kv_heads
    * programs fill ``num_sms`` SMs ``per_sm`` times over, never more than the splits. A
    pure function of its arguments, so a CUDA graph captured for a batch keeps its grid."""
    wanted = -(-per_sm * num_sms // max(batch * num_kv_heads, 1))
    return max(1, min(wanted, num_splits))


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"paged_decode_attention: {msg}")


def paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    num_splits: int,
    out: Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
    *,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    split_keys: int | None = None,
    query_start_loc: Tensor | None = None,
    max_query_len: int = 1,
    prefetch_ids: bool = False,
    split_programs: int | None = None,
) -> Tensor:
    """Attention of a few query tokens per request over its paged K/V (flash-decoding).

    Takes q [T, Hq, d] (any strides), k_cache / v_cache [num_blocks, block_size, Hkv, d]
    (any strides, e.g. views of a [2, ...] cache), block_tables [B, max_blocks] int32,
    seq_lens [B] int32 (keys per request incl. its query tokens' own; 0 gives zeros), the
    softmax scale and num_splits (fixed per call site: it sizes the grid). One query token a
    request (T = B) unless ``query_start_loc`` [B + 1] int32 says where each request's tokens
    start, at most ``max_query_len`` of them (a compile-time size: fixed per call site);
    token i of q tokens sees keys < seq_len - q + 1 + i. Writes and returns ``out``
    [T, Hq, d] (allocated when None, dtype of q). ``workspace`` holds the split partials (see
    DecodeWorkspace); allocated per call when None and num_splits > 1. ``block_n`` (keys per
    tile), ``num_warps``, ``num_stages`` and ``prefetch_ids`` (load the next key tile's block
    ids one iteration early) are tuning knobs; ``num_warps`` defaults to 2 for a 1-byte (FP8)
    cache and 4 otherwise (``FP8_NUM_WARPS``). ``split_keys`` fixes the split
    boundaries: SPLITS_PER_TIER splits of that many keys (rounded up to whole tiles), then
    as many twice as long, and so on; a request's result then depends only on its own
    length, whatever the batch, the grid or a CUDA graph's bucket; ``num_splits`` must then
    cover the longest request (``fixed_split_count(len, split_keys)``).
    ``split_programs`` (default and at most ``num_splits``) programs per request and KV head
    share its splits, each taking a run of consecutive ones: fewer programs than splits
    keep small splits' boundaries (and bits) at large batches without their launch cost.
    No host syncs: capturable in a CUDA graph when out and workspace are preallocated. Raises
    ValueError on bad shapes or dtypes.
    """
    rows = q.shape[0] if q.dim() == 3 else -1
    per_request = {"seq_lens": (seq_lens, (seq_lens.shape[0],))}
    if query_start_loc is None:
        _check(max_query_len == 1, "max_query_len > 1 needs query_start_loc")
        batch = rows
        per_request["seq_lens"] = (seq_lens, (batch,))
    else:
        _check(max_query_len >= 1, f"max_query_len={max_query_len} must be >= 1")
        batch = seq_lens.shape[0]
        # With one token at most a request the kernel takes request b's token as row b, so
        # every request must have its one (T = B); query_start_loc is not read then.
        _check(
            max_query_len > 1 or rows == batch,
            f"max_query_len=1 with query_start_loc needs one token per request: got {rows} "
            f"rows for {batch} requests (pass the longest query length)",
        )
        per_request["query_start_loc"] = (query_start_loc, (batch + 1,))
    shapes = check_paged_inputs(
        "paged_decode_attention", q, k_cache, v_cache, block_tables, batch, per_request
    )
    num_q_heads, num_kv_heads = shapes.num_q_heads, shapes.num_kv_heads
    head_dim, block_size = shapes.head_dim, shapes.block_size
    _check(num_splits >= 1, f"num_splits={num_splits} must be >= 1")
    programs = num_splits if split_programs is None else min(split_programs, num_splits)
    _check(programs >= 1, f"split_programs={split_programs} must be >= 1")
    if block_n is None:
        block_n = 64 if head_dim <= 128 else 32
    if num_warps is None:
        num_warps = FP8_NUM_WARPS if k_cache.element_size() == 1 else 4
    _check(
        block_n >= 16 and block_n & (block_n - 1) == 0,
        f"block_n={block_n} is not a power of 2 >= 16",
    )

    if out is None:
        out = torch.empty(rows, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    _check(
        out.shape == q.shape and out.dtype == q.dtype,
        f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}",
    )
    if num_splits == 1:
        # One split is the whole answer: the split kernel writes out, no merge.
        part, part_strides = out, (out.stride(0), out.stride(1), 0, out.stride(2))
        lse, lse_strides = out, (0, 0, 0)  # never written: STORE_LSE is off
    else:
        if workspace is None:
            workspace = DecodeWorkspace.allocate(rows, num_q_heads, num_splits, head_dim, q.device)
        part, lse = workspace.partial_out, workspace.lse
        _check(
            part.dim() == 4
            and part.shape[0] >= rows
            and tuple(part.shape[1:]) == (num_q_heads, num_splits, head_dim)
            and part.dtype == WORKSPACE_DTYPE,
            f"workspace.partial_out must be [>={rows}, {num_q_heads}, {num_splits}, {head_dim}] "
            f"fp32, got {tuple(part.shape)} {part.dtype}",
        )
        _check(
            lse.dim() == 3
            and lse.shape[0] >= rows
            and tuple(lse.shape[1:]) == (num_q_heads, num_splits)
            and lse.dtype == WORKSPACE_DTYPE,
            f"workspace.lse must be [>={rows}, {num_q_heads}, {num_splits}] fp32, got "
            f"{tuple(lse.shape)} {lse.dtype}",
        )
        part_strides, lse_strides = part.stride(), lse.stride()

    group = num_q_heads // num_kv_heads
    # fp32 inputs get exact fp32 dots, not tf32. CPU tensors only reach Triton through its
    # interpreter, whose tl.dot multiplies bf16 operands as their raw uint16 bits (triton 3.9):
    # there, every dtype goes through fp32 dots.
    dot_fp32 = q.dtype == torch.float32 or q.device.type == "cpu"
    if batch == 0 or rows == 0:
        return out
    qsl = seq_lens if query_start_loc is None else query_start_loc  # unread when QUERY_MAX = 1
    split_tiles = 0 if split_keys is None else -(-split_keys // block_n)
    fuse_merge = programs == 1 and num_splits > 1  # the one program merges its own splits
    launch(
        _split_kernel, (batch, num_kv_heads, programs),
        q, k_cache, v_cache, block_tables, seq_lens, qsl, part, lse, out,
        scale * _LOG2E, block_tables.shape[1], num_splits, split_tiles,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
        *part_strides, *lse_strides, *out.stride(),
        GROUP=group,
        QUERY_MAX=max_query_len,
        ROWS_PAD=max(16, triton.next_power_of_2(max_query_len * group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        STORE_LSE=num_splits > 1,
        DOT_FP32=dot_fp32,
        FP16_DOTS=k_cache.element_size() == 1 and q.element_size() == 2,
        PREFETCH_IDS=prefetch_ids,
        FUSE_MERGE=fuse_merge,
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1 and not fuse_merge:
        launch(
            _merge_kernel, (batch, num_q_heads),
            part, lse, out, seq_lens, qsl,
            block_tables.shape[1], num_splits, split_tiles,
            *part.stride(), *lse.stride(), *out.stride(),
            HEAD_DIM=head_dim,
            BLOCK_SIZE=block_size,
            BLOCK_N=block_n,
            QUERY_MAX=max_query_len,
            QUERY_PAD=triton.next_power_of_2(max_query_len),
            num_warps=1,  # a program merges one head's [S, d] partials: d / 32 lanes each
        )  # fmt: skip
    return out


def paged_decode_attention_ref(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    query_start_loc: Tensor | None = None,
) -> Tensor:
    """Plain-torch reference, one request at a time, in fp32; returns [T, Hq, d] in q's dtype.
    ``query_start_loc`` as for paged_decode_attention (None: one token a request). A query
    token that sees no key gets zeros.

    Syncs the host (reads seq_lens): for tests and benchmarks, not for the hot path.
    """
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    starts = list(range(len(seq_lens) + 1)) if query_start_loc is None else query_start_loc.tolist()
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        first, q_len = starts[b], starts[b + 1] - starts[b]
        if seq_len == 0 or q_len == 0:
            continue
        blocks = block_tables[b, : math.ceil(seq_len / block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()  # [L, Hkv, d]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        k = k.repeat_interleave(group, dim=1)  # [L, Hq, d]: query head i reads KV head i // G
        v = v.repeat_interleave(group, dim=1)
        for i in range(q_len):
            limit = seq_len - q_len + 1 + i  # keys this token sees
            if limit <= 0:
                continue
            scores = torch.einsum("hd,lhd->hl", q[first + i].float(), k[:limit]) * scale
            out[first + i] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v[:limit])
    return out.to(q.dtype)
