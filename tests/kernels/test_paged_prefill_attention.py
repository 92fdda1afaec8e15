"""paged_prefill_attention (Triton) against paged_prefill_attention_ref (plain torch).

On CPU the kernel runs in Triton's interpreter: tiny ragged batches, few heads, small tiles.
The ``gpu`` cases run full sizes with the real default tiles on CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.devices import gpu_also
from tokenmill.kernels.paged_prefill_attention import (
    PrefillAttentionConfig,
    default_prefill_config,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)

# the small cases run compiled on a GPU machine, in the interpreter elsewhere
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (atol, rtol) of the kernel output against the fp32 reference rounded to the same dtype.
TOLERANCES = {
    # ieee dots, fp32 accumulation: only summation order differs
    torch.float32: (1e-4, 1e-4),
    # P is rounded to fp16 (2^-11 relative) before P @ V, the output once more; |out| <~ 3
    torch.float16: (3e-3, 3e-3),
    # P is rounded to bf16 (2^-8 relative) before P @ V, and both sides round the output:
    # one bf16 ulp is 1.6e-2 at |out| in [2, 4)
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

# Ragged CPU batch: (q_len, seq_len) per request.
CPU_REQUESTS = [
    (7, 7),  # whole prompt is new
    (1, 12),  # one query after a cached prefix (decode-like)
    (23, 90),  # chunked prefill: 67 cached tokens, context spans many blocks
    (5, 37),  # prefix-cache hit
    (1, 1),  # single-token prompt
]


def make_batch(
    requests: list[tuple[int, int]],
    hq: int,
    hkv: int,
    d: int,
    block_size: int,
    dtype: torch.dtype,
    device: str = DEVICE,
    seed: int = 0,
) -> tuple:
    """Positional arguments of paged_prefill_attention for ``requests``.

    Blocks are assigned in random order (non-contiguous tables); every cache slot that no
    request owns is NaN, so a kernel reading one unmasked fails the comparison. ``q`` is a
    non-contiguous view into a fused qkv projection, ``k_cache``/``v_cache`` views of one
    [2, NB, BS, Hkv, d] tensor, as the engine passes them.
    """
    g = torch.Generator().manual_seed(seed)
    q_lens = [q for q, _ in requests]
    seq_lens = [s for _, s in requests]
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3  # spare blocks: NaN, never referenced
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    block_tables = torch.zeros(len(requests), max(blocks_per_req) + 2, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_req):
        block_tables[b, :n] = perm[used : used + n]
        used += n

    kv = torch.full((2, num_blocks, block_size, hkv, d), float("nan"), dtype=dtype)
    flat = kv.view(2, -1, hkv, d)  # [2, NB * BS, Hkv, d]
    for b, s in enumerate(seq_lens):
        pos = torch.arange(s)
        slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size
        flat[:, slots] = torch.randn(2, s, hkv, d, generator=g).to(dtype)

    t = sum(q_lens)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)  # [T, (Hq + 2 Hkv) * d]
    q = qkv.to(device)[:, : hq * d].view(t, hq, d)  # [T, Hq, d], row stride (Hq + 2 Hkv) * d
    kv = kv.to(device)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return (
        q,
        kv[0],
        kv[1],
        block_tables.to(device),
        query_start_loc.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        max(q_lens),
        d**-0.5,
    )


def assert_matches_ref(args: tuple, config: PrefillAttentionConfig | None = None) -> None:
    out = paged_prefill_attention(*args, config=config)
    ref = paged_prefill_attention_ref(*args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any(), "NaN in the kernel output: an unwritten cache slot was read"
    atol, rtol = TOLERANCES[args[0].dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


# (Hq, Hkv, d): GQA ratios 1, 2, 4 and 3 (SmolLM2: 9 query heads, 3 KV heads, d 64).
CPU_HEADS = [(2, 2, 64), (4, 2, 64), (8, 2, 128), (9, 3, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, gpu_also(torch.float16), torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", CPU_HEADS, ids=lambda h: f"hq{h[0]}-hkv{h[1]}-d{h[2]}")
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_ref(dtype: torch.dtype, heads: tuple[int, int, int], block_size: int) -> None:
    hq, hkv, d = heads
    assert_matches_ref(make_batch(CPU_REQUESTS, hq, hkv, d, block_size, dtype))


@pytest.mark.parametrize(
    "block_size, config",
    [
        # key tile = 2 cache blocks: per-token block ids gathered from the table
        (16, PrefillAttentionConfig(block_m=16, block_n=32)),
        # key tile = half a cache block: one block id per tile
        (32, PrefillAttentionConfig(block_m=64, block_n=16)),
        # one query head per tile (no GQA packing)
        (16, PrefillAttentionConfig(block_m=32, block_n=16, pack_gqa=False)),
        # the GPU default tile for d 64: a whole request in one tile
        (16, PrefillAttentionConfig(block_m=128, block_n=64, num_warps=4, num_stages=3)),
        # block size 12 against 16-key tiles: a block id per key
        (12, PrefillAttentionConfig(block_m=16, block_n=16)),
    ],
    ids=["gather", "in-block", "unpacked", "gpu-default", "block-12"],
)
def test_tile_configs(block_size: int, config: PrefillAttentionConfig) -> None:
    assert_matches_ref(make_batch(CPU_REQUESTS, 9, 3, 64, block_size, torch.float16), config)


def test_writes_into_out_and_skips_empty_requests() -> None:
    requests = [(4, 20), (0, 5), (3, 3)]  # the middle request has no queries this step
    args = make_batch(requests, 4, 2, 64, 16, torch.float32)
    out = torch.full(args[0].shape, float("nan"), device=args[0].device)
    got = paged_prefill_attention(*args, out=out)
    assert got is out
    torch.testing.assert_close(out, paged_prefill_attention_ref(*args), atol=1e-4, rtol=1e-4)


def _new_rows_then_poison(args: tuple, block_n: int) -> tuple[tuple, torch.Tensor, torch.Tensor]:
    """(args with the cache slots the kernel must take from k_new/v_new overwritten by NaN,
    k_new, v_new). k_new/v_new hold, row by row in query-token order, what the cache held at
    the step's own slots; of those, the kernel reads from k_new the ones in key tiles that
    start at or past the context (the tile straddling it still comes from the cache)."""
    q, k_cache, v_cache, block_tables, qsl, seq_lens = args[:6]
    block_size = k_cache.shape[1]

    def slots_of(b: int, pos: torch.Tensor) -> torch.Tensor:
        return block_tables[b, pos // block_size].long() * block_size + pos % block_size

    new_slots, poison = [], []
    for b, seq_len in enumerate(seq_lens.tolist()):
        ctx = seq_len - int(qsl[b + 1] - qsl[b])
        new_slots.append(slots_of(b, torch.arange(ctx, seq_len, device=q.device)))
        ctx_up = -(-ctx // block_n) * block_n
        poison.append(slots_of(b, torch.arange(min(ctx_up, seq_len), seq_len, device=q.device)))
    new_slots, poison = torch.cat(new_slots), torch.cat(poison)
    k_new = k_cache.reshape(-1, *k_cache.shape[2:])[new_slots].clone()  # [T, Hkv, d]
    v_new = v_cache.reshape(-1, *v_cache.shape[2:])[new_slots].clone()
    k_bad, v_bad = k_cache.clone(), v_cache.clone()
    k_bad.view(-1, *k_cache.shape[2:])[poison] = float("nan")
    v_bad.view(-1, *v_cache.shape[2:])[poison] = float("nan")
    return (q, k_bad, v_bad, *args[3:]), k_new, v_new


@pytest.mark.parametrize("dtype", [torch.float32, gpu_also(torch.bfloat16)], ids=str)
@pytest.mark.parametrize(
    ("block_size", "config"),
    [
        (16, PrefillAttentionConfig(block_m=16, block_n=32, read_new_keys=True)),
        (16, PrefillAttentionConfig(block_m=32, block_n=16, read_new_keys=True)),
        (32, PrefillAttentionConfig(block_m=64, block_n=16, read_new_keys=True)),
    ],
    ids=["gather", "tile-is-block", "in-block"],
)
def test_read_new_keys_uses_k_new_for_the_steps_own_tokens(block_size, config, dtype) -> None:
    """The cache slots of the key tiles past each context are NaN: the result still equals
    the reference on the intact cache, so those keys came from k_new/v_new."""
    args = make_batch(CPU_REQUESTS + [(40, 40), (9, 50)], 8, 2, 64, block_size, dtype)
    ref = paged_prefill_attention_ref(*args)
    poisoned, k_new, v_new = _new_rows_then_poison(args, config.block_n)
    out = paged_prefill_attention(*poisoned, config=config, k_new=k_new, v_new=v_new)
    assert not out.isnan().any()
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    with pytest.raises(ValueError, match="k_new"):
        paged_prefill_attention(*poisoned, config=config, k_new=k_new[1:], v_new=v_new)


@pytest.mark.parametrize("block_size", [16, 32])
def test_fresh_prompts_read_no_cache_at_all(block_size: int) -> None:
    """Fresh prompts (no cached keys) with fresh=True: the whole cache is NaN and the result
    still equals the reference on the intact cache. Two one-token rows lead the batch, as a
    mixed step's decode rows do; first_req skips them, so they do not count against fresh."""
    requests = [(1, 30), (1, 7), (7, 7), (40, 40), (1, 1), (23, 23)]
    config = PrefillAttentionConfig(block_m=32, block_n=16, read_new_keys=True)
    args = make_batch(requests, 8, 2, 64, block_size, torch.float32)
    ref = paged_prefill_attention_ref(*args)
    q, k_cache, v_cache = args[:3]
    new_slots = []
    for b, (q_len, seq_len) in enumerate(requests):
        pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        new_slots.append(args[3][b, pos // block_size].long() * block_size + pos % block_size)
    slots = torch.cat(new_slots)
    k_new = k_cache.reshape(-1, *k_cache.shape[2:])[slots].clone()  # [T, Hkv, d]
    v_new = v_cache.reshape(-1, *v_cache.shape[2:])[slots].clone()
    nan_cache = torch.full_like(k_cache, float("nan"))
    out = torch.zeros_like(q)
    paged_prefill_attention(
        q, nan_cache, nan_cache, *args[3:], out=out, config=config,
        first_req=2, k_new=k_new, v_new=v_new, fresh=True,
    )  # fmt: skip
    assert not out.isnan().any()
    torch.testing.assert_close(out[2:], ref[2:], atol=1e-4, rtol=1e-4)
    assert not out[:2].any(), "rows before first_req are another kernel's"


def test_first_req_leaves_earlier_rows_alone() -> None:
    """A mixed step: two one-token rows (for the decode kernel) then two prefill chunks; with
    first_req=2 only the chunks' tokens are written and they equal the reference."""
    requests = [(1, 30), (1, 7), (5, 21), (3, 3)]
    args = make_batch(requests, 4, 2, 64, 16, torch.float32)
    out = torch.full(args[0].shape, float("nan"), device=args[0].device)
    paged_prefill_attention(*args, out=out, first_req=2)
    ref = paged_prefill_attention_ref(*args)
    assert out[:2].isnan().all()  # the decode rows' tokens: untouched
    torch.testing.assert_close(out[2:], ref[2:], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="first_req"):
        paged_prefill_attention(*args, first_req=5)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: (a[0].float(), *a[1:]), "dtypes"),
        (lambda a: (*a[:3], a[3].long(), *a[4:]), "block_tables"),
        (lambda a: (a[0][:, :3], *a[1:]), "multiple"),
        (lambda a: (a[0], a[1][..., :32], a[2][..., :32], *a[3:]), "head dim"),
        (lambda a: (*a[:5], a[5][:-1], *a[6:]), "seq_lens"),
    ],
    ids=["dtype", "table-dtype", "gqa-ratio", "head-dim", "batch-size"],
)
def test_rejects_bad_inputs(change, match: str) -> None:
    args = make_batch([(3, 5), (2, 2)], 4, 2, 64, 16, torch.float16)
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention(*change(args))


# Full sizes on CUDA: 8 requests up to 2k context, mixing whole prompts, prefix hits, chunked
# prefill tails and single queries.
GPU_REQUESTS = [
    (2048, 2048),
    (1, 1537),
    (700, 1900),
    (1024, 1024),
    (37, 2000),
    (1500, 1500),
    (16, 16),
    (333, 2047),
]


GPU_HEADS = [(32, 8, 128), (9, 3, 64), (16, 16, 128), (8, 2, 256)]  # (Hq, Hkv, d)
GPU_CASES = [
    *((torch.bfloat16, h, bs) for h in GPU_HEADS for bs in (16, 128, 256)),
    *((torch.float16, h, bs) for h in GPU_HEADS for bs in (16, 128)),
    # fp32 runs FMA (not tensor-core) dots and compiles slowly: two shapes suffice
    *((torch.float32, h, 16) for h in GPU_HEADS[:2]),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype, heads, block_size", GPU_CASES, ids=lambda x: str(x).replace("torch.", "")
)
def test_matches_ref_gpu(dtype: torch.dtype, heads: tuple[int, int, int], block_size: int) -> None:
    hq, hkv, d = heads
    assert_matches_ref(make_batch(GPU_REQUESTS, hq, hkv, d, block_size, dtype, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("heads", GPU_HEADS[:3], ids=lambda h: f"hq{h[0]}-hkv{h[1]}-d{h[2]}")
@pytest.mark.parametrize("block_size", [16, 128])
def test_default_reads_new_keys_from_k_new_gpu(heads: tuple[int, int, int], block_size: int):
    """The default config at full size, as the engine calls it: the step's own keys from
    k_new/v_new (their cache slots NaN), cached prefixes through the table; then a batch of
    fresh prompts with ``fresh`` and the whole cache NaN."""
    hq, hkv, d = heads
    args = make_batch(GPU_REQUESTS, hq, hkv, d, block_size, torch.bfloat16, device="cuda")
    ref = paged_prefill_attention_ref(*args)
    block_n = default_prefill_config(d, torch.bfloat16).block_n
    poisoned, k_new, v_new = _new_rows_then_poison(args, block_n)
    out = paged_prefill_attention(*poisoned, k_new=k_new, v_new=v_new)
    atol, rtol = TOLERANCES[torch.bfloat16]
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)

    fresh = [(s, s) for _, s in GPU_REQUESTS]
    args = make_batch(fresh, hq, hkv, d, block_size, torch.bfloat16, device="cuda")
    ref = paged_prefill_attention_ref(*args)
    _, k_new, v_new = _new_rows_then_poison(args, block_n)  # every key is new
    nan_cache = torch.full_like(args[1], float("nan"))
    out = paged_prefill_attention(
        args[0], nan_cache, nan_cache, *args[3:], k_new=k_new, v_new=v_new, fresh=True
    )
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [
        PrefillAttentionConfig(block_m=128, block_n=128, num_warps=8, num_stages=2),
        PrefillAttentionConfig(block_m=64, block_n=64, num_warps=4, num_stages=3),
        PrefillAttentionConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, pack_gqa=False),
    ],
    ids=["128x128", "64x64", "unpacked"],
)
@pytest.mark.parametrize("block_size", [16, 128])
def test_tile_configs_gpu(config: PrefillAttentionConfig, block_size: int) -> None:
    args = make_batch(GPU_REQUESTS, 32, 8, 128, block_size, torch.bfloat16, device="cuda")
    assert_matches_ref(args, config)
