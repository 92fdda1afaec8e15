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
    workspace     partial_out [T, Hq, S, d] fp32, lse [T, Hq, S] fp32   (S = num_splits)

Query token i of a request with q tokens sees keys j < seq_len - q + 1 + i (causal: the last
one sees every key, the first all but the q - 1 after it):

    keys:        0 1 2 3 4 5 6          seq_len = 7, q = 3 (the last known token, 2 drafts)
    query 0 (p4) x x x x x . .
    query 2 (p6) x x x x x x x

Algorithm (two kernels, grid sized from B, Hkv, S only, so the launch is CUDA-graph safe):

1. ``_split_kernel``, grid (B, Hkv, S). Program (b, h, s) takes request b, KV head h and the
   s-th contiguous slice of the request's keys, for all G = Hq // Hkv query heads of that KV
   head and all q query tokens of the request at once (a tile of q * G query rows): every
   K/V tile is read from HBM once per request and GQA group, not once per head or token.
   Keys are walked in tiles of BLOCK_N rows; an online softmax in fp32 keeps the running max
   m, sum l and output acc; the program stores acc / l and lse = m + log(l). A split with no
   keys stores lse = -inf and a zero output.
2. ``_merge_kernel``, grid (T, Hq): out = sum_s exp(lse_s - M) * o_s / sum_s exp(lse_s - M),
   M = max_s lse_s, summed split after split in order (one order for every S: trailing
   empty splits add exact zeros); -inf splits weigh 0, and an empty request (seq_len 0, a
   padded graph row) gets zeros rather than NaN. With S == 1 the split kernel writes
   ``out`` itself.

Splitting is per request: its n_tiles = cdiv(seq_len, BLOCK_N) key tiles are cut into S runs
of cdiv(n_tiles, S) tiles, so a short request is not split into a long request's slices and
the result of a request never depends on the rest of the batch (or on block_tables' width).
Example: seq_len = 19, BLOCK_SIZE = 4, BLOCK_N = 8, S = 4 -> 3 tiles, 1 tile per split:

    token             0..3    4..7    8..11   12..15  16..18
    block_tables[b]  [   7   |   2   |   9   |   4   |  5 x  ]   x: past seq_len, masked
    key tile         [      t0       |      t1       |  t2   ]
    split program    [      s0       |      s1       |  s2   ]   s3: no tile, lse = -inf

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
    "paged_decode_attention",
    "paged_decode_attention_ref",
]

_LOG2E = 1.4426950408889634
_LN2 = tl.constexpr(0.6931471805599453)
MAX_SPLITS = 64
# An FP8 cache's tiles take half the bytes and a conversion each: on the H200 (B=256, 4k
# keys, block_n 64) 2 warps read it at 77-87% of the copy ceiling where 4 read 52-62%
# (session 14, BENCHMARKS.md). A bf16 cache at 4 warps is at the ceiling already.
FP8_NUM_WARPS = 2
MIN_TOKENS_PER_SPLIT = 256  # below this, a split's fixed cost (q load, merge) outweighs its keys


@triton.jit(do_not_specialize=["max_blocks", "num_splits", "stride_btb"])
def _split_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, o_ptr, lse_ptr,
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
):  # fmt: skip
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Clamp to the table's width: a bad seq_len must not read past a row of block_tables.
    seq_len = tl.minimum(tl.load(seq_lens_ptr + b), max_blocks * BLOCK_SIZE)
    n_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(n_tiles, num_splits)
    if split_tiles > 0:
        tiles_per_split = split_tiles
    tile_start = split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, n_tiles)

    # Query rows of the tile: token i of the request, head g of the GQA group.
    offs_r = tl.arange(0, ROWS_PAD)
    offs_i = offs_r // GROUP
    offs_g = offs_r % GROUP
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if QUERY_MAX == 1:
        q_start = b
        q_len = 1
    else:
        q_start = tl.load(qsl_ptr + b)
        q_len = tl.load(qsl_ptr + b + 1) - q_start
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

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]  # empty split: zeros, not 0/0
    o_ptrs = (
        o_ptr
        + q_rows[:, None].to(tl.int64) * stride_ob
        + q_heads[:, None] * stride_oh
        + split * stride_os
        + offs_d[None, :] * stride_od
    )
    tl.store(o_ptrs, out, mask=mask_r[:, None])
    if STORE_LSE:
        # m_i is in log2 units (scores were scaled by log2(e)); lse is in natural-log units.
        lse = m_i * _LN2 + tl.log(tl.where(has_keys, l_i, 1.0))
        lse = tl.where(has_keys, lse, float("-inf"))
        tl.store(
            lse_ptr + q_rows * stride_lb + q_heads * stride_lh + split * stride_ls,
            lse,
            mask=mask_r,
        )


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    # pointers
    part_ptr, lse_ptr, out_ptr,
    # sizes
    num_splits,
    # strides
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_lb, stride_lh, stride_ls,
    stride_ob, stride_oh, stride_od,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    # The splits are summed one after another in split order, so a request's result is the
    # same bits whatever the call's split count past its last non-empty split: an empty split
    # (lse -inf, zero output) adds exact zeros. Loads and work follow the splits that exist,
    # not a padded width (session 13 padded a tree reduction to MAX_SPLITS instead).
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    lse_row = lse_ptr + b * stride_lb + head * stride_lh
    part_row = part_ptr + b * stride_pb + head * stride_ph + offs_d * stride_pd
    lse_max = float("-inf")
    for s in range(num_splits):
        lse_max = tl.maximum(lse_max, tl.load(lse_row + s * stride_ls))
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # all empty: weights exp(-inf)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    denom = 0.0
    for s in range(num_splits):
        w = tl.exp(tl.load(lse_row + s * stride_ls) - lse_max)
        acc += w * tl.load(part_row + s * stride_ps)
        denom += w
    out = acc / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + b * stride_ob + head * stride_oh + offs_d * stride_od, out)


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
    def allocate(
        max_batch: int, num_q_heads: int, num_splits: int, head_dim: int, device: torch.device
    ) -> DecodeWorkspace:
        return DecodeWorkspace(
            partial_out=torch.empty(
                max_batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=device
            ),
            lse=torch.empty(max_batch, num_q_heads, num_splits, dtype=torch.float32, device=device),
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
    boundaries at multiples of that many keys (rounded up to whole tiles): a request's result
    then depends only on its own length, whatever the batch, the grid or a CUDA graph's
    bucket; ``num_splits`` must then cover the longest request (``cdiv(len, split_keys)``).
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
            and part.dtype == torch.float32,
            f"workspace.partial_out must be [>={rows}, {num_q_heads}, {num_splits}, {head_dim}] "
            f"fp32, got {tuple(part.shape)} {part.dtype}",
        )
        _check(
            lse.dim() == 3
            and lse.shape[0] >= rows
            and tuple(lse.shape[1:]) == (num_q_heads, num_splits)
            and lse.dtype == torch.float32,
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
    launch(
        _split_kernel, (batch, num_kv_heads, num_splits),
        q, k_cache, v_cache, block_tables, seq_lens, qsl, part, lse,
        scale * _LOG2E, block_tables.shape[1], num_splits,
        0 if split_keys is None else -(-split_keys // block_n),
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
        *part_strides, *lse_strides,
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
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        launch(
            _merge_kernel, (rows, num_q_heads),
            part, lse, out,
            num_splits,
            *part.stride(), *lse.stride(), *out.stride(),
            HEAD_DIM=head_dim,
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
