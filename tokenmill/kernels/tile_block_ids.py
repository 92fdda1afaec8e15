"""Which cache block holds each key of a tile: the paged attention kernels' block-table
lookup (paged_decode_attention.py, paged_prefill_attention.py).

A tile is BLOCK_N consecutive keys of one request from key ``first`` (a multiple of BLOCK_N);
key j lives in cache block ``block_table[j // BLOCK_SIZE]``, slot ``j % BLOCK_SIZE``.

    BLOCK_SIZE a multiple of BLOCK_N   the tile sits inside one block: one id (a scalar)
    BLOCK_SIZE divides BLOCK_N         the tile spans BLOCK_N / BLOCK_SIZE blocks (at most
                                       MAX_TILE_BLOCKS): one scalar load each, every row
                                       picking its block's
    otherwise (e.g. BLOCK_SIZE 12)     one id loaded per key

        first = 64, BLOCK_N = 64, BLOCK_SIZE = 16:
        ids   = table[4], table[5], table[6], table[7]     4 scalar loads
        rows  = [ids[0] x16 | ids[1] x16 | ids[2] x16 | ids[3] x16]

Loading an id per row instead (64 loads, each thread loading every id its rows need, K's
and V's the same ones again) made them synchronous loads ahead of every tile's K/V copies in
the sm_90 code (session 14: 16 per thread per tile in decode at 4 warps, 64 in prefill). A
vector load of the few ids, broadcast to the rows, compiled back to the per-row loads in
prefill (the compiler rematerialized it in the rows' layout).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["tile_block_ids"]

MAX_TILE_BLOCKS: tl.constexpr = tl.constexpr(8)  # more blocks a tile: an id loaded per key


@triton.jit
def tile_block_ids(
    bt_row, first, limit, stride_btn, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr
):
    """The cache block ids (int64) of the BLOCK_N keys from ``first`` in the table row
    ``bt_row`` (entries ``stride_btn`` apart): one scalar when the tile sits inside one block,
    else one per key. Blocks holding no key below ``limit`` read as block 0 (callers mask
    those keys), so no entry past the request's blocks is read."""
    if BLOCK_SIZE % BLOCK_N == 0:
        blk = tl.load(bt_row + (first // BLOCK_SIZE) * stride_btn)
    elif BLOCK_N % BLOCK_SIZE != 0 or BLOCK_N // BLOCK_SIZE > MAX_TILE_BLOCKS:
        offs_tok = first + tl.arange(0, BLOCK_N)
        ids_ptr = bt_row + (offs_tok // BLOCK_SIZE) * stride_btn
        blk = tl.load(ids_ptr, mask=offs_tok < limit, other=0)
    else:  # a few blocks: one uniform (scalar) load each, selected per row
        first_blk = first // BLOCK_SIZE
        row_blk = tl.arange(0, BLOCK_N) // BLOCK_SIZE
        blk = tl.zeros([BLOCK_N], dtype=tl.int32)
        for j in tl.static_range(BLOCK_N // BLOCK_SIZE):
            in_seq = (first_blk + j) * BLOCK_SIZE < limit
            blk_j = tl.load(bt_row + (first_blk + j) * stride_btn, mask=in_seq, other=0)
            blk = tl.where(row_blk == j, blk_j, blk)
    return blk.to(tl.int64)  # num_blocks * block stride can pass 2**31 elements
