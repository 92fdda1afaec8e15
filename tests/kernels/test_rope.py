"""rope_ (Triton, in place) against rope_ref, with Llama-3 scaled tables from the engine."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.model_config import ModelConfig
from tokenmill.engine.models.rope import RotaryEmbedding
from tokenmill.kernels import rope as rope_mod
from tokenmill.kernels.fp8_kv import FP8_KV
from tokenmill.kernels.kv_store import store_kv
from tokenmill.kernels.rope import rope_, rope_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Both rotate in fp32 and round once; only FMA contraction and operation order differ, so
# low precision results agree to one ulp of the dtype (fp16 2^-11 relative; bf16 up to 2^-7,
# with room for a second ulp because Triton's interpreter truncates fp32 -> bf16 where the
# GPU rounds to nearest) and fp32 ones to a few ulps.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


def _tables(hq: int, hkv: int, d: int, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=128,
        hidden_size=hq * d,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=hq,
        num_key_value_heads=hkv,
        head_dim=d,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=max_pos,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    rope = RotaryEmbedding(config, max_pos)  # the engine's tables, Llama-3 scaling included
    return rope.cos.to(DEVICE), rope.sin.to(DEVICE)  # [P, d/2] each


def _run(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, max_pos: int) -> None:
    cos, sin = _tables(hq, hkv, d, max_pos)
    gen = torch.Generator().manual_seed(t * 13 + hq + d)
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=gen).to(DEVICE, dtype)  # [T, Hq+2Hkv, d]
    positions = torch.randint(0, max_pos, (t,), generator=gen)
    positions[0] = max_pos - 1  # the last row of the table, beyond the original context
    positions = positions.to(DEVICE)
    q, k = qkv[:, :hq], qkv[:, hq : hq + hkv]  # strided views, as in the engine
    q_ref, k_ref = rope_ref(q, k, positions, cos, sin)
    v_before = qkv[:, hq + hkv :].clone()

    rope_(q, k, positions, cos, sin)
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    torch.testing.assert_close(k, k_ref, **TOL[dtype])
    torch.testing.assert_close(qkv[:, hq + hkv :], v_before, atol=0, rtol=0)  # v untouched


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize(("t", "hq", "hkv", "d"), [(3, 4, 2, 64), (2, 3, 1, 128)])
def test_rope_matches_ref(t, hq, hkv, d, dtype) -> None:
    _run(t, hq, hkv, d, dtype, max_pos=20000)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("t", "hq", "hkv", "d", "tokens"),
    [
        (7, 4, 2, 64, 4),  # a partial last program: 4 + 3 tokens
        (3, 3, 1, 128, 4),  # T < TOKENS: one program, mostly masked
        (9, 2, 1, 64, 2),
    ],
)
def test_rope_tokens_per_program_masks_the_tail(monkeypatch, t, hq, hkv, d, tokens, dtype) -> None:
    # The default config keeps small T at one token a program; force several so the last
    # program is partial and its token mask is exercised.
    monkeypatch.setattr(rope_mod, "_launch_config", lambda *_: (tokens, 2))
    _run(t, hq, hkv, d, dtype, max_pos=20000)


def test_rope_tokens_per_program_writes_nothing_past_t(monkeypatch) -> None:
    # q, k are the first T rows of a bigger buffer: rows past T must stay as they were.
    monkeypatch.setattr(rope_mod, "_launch_config", lambda *_: (4, 2))
    cos, sin = _tables(2, 1, 64, 16)
    qkv = torch.randn(8, 4, 64, device=DEVICE)  # [8, Hq + 2 Hkv, d]
    before = qkv.clone()
    positions = torch.arange(5, device=DEVICE) + 1
    rope_(qkv[:5, :2], qkv[:5, 2:3], positions, cos, sin)
    torch.testing.assert_close(qkv[5:], before[5:], atol=0, rtol=0)
    assert not torch.equal(qkv[:5, :3], before[:5, :3])


@pytest.mark.parametrize(("hq", "hkv", "d"), [(32, 8, 128), (9, 3, 64), (64, 8, 128), (4, 1, 32)])
def test_rope_launch_config(hq, hkv, d) -> None:
    tokens, warps = rope_mod._launch_config(hq, hkv, d)
    assert tokens == 1  # the H200 sweep: packing tokens was slower at every size
    assert warps & (warps - 1) == 0 and 1 <= warps <= 16
    if (hq, hkv, d) == (32, 8, 128):
        assert warps == 4  # the sweep: best over T = 4,096 and 16,384 together


def test_rope_ref_rotates_like_the_engine() -> None:
    # Position 0 is the identity; rotation preserves each half-pair's norm.
    cos, sin = _tables(2, 1, 64, 16)
    x = torch.randn(2, 2, 64, device=DEVICE)
    q, _ = rope_ref(x, x[:, :1], torch.tensor([0, 9], device=DEVICE), cos, sin)
    torch.testing.assert_close(q[0], x[0])
    pair_norm = lambda y: y[..., :32] ** 2 + y[..., 32:] ** 2  # noqa: E731
    torch.testing.assert_close(pair_norm(q[1]), pair_norm(x[1]), rtol=1e-5, atol=1e-5)


def test_rope_rejects_mismatch() -> None:
    cos, sin = _tables(2, 1, 64, 16)
    q = torch.zeros(2, 2, 64, device=DEVICE)
    pos = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="float32"):
        rope_(q, q[:, :1], pos, cos.half(), sin)
    with pytest.raises(ValueError, match="positions"):
        rope_(q, q[:, :1], pos.int(), cos, sin)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(32, 8, 128), (9, 3, 64)])
def test_rope_engine_size(hq, hkv, d, dtype) -> None:
    _run(4096, hq, hkv, d, dtype, max_pos=131072)


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.bfloat16, FP8_KV),
    ],
)
@pytest.mark.parametrize(("t", "hq", "hkv", "d"), [(7, 9, 3, 64), (3, 4, 2, 128)])
def test_rope_storing_kv_equals_rope_then_store_kv(t, hq, hkv, d, dtype, cache_dtype) -> None:
    """With (v, kv_cache, slots) the kernel rotates q and k and stores k and v as rope_ and
    then store_kv would: the same q, k and cache bits (slot -1: nothing stored)."""
    cos, sin = _tables(hq, hkv, d, 64)
    gen = torch.Generator().manual_seed(t + d)
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=gen).to(DEVICE, dtype)
    positions = torch.randint(0, 64, (t,), generator=gen).to(DEVICE)
    nb, bs = 4, 4
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    slots[1] = -1  # a padding token
    slots = slots.to(DEVICE)
    cache = torch.randn(2, nb, bs, hkv, d, generator=gen).to(DEVICE, cache_dtype)
    want_qkv, got_qkv = qkv.clone(), qkv.clone()
    want_cache, got_cache = cache.clone(), cache.clone()

    def views(x: torch.Tensor):
        return x[:, :hq], x[:, hq : hq + hkv], x[:, hq + hkv :]

    q, k, v = views(want_qkv)
    rope_(q, k, positions, cos, sin)
    store_kv(k, v, want_cache[0], want_cache[1], slots)
    q, k, v = views(got_qkv)
    rope_(q, k, positions, cos, sin, (v, got_cache, slots))
    assert torch.equal(got_qkv, want_qkv)
    assert torch.equal(got_cache.view(torch.uint8), want_cache.view(torch.uint8))
    assert not torch.equal(got_cache.view(torch.uint8), cache.view(torch.uint8))  # it stored


def test_rope_storing_kv_rejects_mismatch() -> None:
    cos, sin = _tables(4, 2, 64, 16)
    q, k = torch.zeros(2, 4, 64, device=DEVICE), torch.zeros(2, 2, 64, device=DEVICE)
    positions = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    cache = torch.zeros(2, 3, 4, 2, 64, device=DEVICE)
    slots = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="v must be"):
        rope_(q, k, positions, cos, sin, (torch.zeros(2, 3, 64, device=DEVICE), cache, slots))
    with pytest.raises(ValueError, match="kv_cache must be \\[2"):
        rope_(q, k, positions, cos, sin, (k.clone(), cache[0], slots))
    with pytest.raises(ValueError, match="slot_mapping"):
        rope_(q, k, positions, cos, sin, (k.clone(), cache, slots.int()))
