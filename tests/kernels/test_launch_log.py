"""LaunchLog: a layer's attention launches recorded once and launched again over other layers'
caches give, bit for bit, what launching each layer through the wrappers gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.engine.attention.metadata import CommonAttentionMetadata
from tokenmill.engine.attention.triton_backend import TritonAttentionBackend
from tokenmill.kernels.fp8_kv import FP8_KV
from tokenmill.kernels.kv_store import store_kv
from tokenmill.kernels.launch_log import LaunchLog

BLOCK = 16
HQ, HKV, D = 6, 2, 64


def _mixed_step(device: str, dtype: torch.dtype, layers: int, cache_dtype: torch.dtype):
    """Three decode rows (one of 1,300 keys: several splits; one with 2 drafts) before two
    prompt chunks (one fresh, one after 40 cached keys), over ``layers`` layers' caches."""
    g = torch.Generator().manual_seed(0)
    query = np.array([1, 3, 1, 37, 20])
    seqs = np.array([1300, 90, 17, 37, 60])
    blocks = -(-seqs // BLOCK)
    table = np.zeros((len(seqs), blocks.max()), dtype=np.int32)
    start = 0
    for r, b in enumerate(blocks):
        table[r, :b] = np.arange(start, start + b)
        start += b
    slots = []
    for r in range(len(seqs)):
        for p in range(seqs[r] - query[r], seqs[r]):
            slots.append(table[r, p // BLOCK] * BLOCK + p % BLOCK)
    t = int(query.sum())
    cache = torch.randn(layers, 2, start, BLOCK, HKV, D, generator=g).to(device, cache_dtype)
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor(np.r_[0, np.cumsum(query)], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seqs, dtype=torch.int32, device=device),
        block_tables=torch.tensor(table, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_lens_host=query,
        seq_lens_host=seqs,
        block_size=BLOCK,
        num_decodes=3,
    )
    q = torch.randn(t, HQ, D, generator=g).to(device, dtype)
    k = torch.randn(t, HKV, D, generator=g).to(device, dtype)
    v = torch.randn(t, HKV, D, generator=g).to(device, dtype)
    return common, q, k, v, cache


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, FP8_KV)],
)
def test_gpu_replayed_layers_equal_launched_layers(dtype, cache_dtype) -> None:
    layers = 4
    common, q, k, v, cache = _mixed_step("cuda", dtype, layers, cache_dtype)
    backend = TritonAttentionBackend(HKV)
    backend.set_engine_limits(max_model_len=2048, max_num_seqs=8, device=torch.device("cuda"))
    meta = backend.build(common)
    assert meta.num_splits > 1 and not meta.decode_only  # the decode merge and prefill too
    want_cache, replay_cache = cache.clone(), cache.clone()
    out = torch.zeros_like(q)
    want = []
    for layer in range(layers):
        backend.forward(q, k, v, want_cache[layer], meta, 0.125, out=out)
        want.append(out.clone())
    out.zero_()
    views: dict[tuple, torch.Tensor] = {}
    with LaunchLog.recording() as log:
        backend.forward(q, k, v, replay_cache[0], meta, 0.125, out=out)
    assert log.replayable and len(log.launches) == 4  # store, split, merge, prefill
    log.swaps(replay_cache[0])
    got = [out.clone()]
    for layer in range(1, layers):
        out.zero_()
        log.replay(replay_cache[layer], views)
        got.append(out.clone())
    for layer in range(layers):
        assert torch.equal(got[layer], want[layer]), layer
    assert torch.equal(replay_cache.view(torch.uint8), want_cache.view(torch.uint8))


@pytest.mark.gpu
def test_gpu_replay_refuses_another_layout() -> None:
    common, q, k, v, cache = _mixed_step("cuda", torch.float32, 2, torch.float32)
    backend = TritonAttentionBackend(HKV)
    backend.set_engine_limits(max_model_len=2048, max_num_seqs=8, device=torch.device("cuda"))
    meta = backend.build(common)
    with LaunchLog.recording() as log:
        backend.forward(q, k, v, cache[0], meta, 0.125, out=torch.empty_like(q))
    with pytest.raises(RuntimeError, match="nothing replayable"):
        log.replay(cache[1], {})
    log.swaps(cache[0])
    with pytest.raises(ValueError, match="not laid out"):
        log.replay(cache[1].transpose(1, 2), {})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter's case")
def test_interpreted_launches_are_not_replayable() -> None:
    """Under the interpreter a launch gives no compiled kernel: the log says so, and the
    caller launches every layer itself."""
    k = torch.randn(3, HKV, D)
    cache = torch.zeros(2, 2, BLOCK, HKV, D)
    with LaunchLog.recording() as log:
        store_kv(k, k, cache[0], cache[1], torch.tensor([0, 5, -1]))
    assert not log.replayable
    assert torch.equal(cache[0, 0, 5], k[1])  # it ran
