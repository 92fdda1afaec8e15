"""The torch attention backend against attention written out row by row in float64.

Steps mix decode rows of one or a few query tokens (batched matmuls on CPU fp32, SDPA
otherwise), fresh prefills (grouped: back to back and equally long, or padded) and long chunks
continuing a cached prefix; every query must see exactly its own keys 0..position through its
block table.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.engine.attention.metadata import CommonAttentionMetadata
from tokenmill.engine.attention.scratch import ScratchBuffers
from tokenmill.engine.attention.torch_backend import TorchAttentionBackend
from tokenmill.engine.attention.torch_decode import MAX_DECODE_QUERY_LEN

NUM_BLOCKS = 256


def _step(
    query_lens: list[int], seq_lens: list[int], block_size: int, seed: int
) -> CommonAttentionMetadata:
    """A step whose request i has query_lens[i] new tokens ending at seq_lens[i], its blocks
    drawn at random without reuse (block tables padded with 0, itself a live block)."""
    g = torch.Generator().manual_seed(seed)
    widths = [-(-s // block_size) for s in seq_lens]
    ids = torch.randperm(NUM_BLOCKS, generator=g)[: sum(widths)].tolist()
    table = torch.zeros(len(seq_lens), max(widths), dtype=torch.int32)
    slots = []
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        blocks, ids = ids[: widths[i]], ids[widths[i] :]
        table[i, : widths[i]] = torch.tensor(blocks)
        slots += [
            blocks[p // block_size] * block_size + p % block_size
            for p in range(seq_len - q_len, seq_len)
        ]
    q_lens = np.array(query_lens)
    multi = np.flatnonzero(q_lens != 1)
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=table,
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_lens_host=q_lens,
        seq_lens_host=np.array(seq_lens),
        block_size=block_size,
        num_decodes=int(multi[0]) if len(multi) else len(q_lens),
    )


def _reference(
    q: torch.Tensor, kv_cache: torch.Tensor, common: CommonAttentionMetadata, scale: float
) -> torch.Tensor:
    """Row by row in float64 over the cache as the backend left it (the step's k/v stored)."""
    bs = common.block_size
    group = q.shape[1] // kv_cache.shape[3]
    out = torch.empty(q.shape, dtype=torch.float64)
    t = 0
    for i, (q_len, seq_len) in enumerate(
        zip(common.query_lens_host, common.seq_lens_host, strict=True)
    ):
        blocks = common.block_tables[i, : -(-seq_len // bs)].long()
        keys, vals = (kv_cache[j][blocks].flatten(0, 1)[:seq_len].double() for j in (0, 1))
        keys, vals = (x.repeat_interleave(group, dim=1) for x in (keys, vals))  # [S, Hq, d]
        for j in range(q_len):
            visible = seq_len - q_len + j + 1
            scores = torch.einsum("hd,shd->hs", q[t].double(), keys[:visible]) * scale
            out[t] = torch.einsum("hs,shd->hd", scores.softmax(-1), vals[:visible])
            t += 1
    return out


def _run(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    heads: tuple[int, int] = (4, 2),
    head_dim: int = 16,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    backend: TorchAttentionBackend | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(backend output, float64 reference) for one step on random q, k, v and cache."""
    n_q, n_kv = heads
    common = _step(query_lens, seq_lens, block_size, seed)
    g = torch.Generator().manual_seed(seed + 1)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, n_q, head_dim, generator=g).to(dtype)
    k = torch.randn(num_tokens, n_kv, head_dim, generator=g).to(dtype)
    v = torch.randn(num_tokens, n_kv, head_dim, generator=g).to(dtype)
    kv_cache = torch.randn(2, NUM_BLOCKS, block_size, n_kv, head_dim, generator=g).to(dtype)
    backend = backend or TorchAttentionBackend()
    scale = head_dim**-0.5
    given = torch.full_like(q, float("nan"))  # a caller's buffer, every token written
    out = backend.forward(q, k, v, kv_cache.clone(), backend.build(common), scale, out=given)
    assert out is given
    fresh = backend.forward(q, k, v, kv_cache, backend.build(common), scale)
    torch.testing.assert_close(fresh, given, rtol=0, atol=0)
    return fresh, _reference(q, kv_cache, common, scale)


# fp32 against float64: sums of <= 64 products of unit-variance terms, ~1e-6 relative error.
_FP32 = {"atol": 1e-5, "rtol": 1e-5}


@pytest.mark.parametrize(
    ("heads", "block_size"),
    [((4, 2), 4), ((4, 1), 16), ((4, 4), 1), ((6, 2), 8)],
    ids=["gqa-bs4", "mqa-bs16", "mha-bs1", "gqa3-bs8"],
)
def test_decode_rows_of_any_length(heads: tuple[int, int], block_size: int) -> None:
    """Rows of lengths 1 .. 37 in one batch: shorter rows' padding blocks (block 0, which
    another row owns) must be masked out."""
    seq_lens = [1, 37, 5, 16, 17, 33, 2, 4]
    out, ref = _run([1] * len(seq_lens), seq_lens, heads=heads, block_size=block_size)
    torch.testing.assert_close(out.double(), ref, **_FP32)


def test_decode_rows_of_equal_length() -> None:
    out, ref = _run([1] * 6, [12] * 6, block_size=4)
    torch.testing.assert_close(out.double(), ref, **_FP32)


@pytest.mark.parametrize(
    ("heads", "block_size"), [((4, 2), 4), ((4, 1), 16), ((6, 3), 1)], ids=["gqa", "mqa", "g2-bs1"]
)
def test_rows_of_a_few_tokens(heads: tuple[int, int], block_size: int) -> None:
    """Rows of 2..16 query tokens at the end of their keys (a last token and its drafts),
    padded to the widest: each query sees keys up to its own position only."""
    query_lens = [3, 2, 5, 16, 4, 2]
    seq_lens = [9, 2, 30, 16 + 7, 4 + 1, 40]
    out, ref = _run(query_lens, seq_lens, heads=heads, block_size=block_size)
    torch.testing.assert_close(out.double(), ref, **_FP32)


def test_mixed_step() -> None:
    """One-token rows first, rows with drafts, fresh prefills of several lengths (a padded
    group) and chunks continuing a cached prefix: short ones batched with the drafts, one
    past MAX_DECODE_QUERY_LEN on its own."""
    query_lens = [1, 1, 1, 3, 3, 5, 3, 7, 4, 6, MAX_DECODE_QUERY_LEN + 2]
    seq_lens = [9, 2, 20, 11, 3 + 4, 5, 3, 7, 10, 17, MAX_DECODE_QUERY_LEN + 13]
    meta = TorchAttentionBackend().build(_step(query_lens, seq_lens, block_size=4, seed=0))
    assert [rows.num_queries for rows in meta.decodes] == [1, 6]
    assert len(meta.prefills) == 1 and len(meta.fresh_groups) == 1
    out, ref = _run(query_lens, seq_lens, block_size=4)
    torch.testing.assert_close(out.double(), ref, **_FP32)


def test_fresh_prefills_back_to_back_run_as_views() -> None:
    """Equally long fresh prefills that sit back to back form one group read through views
    (no index tensors), beside decode rows."""
    query_lens, seq_lens = [1, 1, 6, 6, 6], [7, 3, 6, 6, 6]
    common = _step(query_lens, seq_lens, block_size=4, seed=0)
    (group,) = TorchAttentionBackend().build(common).fresh_groups
    assert group.token_index is None and group.shape == (3, 6)
    out, ref = _run(query_lens, seq_lens, block_size=4)
    torch.testing.assert_close(out.double(), ref, **_FP32)


def test_decode_rows_after_prefills() -> None:
    """Decode rows that do not lead the batch are gathered by token index."""
    query_lens = [4, 1, 3, 1, 1]
    seq_lens = [4, 13, 8, 1, 6]
    out, ref = _run(query_lens, seq_lens, block_size=4)
    torch.testing.assert_close(out.double(), ref, **_FP32)


def test_bfloat16_uses_sdpa() -> None:
    """Half precision goes through SDPA (fp32 accumulation); bf16 inputs carry ~3 significant
    digits, so the bound is bf16's rounding of the output, not the reference's."""
    query_lens = [1, 1, 3, 2, 4]
    seq_lens = [1, 19, 6, 11, 4]
    out, ref = _run(query_lens, seq_lens, dtype=torch.bfloat16, block_size=4)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_scratch_reused_across_batch_sizes() -> None:
    """One backend (one set of scratch buffers) over steps that grow, shrink and grow: a kept
    buffer larger than the step must not leak stale rows into it."""
    backend = TorchAttentionBackend()
    for n, length in [(3, 9), (12, 30), (2, 5), (20, 41)]:
        seq_lens = [length - i % 4 for i in range(n)]
        out, ref = _run([1] * n, seq_lens, backend=backend, seed=n)
        torch.testing.assert_close(out.double(), ref, **_FP32)


def test_scratch_buffers() -> None:
    scratch = ScratchBuffers(max_bytes=1024)
    like = torch.empty(0)
    a = scratch.get("a", (4, 8), like)
    assert scratch.get("a", (2, 8), like).data_ptr() == a.data_ptr()
    assert scratch.get("b", (4, 8), like).data_ptr() != a.data_ptr()
    big = scratch.get("a", (16, 32), like)  # 2 KiB: over the cap, fresh and not kept
    assert big.shape == (16, 32) and big.data_ptr() != a.data_ptr()
    assert scratch.get("a", (4, 8), like).data_ptr() == a.data_ptr()
