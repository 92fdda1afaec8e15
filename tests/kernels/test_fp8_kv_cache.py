"""An FP8 (e4m3) KV cache: the store rounds and clamps like ``to_kv_cache``, and the decode and
prefill kernels read it back into the model's dtype, against their references run on the
same FP8 cache."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_paged_prefill_attention import CPU_REQUESTS, make_batch
from tokenmill.kernels.fp8_kv import FP8_KV, to_kv_cache
from tokenmill.kernels.kv_store import store_kv, store_kv_ref
from tokenmill.kernels.paged_decode_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
)
from tokenmill.kernels.paged_prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=3e-3, atol=3e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_rounds_and_clamps_into_an_fp8_cache(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    k = (torch.randn(6, 2, 64, generator=g) * 40).to(DEVICE, dtype)  # some past 448
    k[0, 0, :4] = torch.tensor([1000.0, -1000.0, 448.0, 0.0])
    v = torch.randn(6, 2, 64, generator=g).to(DEVICE, dtype)
    cache = torch.zeros(2, 4, 4, 2, 64, dtype=FP8_KV, device=DEVICE)
    ref = cache.clone()
    slots = torch.tensor([3, 0, 9, -1, 15, 6], device=DEVICE)
    store_kv(k, v, cache[0], cache[1], slots)
    store_kv_ref(k, v, ref[0], ref[1], slots)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))  # the same bits
    assert cache[0, 0, 3, 0, :4].float().tolist() == [448.0, -448.0, 448.0, 0.0]
    back = cache[1].view(-1, 2, 64)[slots[slots >= 0]].float()
    assert torch.equal(back, to_kv_cache(v[slots >= 0], FP8_KV).float())


def _fp8(kv: torch.Tensor) -> torch.Tensor:
    return to_kv_cache(kv, FP8_KV)  # NaN poison stays NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_lens", [None, [3, 1, 2]], ids=["one-token", "drafts"])
def test_decode_reads_an_fp8_cache(dtype: torch.dtype, q_lens) -> None:
    from tests.kernels.test_paged_decode_attention import _make_case, _multi_query

    seq_lens = [5, 40, 129]
    q, kv, bt, seq = _make_case(seq_lens, 8, 2, 64, 16, dtype)
    kv = _fp8(kv)
    qsl, max_q = None, 1
    if q_lens is not None:
        q, qsl = _multi_query(q_lens, 8, 64, dtype)
        max_q = max(q_lens)
    out = paged_decode_attention(q, kv[0], kv[1], bt, seq, 0.125, 3, split_keys=64,
                                 query_start_loc=qsl, max_query_len=max_q)  # fmt: skip
    ref = paged_decode_attention_ref(q, kv[0], kv[1], bt, seq, 0.125, query_start_loc=qsl)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_reads_an_fp8_cache(dtype: torch.dtype) -> None:
    q, k_cache, v_cache, *rest = make_batch(CPU_REQUESTS, 9, 3, 64, 16, dtype)
    args = (q, _fp8(k_cache), _fp8(v_cache), *rest)
    out = paged_prefill_attention(*args)
    ref = paged_prefill_attention_ref(*args)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
