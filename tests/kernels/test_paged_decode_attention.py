"""paged_decode_attention (Triton, split-K) against paged_decode_attention_ref.

Caches are poisoned: block 0 (the table's padding) and every slot past a request's seq_len
hold NaN, so any read the kernel should have masked shows up as NaN in the output.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tokenmill.kernels.paged_decode_attention import (
    MAX_SPLITS,
    DecodeWorkspace,
    _split_of_tile,
    _split_start,
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Both sides accumulate in fp32 and round the output once. fp32: only summation order and
# exp2 vs exp differ (observed < 1e-6). fp16: one output rounding each (2^-11 relative) plus,
# on the GPU, P rounded to fp16 before the P@V dot (2^-11 per weight). bf16: the same with
# 2^-8, and Triton's interpreter truncates fp32 -> bf16 (up to 2^-7) where the GPU rounds.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=3e-3, atol=3e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


def _make_case(
    seq_lens: list[int],
    hq: int,
    hkv: int,
    d: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    spare_blocks: int = 3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q (a strided view), a poisoned [2, NB, BS, Hkv, d] cache, shuffled block
    tables padded with block 0, and seq_lens; all on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    needed = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(needed) + 1  # one padding column past the widest row
    num_blocks = 1 + sum(needed) + spare_blocks  # block 0 is the padding block
    ids = torch.randperm(num_blocks - 1, generator=gen) + 1  # non-contiguous block ids
    block_tables = torch.zeros(batch, max_blocks, dtype=torch.int32)  # [B, max_blocks]
    nan = float("nan")
    dev_gen = torch.Generator(device=DEVICE).manual_seed(seed)  # GPU cases hold GBs of K/V
    kv = torch.randn(2, num_blocks, block_size, hkv, d, generator=dev_gen, device=DEVICE)
    kv = kv.to(dtype)  # [2, NB, BS, Hkv, d]
    kv[:, 0] = nan
    used = 0
    for b, (n, nb) in enumerate(zip(seq_lens, needed, strict=True)):
        row = ids[used : used + nb]
        used += nb
        block_tables[b, :nb] = row
        if nb:
            kv[:, int(row[-1]), n - (nb - 1) * block_size :] = nan  # slots past seq_len
    kv[:, ids[used:].to(DEVICE)] = nan  # spare blocks
    qkv = torch.randn(batch, hq + 2, d, generator=gen).to(DEVICE, dtype)
    q = qkv[:, 1 : hq + 1]  # [B, Hq, d], strided like a slice of the qkv projection
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, kv, block_tables.to(DEVICE), seq


def _check(
    seq_lens, hq, hkv, d, block_size, dtype, num_splits, block_n=None, seed=0, prefetch=False
) -> None:
    q, kv, bt, seq = _make_case(seq_lens, hq, hkv, d, block_size, dtype, seed)
    scale = d**-0.5
    out = paged_decode_attention(
        q, kv[0], kv[1], bt, seq, scale, num_splits, block_n=block_n, prefetch_ids=prefetch
    )
    ref = paged_decode_attention_ref(q, kv[0], kv[1], bt, seq, scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


# (hq, hkv, d, block_size, block_n, num_splits, dtype): GQA 1/3/4/8, d 64/128, block sizes
# 16/32 (and 12), tiles inside one block (block_size % block_n == 0), across blocks and
# across a block boundary that is not a tile's (kernels/tile_block_ids.py), 1/3/8 splits.
CASES = [
    (4, 4, 64, 16, 16, 1, torch.float32),  # MHA, one split: the kernel writes out directly
    (9, 3, 64, 16, 16, 3, torch.bfloat16),  # SmolLM2 heads
    (8, 2, 128, 16, 32, 8, torch.float16),  # Llama-3 ratio; tiles span 2 blocks
    (8, 1, 64, 32, 16, 3, torch.bfloat16),  # GQA 8, two tiles per block
    (8, 1, 128, 32, 64, 8, torch.float32),  # GQA 8, tiles span 2 blocks, masked block ids
    (6, 2, 128, 32, 32, 1, torch.float16),  # GQA 3
    (4, 1, 64, 16, 64, 8, torch.float16),  # GQA 4, a 4-block tile, more splits than tiles
    (2, 2, 128, 32, 16, 3, torch.bfloat16),  # MHA, d 128
    (4, 2, 64, 12, 16, 3, torch.float32),  # block size 12: neither divides the other
]


@pytest.mark.parametrize(("hq", "hkv", "d", "block_size", "block_n", "num_splits", "dtype"), CASES)
def test_matches_reference(hq, hkv, d, block_size, block_n, num_splits, dtype) -> None:
    # Ragged: one key, just under a block, exactly a block, many blocks with a partial tail.
    seq_lens = [1, block_size - 1, block_size, 5 * block_size + 3]
    _check(seq_lens, hq, hkv, d, block_size, dtype, num_splits, block_n)


@pytest.mark.parametrize(("block_size", "block_n"), [(16, 32), (32, 16), (16, 64)])
def test_prefetching_block_ids_reads_the_same_keys(block_size: int, block_n: int) -> None:
    """prefetch_ids (the next tile's block ids loaded one iteration early), with tiles inside
    a block and across blocks, and splits with no keys (the first prefetch is clamped)."""
    seq_lens = [1, block_size - 1, block_size, 5 * block_size + 3]
    _check(seq_lens, 8, 2, 64, block_size, torch.float32, 8, block_n, prefetch=True)


def test_default_tile_and_splits_past_the_keys() -> None:
    # The default block_n (64) with 8 splits of a 2-tile request: six splits hold no keys.
    _check([3, 100], 8, 2, 64, 16, torch.float16, num_splits=8)


def test_empty_request_gives_zeros() -> None:
    # seq_len 0 (a padded row of a captured batch): every split is empty, lse = -inf.
    q, kv, bt, seq = _make_case([0, 5], 4, 2, 64, 16, torch.float32)
    for num_splits in (1, 3):
        out = paged_decode_attention(q, kv[0], kv[1], bt, seq, 0.125, num_splits)
        torch.testing.assert_close(out[0], torch.zeros_like(out[0]), atol=0, rtol=0)
        ref = paged_decode_attention_ref(q, kv[0], kv[1], bt, seq, 0.125)
        torch.testing.assert_close(out[1], ref[1], **TOL[torch.float32])


def test_reuses_out_and_a_larger_workspace() -> None:
    # The graph-capture calling convention: out and a max-batch workspace passed in, reused.
    hq, hkv, d, num_splits = 4, 2, 64, 3
    ws = DecodeWorkspace.allocate(6, hq, num_splits, d, torch.device(DEVICE))
    for seed, seq_lens in enumerate(([40, 7, 1], [16, 33, 2])):
        q, kv, bt, seq = _make_case(seq_lens, hq, hkv, d, 16, torch.float32, seed)
        out_buf = torch.full((3, hq + 1, d), 7.0, device=DEVICE)  # out may be a strided view
        out = out_buf[:, :hq]
        got = paged_decode_attention(q, kv[0], kv[1], bt, seq, 0.125, num_splits, out, ws)
        assert got.data_ptr() == out.data_ptr()
        ref = paged_decode_attention_ref(q, kv[0], kv[1], bt, seq, 0.125)
        torch.testing.assert_close(out, ref, **TOL[torch.float32])
        assert (out_buf[:, hq] == 7.0).all()


@pytest.mark.parametrize(
    ("batch", "hq", "splits", "d"), [(1, 1, 2, 16), (6, 4, 3, 64), (256, 32, 49, 128)]
)
def test_workspace_nbytes_is_what_allocate_takes(batch: int, hq: int, splits: int, d: int) -> None:
    # The engine reserves nbytes before it sizes the KV cache: it must be the tensors' bytes.
    ws = DecodeWorkspace.allocate(batch, hq, splits, d, torch.device("meta"))
    allocated = ws.partial_out.nbytes + ws.lse.nbytes
    assert DecodeWorkspace.nbytes(batch, hq, splits, d) == allocated


def test_choose_num_splits() -> None:
    assert choose_num_splits(256, 8, 16384) == 1  # 2048 programs already fill 132 SMs
    assert choose_num_splits(64, 8, 4096) == 2
    assert choose_num_splits(1, 8, 16384) == 64  # 16384 / MIN_TOKENS_PER_SPLIT (256)
    assert choose_num_splits(1, 8, 300) == 1  # too few keys to be worth splitting
    assert choose_num_splits(4, 2, 0) == 1
    for batch in (1, 3, 16, 64, 256):
        for ctx in (1, 1000, 4096, 16384):
            s = choose_num_splits(batch, 8, ctx)
            assert 1 <= s <= MAX_SPLITS
            assert s == choose_num_splits(batch, 8, ctx)  # pure
    with pytest.raises(ValueError, match="batch"):
        choose_num_splits(0, 8, 1024)


def test_rejects_bad_inputs() -> None:
    q, kv, bt, seq = _make_case([5, 9], 4, 2, 64, 16, torch.float32)
    k, v = kv[0], kv[1]
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(q, k, v, bt.long(), seq, 0.1, 2)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(q, k, v, bt, seq[:1], 0.1, 2)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(q[:, :3], k, v, bt, seq, 0.1, 2)
    with pytest.raises(ValueError, match="dtypes"):
        paged_decode_attention(q.half(), k, v, bt, seq, 0.1, 2)
    with pytest.raises(ValueError, match="workspace"):
        ws = DecodeWorkspace.allocate(2, 4, 3, 64, torch.device(DEVICE))  # 3 splits, not 2
        paged_decode_attention(q, k, v, bt, seq, 0.1, 2, workspace=ws)


# --- GPU: full size and CUDA graphs -------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [None, 1, 16])  # None: choose_num_splits
def test_full_size_gpu(block_size, dtype, num_splits) -> None:
    # Llama-3-8B decode: 64 requests, ragged contexts up to 16k, 32 q / 8 kv heads, d 128.
    gen = torch.Generator().manual_seed(block_size)
    seq_lens = torch.randint(1, 16385, (64,), generator=gen)
    seq_lens[:4] = torch.tensor([1, block_size - 1, block_size, 16384])
    splits = num_splits or choose_num_splits(64, 8, 16384)
    _check(seq_lens.tolist(), 32, 8, 128, block_size, dtype, splits, seed=block_size)


@pytest.mark.gpu
def test_cuda_graph_replay_gpu() -> None:
    # Capture once; later steps change seq_lens, block_tables, q and the cache in place.
    hq, hkv, d, block_size, batch, max_blocks = 32, 8, 128, 16, 8, 160
    dtype, scale = torch.bfloat16, 128**-0.5
    num_splits = choose_num_splits(batch, hkv, max_blocks * block_size)
    steps = [
        [1, 15, 16, 2048, 700, 33, 1000, 0],  # the last row is graph padding
        [2048, 1, 17, 64, 1999, 5, 0, 0],
        [300] * batch,
    ]
    q_buf = torch.empty(batch, hq, d, device="cuda", dtype=dtype)
    bt_buf = torch.zeros(batch, max_blocks, device="cuda", dtype=torch.int32)
    seq_buf = torch.zeros(batch, device="cuda", dtype=torch.int32)
    cases = [_make_case(s, hq, hkv, d, block_size, dtype, seed=i) for i, s in enumerate(steps)]
    num_blocks = max(c[1].shape[1] for c in cases)
    kv_buf = torch.empty(2, num_blocks, block_size, hkv, d, device="cuda", dtype=dtype)
    out = torch.empty(batch, hq, d, device="cuda", dtype=dtype)
    ws = DecodeWorkspace.allocate(batch, hq, num_splits, d, torch.device("cuda"))

    def step() -> None:
        paged_decode_attention(q_buf, kv_buf[0], kv_buf[1], bt_buf, seq_buf, scale, num_splits,
                               out, ws)  # fmt: skip

    def load(case) -> None:
        q, kv, bt, seq = case
        q_buf.copy_(q)
        kv_buf.fill_(float("nan"))
        kv_buf[:, : kv.shape[1]].copy_(kv)
        bt_buf.zero_()
        bt_buf[:, : bt.shape[1]].copy_(bt)
        seq_buf.copy_(seq)

    load(cases[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for case in cases:
        load(case)
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_decode_attention_ref(q_buf, kv_buf[0], kv_buf[1], bt_buf, seq_buf, scale)
        assert not out.isnan().any()
        torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def test_fixed_split_boundaries_make_results_batch_invariant() -> None:
    """With split_keys, a request's output is bit-identical whatever the grid's split count
    or its batch neighbours: the engine relies on it for CUDA-graph == eager decoding."""
    seq_lens = [1, 40, 70, 129]
    q, kv, bt, seq = _make_case(seq_lens, 8, 2, 64, 16, torch.float32)
    scale = 64**-0.5
    ref = paged_decode_attention_ref(q, kv[0], kv[1], bt, seq, scale)
    outs = [
        paged_decode_attention(q, kv[0], kv[1], bt, seq, scale, splits, block_n=16, split_keys=32)
        for splits in (5, 8)  # 5 = cdiv(129, 32) covers the longest; 8 adds empty splits
    ]
    torch.testing.assert_close(outs[0], ref, **TOL[torch.float32])
    assert torch.equal(outs[0], outs[1])
    alone = paged_decode_attention(
        q[2:3], kv[0], kv[1], bt[2:3], seq[2:3], scale, 3, block_n=16, split_keys=32
    )
    assert torch.equal(alone[0], outs[0][2])


@pytest.mark.parametrize("max_query_len", [1, 3])
def test_programs_sharing_splits_give_the_same_bits(max_query_len: int) -> None:
    """Fewer programs than splits (each walking a run of a request's splits) give exactly
    the bits of one program a split: the engine picks the program count per step and batch
    size, so it must not change a token. Requests of 0 keys (zeros), under a split, and of
    9 splits (8 one-tile splits, then a tier of two-tile ones); fixed and equal-run splits."""
    seq_lens = [0, 1, 40, 160]
    q_lens = [min(max_query_len, max(n, 1)) for n in seq_lens]
    _, kv, bt, seq = _make_case(seq_lens, 4, 2, 32, 16, torch.float32)
    q, qsl = _multi_query(q_lens, 4, 32, torch.float32)
    scale = 32**-0.5
    multi = {"query_start_loc": qsl, "max_query_len": max_query_len}
    ref = paged_decode_attention_ref(q, kv[0], kv[1], bt, seq, scale, query_start_loc=qsl)
    for split_keys in (16, None):
        outs = [
            paged_decode_attention(
                q,
                kv[0],
                kv[1],
                bt,
                seq,
                scale,
                9,
                block_n=16,
                split_keys=split_keys,
                split_programs=programs,
                **multi,
            )  # fmt: skip
            for programs in (9, 1, 4)
        ]
        torch.testing.assert_close(outs[0], ref, **TOL[torch.float32])
        for out in outs[1:]:
            assert torch.equal(out, outs[0])
    assert not outs[0][: q_lens[0]].any()  # the empty request


@triton.jit
def _split_round_trip(tiles_ptr, split_ptr, start_ptr, next_ptr, base, N: tl.constexpr):
    tiles = tl.load(tiles_ptr + tl.arange(0, N))
    split = _split_of_tile(tiles, base, True)
    tl.store(split_ptr + tl.arange(0, N), split)
    tl.store(start_ptr + tl.arange(0, N), _split_start(split, base, True))
    tl.store(next_ptr + tl.arange(0, N), _split_start(split + 1, base, True))


@pytest.mark.parametrize("base", [1, 4, 32])
def test_growing_splits_cover_every_tile_once(base: int) -> None:
    """Split s of the growing fixed splits: 8 of ``base`` tiles, 8 of twice that, ...; each
    tile up to 2^21 lies in exactly one, found by _split_of_tile (a float log2 corrected
    by one) and bounded by _split_start: start(s) <= t < start(s + 1), s non-decreasing."""
    n = 1 << 16
    tiles = torch.cat([torch.arange(n // 2), torch.randint(0, 1 << 21, (n // 2,)).sort().values])
    tiles = tiles.to(torch.int32).to(DEVICE)
    split, start, nxt = (torch.empty_like(tiles) for _ in range(3))
    _split_round_trip[(1,)](tiles, split, start, nxt, base, N=n)
    assert bool(((start <= tiles) & (tiles < nxt)).all())
    assert bool((split[1 : n // 2] - split[: n // 2 - 1] <= 1).all())
    assert split[8 * base].item() == 8 and nxt[8 * base].item() == 8 * base + 2 * base


# --- a few query tokens per request (draft tokens) -----------------------------------------


def _multi_query(q_lens: list[int], hq: int, d: int, dtype: torch.dtype, seed: int = 0):
    """Query rows for requests with ``q_lens`` tokens each: q [T, Hq, d] and query_start_loc."""
    gen = torch.Generator().manual_seed(seed + 100)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(DEVICE, dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, qsl.to(DEVICE)


# (q_lens, seq_lens, hq, hkv, block_size, block_n, num_splits, split_keys, dtype)
MULTI_CASES = [
    ([3, 1, 5, 2], [3, 17, 40, 129], 9, 3, 16, 16, 1, None, torch.float32),  # SmolLM2 heads
    ([4, 4, 4], [70, 5, 33], 8, 2, 16, 32, 3, None, torch.bfloat16),
    ([2, 5, 1], [129, 64, 1], 8, 1, 32, 16, 5, 32, torch.float16),  # fixed split boundaries
    # Left-padded rows as a captured graph lays them out: 4 tokens a request, a request
    # shorter than that (its first tokens see no key), and an empty padding request.
    ([4, 4, 4], [2, 50, 0], 4, 4, 16, 16, 3, 32, torch.float32),
]


@pytest.mark.parametrize(
    ("q_lens", "seq_lens", "hq", "hkv", "block_size", "block_n", "num_splits", "split_keys",
     "dtype"),
    MULTI_CASES,
)  # fmt: skip
def test_multi_query_matches_reference(
    q_lens, seq_lens, hq, hkv, block_size, block_n, num_splits, split_keys, dtype
) -> None:
    d = 64
    _, kv, bt, seq = _make_case(seq_lens, hq, hkv, d, block_size, dtype)
    q, qsl = _multi_query(q_lens, hq, d, dtype)
    scale = d**-0.5
    out = paged_decode_attention(
        q, kv[0], kv[1], bt, seq, scale, num_splits, block_n=block_n, split_keys=split_keys,
        query_start_loc=qsl, max_query_len=max(q_lens),
    )  # fmt: skip
    ref = paged_decode_attention_ref(q, kv[0], kv[1], bt, seq, scale, query_start_loc=qsl)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def test_a_draft_token_attends_like_a_one_token_request() -> None:
    """Token i of a request's q tokens gives what a one-token request of length
    seq_len - q + 1 + i gives: on the GPU bit for bit (fixed split boundaries; the dots
    reduce in the same order whatever the tile's row count), so a row's tokens do not depend
    on how many drafts rode with it. The interpreter's numpy dots may round differently."""
    hq, hkv, d, q_lens, seq_lens = 6, 2, 64, [3, 1], [45, 20]
    _, kv, bt, seq = _make_case(seq_lens, hq, hkv, d, 16, torch.float32)
    q, qsl = _multi_query(q_lens, hq, d, torch.float32)
    kw = dict(block_n=16, split_keys=32)
    multi = paged_decode_attention(
        q, kv[0], kv[1], bt, seq, 0.125, 2, query_start_loc=qsl, max_query_len=4, **kw
    )
    for i, length in enumerate([43, 44, 45]):
        one = paged_decode_attention(
            q[i : i + 1], kv[0], kv[1], bt[:1], torch.tensor([length], dtype=torch.int32,
            device=DEVICE), 0.125, 2, **kw,
        )  # fmt: skip
        if DEVICE == "cuda":
            assert torch.equal(one[0], multi[i])
        else:
            torch.testing.assert_close(one[0], multi[i], rtol=1e-6, atol=1e-6)


def test_multi_query_rejects_a_missing_query_start_loc() -> None:
    q, kv, bt, seq = _make_case([5, 9], 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_decode_attention(q, kv[0], kv[1], bt, seq, 0.1, 2, max_query_len=2)
    with pytest.raises(ValueError, match="query_start_loc"):
        qsl = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)  # [B + 1] is [3]
        paged_decode_attention(q, kv[0], kv[1], bt, seq, 0.1, 2, query_start_loc=qsl)


def test_one_token_query_start_loc_must_give_every_request_its_token() -> None:
    """With max_query_len=1 the kernel takes request b's token as row b and reads no
    query_start_loc: a request without a token (qsl [0, 1, 1, 2]) would shift the rows after
    it (here: write a third row of a two-row output), so such a call is refused."""
    _, kv, bt, seq = _make_case([5, 9, 7], 4, 2, 64, 16, torch.float32)
    q, qsl = _multi_query([1, 0, 1], 4, 64, torch.float32)
    with pytest.raises(ValueError, match="got 2 rows for 3 requests"):
        paged_decode_attention(q, kv[0], kv[1], bt, seq, 0.1, 2, query_start_loc=qsl)
    out = paged_decode_attention(
        q, kv[0], kv[1], bt, seq, 0.1, 2, query_start_loc=qsl, max_query_len=2
    )
    ref = paged_decode_attention_ref(q, kv[0], kv[1], bt, seq, 0.1, query_start_loc=qsl)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
