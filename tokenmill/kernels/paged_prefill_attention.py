"""Paged prefill attention: causal FlashAttention-2 over a ragged batch, K/V via block tables.

A step's query tokens from ``B`` requests are packed into one ``q: [T, Hq, d]``; request ``b``
owns ``q[qsl[b]:qsl[b+1]]`` (``qsl`` = ``query_start_loc``). Its keys and values, including this
step's new ones (already stored), live in the paged cache ``k_cache/v_cache: [NB, BS, Hkv, d]``
at the blocks listed in ``block_tables[b]``. A request's queries are the LAST ``q_len`` tokens of
its ``seq_len``-token context (chunked prefill / prefix-cache hit), so query ``i`` sits at
position ``ctx + i`` with ``ctx = seq_len - q_len`` and attends to keys ``0 .. ctx + i``:

    q rows:         [ r0 r0 r0 r0 | r1 | r2 r2 r2 ]        qsl = [0, 4, 5, 8]
    r0 context:     [ c c c c c c | q q q q ]            seq_len = 10, q_len = 4, ctx = 6
    r0 query i=1:    x x x x x x   x x . .               keys <= ctx + i = 7

    key position p  ->  block_tables[b, p // BS] (physical block),  p % BS (slot in it)

    block_tables[b] = [ 7 | 2 | 9 | 0 0 ]                  BS = 4, seq_len = 10
    positions         0-3   4-7   8-9                      trailing 0s: padding, never read

Grid and tiles (one program = BLOCK_M query rows x all their keys):

    axis 0: request * tiles_per_req + tile       tiles_per_req = cdiv(max_query_len, TOK)
            (tiles in reverse: the longest causal rows start first; tiles past q_len exit)
    axis 1: group of HEADS_PER_TILE query heads sharing one KV head (GQA packing)

    a tile's BLOCK_M rows = TOK tokens x HEADS_PER_TILE heads, TOK = BLOCK_M // HEADS_PER_TILE
    row r -> token tok0 + r // HEADS_PER_TILE, query head h0 + r % HEADS_PER_TILE

With GQA packing (the default) the HEADS_PER_TILE = Hq // Hkv query heads of one KV head share
a tile, so each K/V tile is loaded once for the whole group, and short requests (q_len 1-8)
still fill the tile's rows. Query head ``h`` reads KV head ``h // (Hq // Hkv)``; K/V are
never copied or repeated. When Hq // Hkv does not divide BLOCK_M (e.g. 3), the last
``BLOCK_M % 3`` rows are padding.

Per program, FlashAttention-2 with fp32 running max ``m``, sum ``l`` and accumulator, in base 2
(``log2(e)`` folded into the softmax scale so ``exp2`` replaces ``exp``). Keys split in two:

    keys:   [ 0 ............ n_full )[ n_full ........ n_stop )
            every row sees these      diagonal: causal mask, bounds masks
            (<= first row's position) n_stop = min(seq_len, last row position + 1)

Key tiles above the diagonal are never visited. A key tile of BLOCK_N tokens is addressed in
one of two ways, picked at launch (``TILE_IN_BLOCK``):

* ``block_size % BLOCK_N == 0``: the tile lies inside one cache block: one block id per tile,
  then BLOCK_N contiguous slots (the fast path for block sizes 64-256).
* otherwise (e.g. block_size 16, BLOCK_N 64): one block id per key token, gathered from the
  block table (each key row is still ``d`` contiguous elements, so loads stay vectorised).

With ``read_new_keys`` (and ``k_new``/``v_new`` passed), key tiles that start at or past
``ctx`` hold only this step's tokens, which are read from ``k_new``/``v_new`` row by row
(token ``q_start + p - ctx`` for key position ``p``) with no block table:

    keys:   [ 0 ........ ctx_up )[ ctx_up ........ n_stop )      ctx_up = ctx rounded up to
            paged (block table)    k_new rows                    a multiple of BLOCK_N

When the caller knows that no request has keys from earlier steps (``fresh``: a step of new
prompts), the kernel is compiled without the block-table paths and reads only k_new/v_new.

Uninitialised cache slots past ``seq_len`` (possibly NaN) are never loaded unmasked.

**Tree masks** (``tree_mask``, one int64 per query token): a request's step tokens need not
be one chain. Speculative steps verify several candidate continuations at once (token trees,
Lookahead's window and n-gram branches); their tokens sit in the cache one after another
from ``ctx``, and bit ``j`` of query ``i``'s mask says whether it sees the step's key
``ctx + j`` (every key before ``ctx`` stays visible, and never one after its own position):

    step tokens:  0=last  1=a  2=b  3=x  4=y       branches: last-a-b, last-x-y
    masks:        0b00001 0b00011 0b00111 0b01001 0b11001

A mask of -1 (all bits) is plain causal attention, for the step's other rows. A request
with a tree has at most 64 step tokens (one bit each); RoPE positions are the caller's (a
branch token's depth, not its place in the step).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from tokenmill.kernels.launch_log import launch
from tokenmill.kernels.paged_inputs import check_paged_inputs
from tokenmill.kernels.paged_prefill_config import PrefillAttentionConfig, default_prefill_config
from tokenmill.kernels.tile_block_ids import tile_block_ids
from tokenmill.kernels.tree_mask import tree_visible

__all__ = [
    "PrefillAttentionConfig",
    "default_prefill_config",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "tree_visible",
]

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_keys(
    acc,  # [BLOCK_M, HEAD_DIM] fp32
    l_i,  # [BLOCK_M] fp32
    m_i,  # [BLOCK_M] fp32, base-2 scaled running max
    q,  # [BLOCK_M, HEAD_DIM]
    q_pos,  # [BLOCK_M] int32 position of each row's token
    k_base,  # k_cache pointer moved to this KV head
    v_base,
    bt_row,  # block_tables pointer moved to this request's row
    seq_len,
    n_start,
    n_stop,
    qk_scale,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_IN_BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    KV_DTYPE: tl.constexpr,  # the model's dtype: an FP8 cache's keys and values become it
    FROM_NEW: tl.constexpr = False,  # k_base/v_base: row 0 of k_new/v_new; stride_ks/vs: rows
    ctx_len=0,  # TREE only: the step's first key position
    tree_m=None,  # TREE only: [BLOCK_M] int64, each row's mask over the step's keys
    TREE: tl.constexpr = False,
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(n_start, n_stop, BLOCK_N):
        key_pos = start_n + offs_n  # [BLOCK_N]
        key_ok = key_pos < seq_len
        if FROM_NEW:
            k_off = key_pos.to(tl.int64) * stride_ks
            v_off = key_pos.to(tl.int64) * stride_vs
        elif TILE_IN_BLOCK:
            blk = tl.load(bt_row + start_n // BLOCK_SIZE).to(tl.int64)
            slot = start_n % BLOCK_SIZE + offs_n
            k_off = blk * stride_kb + slot * stride_ks  # [BLOCK_N]
            v_off = blk * stride_vb + slot * stride_vs
        else:  # no entry past the request's blocks is read (masked keys: block 0)
            blk = tile_block_ids(bt_row, start_n, seq_len, 1, BLOCK_N, BLOCK_SIZE)
            slot = key_pos % BLOCK_SIZE
            k_off = blk * stride_kb + slot * stride_ks
            v_off = blk * stride_vb + slot * stride_vs
        k_ptrs = k_base + k_off[None, :] + offs_d[:, None]  # [HEAD_DIM, BLOCK_N]: K^T
        v_ptrs = v_base + v_off[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_DIM]
        if MASKED:
            k = tl.load(k_ptrs, mask=key_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
        k = k.to(KV_DTYPE)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32
        if MASKED:
            causal = key_pos[None, :] <= q_pos[:, None]
            if TREE:
                causal = causal & _tree_visible(tree_m, key_pos - ctx_len)
            qk = tl.where(causal, qk * qk_scale, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            qk = qk - m_ij[:, None]
        else:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            qk = qk * qk_scale - m_ij[:, None]
        p = tl.exp2(qk)
        alpha = tl.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MASKED:  # p is 0 there, but 0 * NaN from an unwritten slot would still be NaN
            v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        v = v.to(KV_DTYPE)
        p = p.to(v.dtype)
        if DOT_IN_FP32:  # p keeps its rounding to v's dtype, as on the GPU
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _tree_visible(tree_m, rel):
    """[BLOCK_M, BLOCK_N]: whether each row sees the key ``rel`` tokens past the step's first
    (context keys, rel < 0, always; a mask's bits reach 64 step tokens, and a -1 mask every
    one, so a long prefill row stays causal)."""
    shift = tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)
    bit = (tree_m[:, None] >> shift[None, :]) & 1
    far = (rel >= 64)[None, :] & (tree_m == -1)[:, None]
    return (rel < 0)[None, :] | (bit != 0) | far


@triton.jit(do_not_specialize=["first_req", "tiles_per_req", "stride_bt"])
def _paged_prefill_attention_kernel(
    # pointers
    q_ptr,  # [T, Hq, d]
    k_cache_ptr,  # [NB, BS, Hkv, d]
    v_cache_ptr,  # [NB, BS, Hkv, d]
    out_ptr,  # [T, Hq, d]
    block_tables_ptr,  # [B, max_blocks] int32
    query_start_loc_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    k_new_ptr,  # [T, Hkv, d] this step's keys (READ_NEW only)
    v_new_ptr,
    tree_mask_ptr,  # [T] int64 (TREE only)
    # sizes
    qk_scale,  # softmax scale * log2(e)
    first_req,  # requests before it are someone else's (a mixed step's decode rows)
    tiles_per_req,
    # strides (the head dim is contiguous: checked by the wrapper)
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    # meta-parameters
    GROUP_SIZE: tl.constexpr,  # Hq // Hkv
    HEADS_PER_TILE: tl.constexpr,  # GROUP_SIZE when packing GQA heads, else 1
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # KV cache block size
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_IN_BLOCK: tl.constexpr,  # BLOCK_SIZE % BLOCK_N == 0
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32 rounding)
    DOT_IN_FP32: tl.constexpr,  # interpreter + bf16 only: see paged_prefill_attention
    READ_NEW: tl.constexpr,  # key tiles past the context come from k_new/v_new
    HAS_CONTEXT: tl.constexpr,  # False: no request has cached keys (READ_NEW reads them all)
    TREE: tl.constexpr = False,  # per-token masks over the step's keys (see the top)
):
    TOKENS_PER_TILE: tl.constexpr = BLOCK_M // HEADS_PER_TILE
    pid = tl.program_id(0)
    req = first_req + pid // tiles_per_req
    # reversed: late tiles have the most keys, so they start first
    tile = tiles_per_req - 1 - pid % tiles_per_req
    q_head0 = tl.program_id(1) * HEADS_PER_TILE
    kv_head = q_head0 // GROUP_SIZE

    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    tok0 = tile * TOKENS_PER_TILE
    if tok0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = tok0 + offs_m // HEADS_PER_TILE  # [BLOCK_M] token index within the request
    head = q_head0 + offs_m % HEADS_PER_TILE  # [BLOCK_M] query head
    row_ok = (offs_m < TOKENS_PER_TILE * HEADS_PER_TILE) & (tok < q_len)
    q_pos = ctx_len + tok
    t64 = (q_start + tok).to(tl.int64)
    q_ptrs = q_ptr + (t64 * stride_qt + head * stride_qh)[:, None] + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    tree_m = None
    if TREE:
        tree_m = tl.load(tree_mask_ptr + q_start + tok, mask=row_ok, other=-1)  # [BLOCK_M]

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # finite "minus infinity": padding rows that see no key stay NaN-free (exp2(-inf + 1e38) = 0)
    m_i = tl.full([BLOCK_M], -1.0e38, dtype=tl.float32)

    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    bt_row = block_tables_ptr + req * stride_bt
    n_full = (ctx_len + tok0 + 1) // BLOCK_N * BLOCK_N  # keys <= the first row's position
    if TREE:  # a tree row may not see every step key before it: those tiles get the mask
        n_full = tl.minimum(n_full, ctx_len // BLOCK_N * BLOCK_N)
    n_stop = tl.minimum(seq_len, ctx_len + tok0 + TOKENS_PER_TILE)  # past the last row's position
    if READ_NEW:
        # key position p of this request is row q_start + p - ctx_len of k_new / v_new
        row0 = (q_start - ctx_len).to(tl.int64)
        kn_base = k_new_ptr + row0 * stride_knt + kv_head * stride_knh
        vn_base = v_new_ptr + row0 * stride_vnt + kv_head * stride_vnh
        ctx_up = tl.cdiv(ctx_len, BLOCK_N) * BLOCK_N  # first tile holding only new keys
        split_full = tl.minimum(ctx_up, n_full)
        split_diag = tl.minimum(tl.maximum(ctx_up, n_full), n_stop)
    else:
        kn_base = k_base
        vn_base = v_base
        split_full = n_full
        split_diag = n_stop
    if HAS_CONTEXT:
        acc, l_i, m_i = _attend_keys(
            acc, l_i, m_i, q, q_pos, k_base, v_base, bt_row, seq_len, 0, split_full, qk_scale,
            stride_kb, stride_ks, stride_vb, stride_vs,
            HEAD_DIM, BLOCK_N, BLOCK_SIZE, TILE_IN_BLOCK, False, DOT_PRECISION, DOT_IN_FP32,
            out_ptr.dtype.element_ty,
        )  # fmt: skip
    if READ_NEW:
        acc, l_i, m_i = _attend_keys(
            acc, l_i, m_i, q, q_pos, kn_base, vn_base, bt_row, seq_len, split_full, n_full,
            qk_scale, 0, stride_knt, 0, stride_vnt,
            HEAD_DIM, BLOCK_N, BLOCK_SIZE, TILE_IN_BLOCK, False, DOT_PRECISION, DOT_IN_FP32,
            out_ptr.dtype.element_ty,
            True,
        )  # fmt: skip
    if HAS_CONTEXT:
        acc, l_i, m_i = _attend_keys(
            acc, l_i, m_i, q, q_pos, k_base, v_base, bt_row, seq_len, n_full, split_diag,
            qk_scale, stride_kb, stride_ks, stride_vb, stride_vs,
            HEAD_DIM, BLOCK_N, BLOCK_SIZE, TILE_IN_BLOCK, True, DOT_PRECISION, DOT_IN_FP32,
            out_ptr.dtype.element_ty, False, ctx_len, tree_m, TREE,
        )  # fmt: skip
    if READ_NEW:
        acc, l_i, m_i = _attend_keys(
            acc, l_i, m_i, q, q_pos, kn_base, vn_base, bt_row, seq_len, split_diag, n_stop,
            qk_scale, 0, stride_knt, 0, stride_vnt,
            HEAD_DIM, BLOCK_N, BLOCK_SIZE, TILE_IN_BLOCK, True, DOT_PRECISION, DOT_IN_FP32,
            out_ptr.dtype.element_ty, True, ctx_len, tree_m, TREE,
        )  # fmt: skip

    l_i = tl.where(row_ok, l_i, 1.0)  # padding rows: avoid 0 / 0; they are not stored
    out = acc / l_i[:, None]
    o_ptrs = out_ptr + (t64 * stride_ot + head * stride_oh)[:, None] + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    b = block_tables.shape[0] if block_tables.dim() == 2 else -1
    check_paged_inputs(
        "paged_prefill_attention", q, k_cache, v_cache, block_tables, b,
        {"query_start_loc": (query_start_loc, (b + 1,)), "seq_lens": (seq_lens, (b,))},
    )  # fmt: skip
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name}: the head dim must be contiguous, got strides {x.stride()}")
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(
                f"out: expected {q.dtype} {tuple(q.shape)} on {q.device}, "
                f"got {out.dtype} {tuple(out.shape)} on {out.device}"
            )
        if out.stride(-1) != 1:
            raise ValueError(f"out: the head dim must be contiguous, got strides {out.stride()}")


def paged_prefill_attention(
    q: torch.Tensor,  # [T, Hq, d]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, d]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, d]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32, context length including the queries
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hq, d]
    config: PrefillAttentionConfig | None = None,
    first_req: int = 0,
    k_new: torch.Tensor | None = None,  # [T, Hkv, d]: this step's keys, as stored in the cache
    v_new: torch.Tensor | None = None,  # [T, Hkv, d]
    fresh: bool = False,
    tree_mask: torch.Tensor | None = None,  # [T] int64, see the top; -1: causal
) -> torch.Tensor:
    """Causal attention of each request's query tokens over its paged K/V context.

    Takes the packed queries, the paged caches (views with any block/slot/head strides; the
    head dim must be contiguous), the block tables, ``query_start_loc``, ``seq_lens`` and the
    host-side ``max_query_len`` (which must be >= every request's query count: it sizes the
    grid, and tokens beyond it would be left unwritten). ``config`` overrides the launch
    parameters (see ``default_prefill_config``). Writes into ``out`` when given (else a new
    contiguous tensor) and returns it. Requests before ``first_req`` are skipped (their
    tokens in ``out`` are left for another kernel; tensors are passed whole, not sliced, so
    that no pointer loses its alignment and no new kernel variant is compiled mid-job).
    ``k_new``/``v_new`` (the keys and values this step stored, one row per query token) are
    read instead of the cache for the step's own tokens when ``config.read_new_keys``.
    ``fresh=True`` promises that no request has keys from earlier steps (every ``seq_len``
    equals its query count, as the caller knows from its host-side lengths); with
    ``read_new_keys`` the kernel is then compiled without its block-table paths.
    ``tree_mask`` (one int64 per query token, -1 for causal rows) narrows what each query
    sees among its request's step keys (see the top); a request whose rows use it has at
    most 64 query tokens, which the caller guarantees (checking would sync).
    Raises ValueError on mismatched shapes, dtypes, strides or devices. No host-device
    synchronisation.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out)
    t, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    if out is None:
        out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    num_reqs = seq_lens.shape[0] - first_req
    if not 0 <= first_req <= seq_lens.shape[0]:
        raise ValueError(f"first_req={first_req} is outside [0, {seq_lens.shape[0]}]")
    if t == 0 or num_reqs == 0 or max_query_len <= 0:
        return out

    cfg = config or default_prefill_config(d, q.dtype, fresh)
    read_new = cfg.read_new_keys and k_new is not None and v_new is not None
    if read_new:
        for name, x in (("k_new", k_new), ("v_new", v_new)):
            if x.shape != (t, hkv, d) or x.dtype != q.dtype or x.device != q.device:
                raise ValueError(
                    f"{name}: expected {q.dtype} {(t, hkv, d)} on {q.device}, got "
                    f"{x.dtype} {tuple(x.shape)} on {x.device}"
                )
            if x.stride(-1) != 1:
                raise ValueError(f"{name}: the head dim must be contiguous, got {x.stride()}")
    if tree_mask is not None and (
        tree_mask.shape != (t,) or tree_mask.dtype != torch.int64 or tree_mask.device != q.device
    ):
        raise ValueError(
            f"tree_mask: expected int64 {(t,)} on {q.device}, got "
            f"{tree_mask.dtype} {tuple(tree_mask.shape)} on {tree_mask.device}"
        )
    kn = k_new if read_new else k_cache
    vn = v_new if read_new else v_cache
    group = hq // hkv
    heads_per_tile = group if cfg.pack_gqa and group <= cfg.block_m else 1
    tokens_per_tile = cfg.block_m // heads_per_tile
    tiles_per_req = triton.cdiv(max_query_len, tokens_per_tile)
    grid = (num_reqs * tiles_per_req, hq // heads_per_tile)
    # Triton's interpreter stores bf16 as uint16 and its tl.dot multiplies those bit patterns
    # as integers (triton-lang/triton#11584, "not supported yet"); there the kernel upcasts bf16
    # dot operands to fp32, which keeps the GPU's numerics (bf16 products are exact in fp32).
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    launch(
        _paged_prefill_attention_kernel, grid,
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, kn, vn,
        query_start_loc if tree_mask is None else tree_mask,
        scale * _LOG2E, first_req, tiles_per_req,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        kn.stride(0) if read_new else 0, kn.stride(1) if read_new else 0,
        vn.stride(0) if read_new else 0, vn.stride(1) if read_new else 0,
        GROUP_SIZE=group,
        HEADS_PER_TILE=heads_per_tile,
        HEAD_DIM=d,
        BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        TILE_IN_BLOCK=block_size % cfg.block_n == 0,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=interpreting and q.dtype == torch.bfloat16,
        READ_NEW=read_new,
        HAS_CONTEXT=not (fresh and read_new),
        TREE=tree_mask is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,  # [T, Hq, d]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, d]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, d]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hq, d]
    tree_mask: torch.Tensor | None = None,  # [T] int64
) -> torch.Tensor:
    """Plain-torch reference of ``paged_prefill_attention``: per request, gather K/V through
    the block table, explicit causal softmax in fp32, narrowed by ``tree_mask``'s bits.
    Syncs with the device (``.tolist()``); ``max_query_len`` is accepted for signature
    parity only. Writes into ``out`` if given."""
    t, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    group = hq // hkv
    if out is None:
        out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        n_blocks = math.ceil(seq_len / block_size)
        blocks = block_tables[b, :n_blocks].long()
        k = k_cache[blocks].reshape(-1, hkv, d)[:seq_len].float()  # [S, Hkv, d]
        v = v_cache[blocks].reshape(-1, hkv, d)[:seq_len].float()
        k = k.repeat_interleave(group, dim=1)  # [S, Hq, d]
        v = v.repeat_interleave(group, dim=1)
        qb = q[q_start:q_end].float()  # [q_len, Hq, d]
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale  # [Hq, q_len, S]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        hidden = k_pos[None, :] > q_pos[:, None]  # [q_len, S]
        if tree_mask is not None:
            hidden = hidden | ~tree_visible(tree_mask[q_start:q_end], seq_len - q_len, seq_len)
        scores.masked_fill_(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out
