"""Tree masks in paged prefill attention: a speculative step's candidate branches in one
request, each query seeing the context and only its own ancestors among the step's tokens.

The reference (``tree_visible`` in ``paged_prefill_attention_ref``) is checked against a
float64 softmax over the keys a tree lists explicitly, then the kernel (the interpreter on
CPU) against the reference on ragged batches that mix tree requests with causal ones.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.devices import gpu_also
from tests.kernels.test_paged_prefill_attention import DEVICE, TOLERANCES, make_batch
from tokenmill.kernels.paged_prefill_attention import (
    PrefillAttentionConfig,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)


def random_tree(n: int, generator: torch.Generator) -> list[int]:
    """Parents of n step tokens in topological order: token 0 (the request's last token) is
    the root, every other token hangs under an earlier one."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, n)]


def tree_masks(parents: list[int]) -> list[int]:
    """Each token's mask: itself and its ancestors, as signed int64 values."""
    masks: list[int] = []
    for i, p in enumerate(parents):
        masks.append((masks[p] if p >= 0 else 0) | (1 << i))
    return [m - (1 << 64) if m >= 1 << 63 else m for m in masks]


def masks_for(requests, trees: dict[int, list[int]]) -> torch.Tensor:
    """[T] int64: the trees' masks for the requests in ``trees``, -1 (causal) elsewhere."""
    out: list[int] = []
    for b, (q_len, _) in enumerate(requests):
        out += tree_masks(trees[b]) if b in trees else [-1] * q_len
    return torch.tensor(out, dtype=torch.int64, device=DEVICE)


def ancestors(parents: list[int], i: int) -> list[int]:
    chain = []
    while i >= 0:
        chain.append(i)
        i = parents[i]
    return chain


def test_reference_equals_attention_over_each_branchs_keys() -> None:
    """Each tree token attends exactly to the context and its own ancestors (float64 sum)."""
    g = torch.Generator().manual_seed(1)
    requests = [(12, 30), (9, 9)]  # a tree after a 18-token context, and a tree of a prompt
    trees = {0: random_tree(12, g), 1: random_tree(9, g)}
    args = make_batch(requests, 4, 2, 32, 16, torch.float32)
    q, k_cache, v_cache, block_tables, qsl, seq_lens = args[:6]
    out = paged_prefill_attention_ref(*args, tree_mask=masks_for(requests, trees))
    flat_k = k_cache.reshape(-1, 2, 32).double()
    flat_v = v_cache.reshape(-1, 2, 32).double()
    for b, (q_len, seq_len) in enumerate(requests):
        ctx = seq_len - q_len
        for i in range(q_len):
            keys = list(range(ctx)) + sorted(ctx + j for j in ancestors(trees[b], i))
            pos = torch.tensor(keys, device=block_tables.device)
            slots = block_tables[b, pos // 16].long() * 16 + pos % 16
            k = flat_k[slots].repeat_interleave(2, dim=1)  # [K, Hq, d]
            v = flat_v[slots].repeat_interleave(2, dim=1)
            qi = q[int(qsl[b]) + i].double()  # [Hq, d]
            probs = torch.softmax(torch.einsum("hd,khd->hk", qi, k) * args[7], dim=-1)
            want = torch.einsum("hk,khd->hd", probs, v)
            torch.testing.assert_close(out[int(qsl[b]) + i].double(), want, atol=1e-5, rtol=1e-5)


def test_all_ones_masks_are_causal() -> None:
    """-1 masks (a row longer than 64 tokens included) change nothing: bit for bit in the
    interpreter; on the GPU within fp32 rounding (the kernel compiled with a mask may contract
    its multiply-adds differently from the one without)."""
    requests = [(70, 90), (5, 5), (1, 12)]
    args = make_batch(requests, 4, 2, 32, 16, torch.float32)
    causal = paged_prefill_attention(*args)
    masked = paged_prefill_attention(*args, tree_mask=masks_for(requests, {}))
    if causal.is_cuda:
        torch.testing.assert_close(masked, causal, atol=1e-6, rtol=1e-5)
    else:
        assert torch.equal(causal, masked)
    assert torch.equal(paged_prefill_attention_ref(*args, tree_mask=masks_for(requests, {})),
                       paged_prefill_attention_ref(*args))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, gpu_also(torch.bfloat16)], ids=str)
@pytest.mark.parametrize(
    ("block_size", "config"),
    [
        (16, PrefillAttentionConfig(block_m=16, block_n=32)),  # key tiles gathered per token
        (32, PrefillAttentionConfig(block_m=64, block_n=16)),  # key tiles inside a block
        (16, PrefillAttentionConfig(block_m=32, block_n=16, read_new_keys=True)),
        (16, PrefillAttentionConfig(block_m=32, block_n=16, pack_gqa=False)),
    ],
    ids=["gather", "in-block", "read-new", "unpacked"],
)
def test_kernel_matches_reference_on_trees(block_size, config, dtype) -> None:
    """Trees of 1-64 tokens (64: bit 63, a negative mask) beside causal prefill chunks."""
    g = torch.Generator().manual_seed(2)
    requests = [(23, 90), (17, 40), (1, 12), (64, 80), (6, 6), (33, 33)]
    trees = {1: random_tree(17, g), 2: [-1], 3: random_tree(64, g), 4: random_tree(6, g)}
    args = make_batch(requests, 9, 3, 64, block_size, dtype)
    masks = masks_for(requests, trees)
    k_new = v_new = None
    if config.read_new_keys:
        k_new, v_new = _step_keys(args)
    out = paged_prefill_attention(*args, config=config, k_new=k_new, v_new=v_new, tree_mask=masks)
    ref = paged_prefill_attention_ref(*args, tree_mask=masks)
    assert not out.isnan().any()
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    # the tree changes what those rows see: the causal result differs there
    causal = paged_prefill_attention_ref(*args)
    assert not torch.allclose(causal[40:57].float(), ref[40:57].float(), atol=atol, rtol=rtol)


def _step_keys(args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """k_new / v_new: the cache's rows at each request's step tokens, in query order."""
    q, k_cache, v_cache, block_tables, qsl, seq_lens = args[:6]
    bs = k_cache.shape[1]
    slots = []
    for b, seq_len in enumerate(seq_lens.tolist()):
        pos = torch.arange(seq_len - int(qsl[b + 1] - qsl[b]), seq_len, device=q.device)
        slots.append(block_tables[b, pos // bs].long() * bs + pos % bs)
    rows = torch.cat(slots)
    return (
        k_cache.reshape(-1, *k_cache.shape[2:])[rows].clone(),
        v_cache.reshape(-1, *v_cache.shape[2:])[rows].clone(),
    )


def test_bad_tree_mask_is_refused() -> None:
    args = make_batch([(3, 3)], 4, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="tree_mask"):
        paged_prefill_attention(*args, tree_mask=torch.zeros(3, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fresh_tiles", [False, True], ids=["paged", "read-new"])
def test_gpu_default_tiles_on_trees(fresh_tiles: bool) -> None:
    """Llama-3-8B heads (32/8, d 128), bf16, the default tiles, trees of up to 64 tokens
    after long contexts beside prefill chunks."""
    from tokenmill.kernels.paged_prefill_config import default_prefill_config

    g = torch.Generator().manual_seed(3)
    requests = [(512, 2048), (43, 1500), (64, 4000), (8, 300), (300, 300)]
    trees = {1: random_tree(43, g), 2: random_tree(64, g), 3: random_tree(8, g)}
    args = make_batch(requests, 32, 8, 128, 16, torch.bfloat16, device="cuda")
    masks = masks_for(requests, trees).cuda()
    config = default_prefill_config(128, torch.bfloat16, False)
    k_new = v_new = None
    if fresh_tiles:
        config = dataclasses.replace(config, read_new_keys=True)
        k_new, v_new = _step_keys(args)
    out = paged_prefill_attention(*args, config=config, k_new=k_new, v_new=v_new, tree_mask=masks)
    ref = paged_prefill_attention_ref(*args, tree_mask=masks)
    atol, rtol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
