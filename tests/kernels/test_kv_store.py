"""store_kv (Triton) against store_kv_ref: every written slot, and nothing else, must match."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.kv_store import store_kv, store_kv_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _case(
    t: int, hq: int, hkv: int, d: int, nb: int, bs: int, dtype: torch.dtype, n_pad: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(t * 1000 + hkv * 10 + d)
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=gen).to(DEVICE, dtype)  # [T, Hq+2Hkv, d]
    cache = torch.randn(2, nb, bs, hkv, d, generator=gen).to(DEVICE, dtype)
    slots = torch.randperm(nb * bs, generator=gen)[:t]  # distinct slots, any block
    slots[torch.randperm(t, generator=gen)[:n_pad]] = -1  # padding tokens
    return qkv, cache, slots.to(DEVICE), cache.clone()


def _run(qkv, cache, slots, cache_ref, hq: int, hkv: int) -> None:
    k, v = qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]  # strided views, as in the engine
    store_kv(k, v, cache[0], cache[1], slots)
    store_kv_ref(k, v, cache_ref[0], cache_ref[1], slots)
    # Exact: the kernel copies bits; untouched slots (and padding tokens) must keep theirs.
    torch.testing.assert_close(cache, cache_ref, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "hq", "hkv", "d", "n_pad"), [(6, 4, 2, 64, 2), (5, 3, 3, 128, 1)])
def test_store_kv_matches_ref(t, hq, hkv, d, n_pad, dtype) -> None:
    qkv, cache, slots, cache_ref = _case(t, hq, hkv, d, nb=4, bs=4, dtype=dtype, n_pad=n_pad)
    _run(qkv, cache, slots, cache_ref, hq, hkv)
    written = (slots >= 0).sum().item()
    assert written == t - n_pad


def test_store_kv_block_major_layout() -> None:
    # Cache halves that are not contiguous: a [NB, 2, BS, Hkv, d] layout sliced per half.
    t, hkv, d, nb, bs = 5, 2, 64, 3, 4
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(t, 2 * hkv, d, generator=gen).to(DEVICE)
    cache = torch.randn(nb, 2, bs, hkv, d, generator=gen).to(DEVICE)
    cache_ref = cache.clone()
    slots = torch.tensor([11, 0, -1, 4, 7], device=DEVICE)
    k, v = kv[:, :hkv], kv[:, hkv:]
    store_kv(k, v, cache[:, 0], cache[:, 1], slots)
    store_kv_ref(k, v, cache_ref[:, 0], cache_ref[:, 1], slots)
    torch.testing.assert_close(cache, cache_ref, atol=0, rtol=0)  # exact copy


def test_store_kv_rejects_mismatch() -> None:
    k = torch.zeros(2, 2, 64, device=DEVICE)
    cache = torch.zeros(2, 2, 4, 2, 64, dtype=torch.float16, device=DEVICE)
    slots = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="dtypes differ"):
        store_kv(k, k, cache[0], cache[1], slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(k.half(), k.half(), cache[0], cache[1], slots.int())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_store_kv_engine_size(dtype) -> None:
    # Llama-3-8B: 8 KV heads of d 128; 4096 tokens (64 of them padding) into 2048 blocks of 16.
    hq, hkv = 32, 8
    qkv, cache, slots, cache_ref = _case(4096, hq, hkv, 128, 2048, 16, dtype, n_pad=64)
    _run(qkv, cache, slots, cache_ref, hq, hkv)
