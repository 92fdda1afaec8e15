"""apply_token_bitmask_ (Triton, in place) against apply_token_bitmask_ref: the same bits for
vocabularies that do or do not fill the last word, masks narrower than the vocabulary, rows
in any order with unmasked rows between them, and a word with its sign bit set."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.token_bitmask import apply_token_bitmask_, apply_token_bitmask_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(num_rows: int, vocab: int, words: int, rows: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=gen).to(DEVICE)
    bitmask = torch.randint(-(2**31), 2**31, (len(rows), words), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32).to(DEVICE)
    return logits, torch.tensor(rows, device=DEVICE), bitmask


@pytest.mark.parametrize(
    ("num_rows", "vocab", "words", "rows"),
    [
        (4, 2048, 64, [0, 1, 2, 3]),  # every row masked, the vocabulary fills its words
        (5, 1000, 32, [3, 0]),  # 1000 = 31 words + 8 tokens; rows out of order, some plain
        (3, 1100, 30, [1]),  # a mask narrower than the vocabulary: the rest is forbidden
        (2, 70, 3, [1, 0]),  # one program, part of a block
    ],
)
def test_kernel_gives_the_reference_bits(num_rows, vocab, words, rows) -> None:
    logits, rows_t, bitmask = _case(num_rows, vocab, words, rows, seed=vocab + words)
    want = apply_token_bitmask_ref(logits, rows_t, bitmask)
    got = logits.clone()
    assert apply_token_bitmask_(got, rows_t, bitmask) is got
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    plain = [r for r in range(num_rows) if r not in rows]
    torch.testing.assert_close(got[plain], logits[plain], atol=0, rtol=0)


def _interpreter_without_bf16() -> bool:
    """Whether kernels run under a Triton interpreter that has no bfloat16 (Triton 3.7's,
    which pip gives Python 3.10 beside torch's CUDA build)."""
    if DEVICE == "cuda":
        return False
    from triton.runtime.interpreter import InterpreterBuilder

    return not hasattr(InterpreterBuilder, "get_bf16")


@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(
                _interpreter_without_bf16(), reason="this Triton's interpreter has no bfloat16"
            ),
        ),
        torch.float16,
    ],
)
def test_half_precision_logits_get_the_reference_bits(dtype) -> None:
    """The model's own logits dtype is masked in place as float32 is: the same -inf bits,
    the other values untouched (the greedy sampler masks bf16 logits without a copy)."""
    logits, rows_t, bitmask = _case(5, 1000, 32, [3, 0], seed=7)
    logits = logits.to(dtype)
    want = apply_token_bitmask_ref(logits, rows_t, bitmask)
    got = apply_token_bitmask_(logits.clone(), rows_t, bitmask)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_bits_select_tokens_as_documented() -> None:
    """Row 1 allows tokens 0, 33 and 63 only (bit 31 of word 1 is its sign bit); row 0 is not
    masked."""
    logits = torch.zeros(2, 64, device=DEVICE)
    bitmask = torch.tensor([[1, (1 << 1) | -(2**31)]], dtype=torch.int32, device=DEVICE)
    apply_token_bitmask_(logits, torch.tensor([1], device=DEVICE), bitmask)
    allowed = torch.isfinite(logits)
    assert allowed[0].all()
    assert torch.nonzero(allowed[1]).flatten().tolist() == [0, 33, 63]


def test_refuses_logits_it_cannot_mask_in_place() -> None:
    rows = torch.tensor([0], device=DEVICE)
    bitmask = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        apply_token_bitmask_(torch.zeros(1, 64, dtype=torch.float64, device=DEVICE), rows, bitmask)
    with pytest.raises(ValueError, match="one row per"):
        apply_token_bitmask_(torch.zeros(2, 64, device=DEVICE), rows, bitmask.repeat(2, 1))


def test_rows_sliced_off_alignment_give_the_same_bits() -> None:
    """A row index tensor starting 8 bytes into its storage (a slice) is copied to an
    aligned one before the launch: the same bits."""
    logits, rows_t, bitmask = _case(6, 256, 8, [5, 1, 3], seed=11)
    padded = torch.cat([torch.zeros(1, dtype=rows_t.dtype, device=DEVICE), rows_t])[1:]
    assert padded.data_ptr() % 16 == 8
    want = apply_token_bitmask_ref(logits, rows_t, bitmask)
    got = apply_token_bitmask_(logits.clone(), padded, bitmask)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("num_rows", "vocab", "words", "rows"),
    [
        (4, 2048, 64, [0, 1, 2, 3]),  # every row, in order: one fill of the whole tensor
        (5, 1000, 32, [3, 0]),  # rows out of order, some plain, the last word part-used
        (3, 1100, 30, [1]),  # a mask narrower than the vocabulary: the rest is forbidden
        (2, 70, 3, [1, 0]),
    ],
)
def test_the_host_path_gives_the_reference_bits_in_place(num_rows, vocab, words, rows) -> None:
    from tokenmill.kernels.token_bitmask import apply_token_bitmask_host_

    logits, rows_t, bitmask = (t.cpu() for t in _case(num_rows, vocab, words, rows, seed=words))
    want = apply_token_bitmask_ref(logits, rows_t, bitmask)
    got = logits.clone()
    assert apply_token_bitmask_host_(got, rows_t, bitmask) is got
    torch.testing.assert_close(got, want, atol=0, rtol=0)
