"""Grammar masks on the logits: -inf at every token a row's bitmask forbids (structured output).

    bitmask [G, W] int32   token t allowed in row g when bit t % 32 of word t // 32 is set
                           (little-endian within the word); tokens past 32 * W are forbidden
    rows    [G]            distinct logits rows the G masks belong to
    logits  [B, V] float   the other B - G rows are left as they are (fp32, bf16 or fp16)

``apply_token_bitmask_ref`` is the reference (a copy; pure PyTorch, any device).
``apply_token_bitmask_host_`` is the CPU path, in place: numpy unpacks the bits (one C loop)
and each masked row is filled where they are 0. At 470 masked rows of SmolLM2's 49,152
tokens on a 2-core box the reference took ~70 ms a step, most of it first touches of the
fresh [B, V] tensors it allocates (its copy of the logits alone ~30 ms); this takes ~27
(in place on the logits, which the runner gives away: ``Sampler(mutable=True)``).
``apply_token_bitmask_`` is the Triton kernel, in place: a 2-D grid (masked row, column
block); each program reads the BLOCK / 32 words its columns need and stores -inf where a bit
is 0, reading no logit at all. On the H200 with 512 masked rows of SmolLM2's 49,152 tokens
the reference's unpack, scatter and fill took ~0.5 ms a step (bench/step_timeline.py,
session 22): the kernel is one pass of masked stores. Both give the same bits.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

__all__ = ["apply_token_bitmask_", "apply_token_bitmask_host_", "apply_token_bitmask_ref"]

_BLOCK = 1024  # columns a program: 32 words of its row's mask
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit(do_not_specialize=["vocab_size", "words"])
def _token_bitmask_kernel(
    logits_ptr,
    rows_ptr,
    bitmask_ptr,
    vocab_size,
    words,
    stride_logits,
    stride_bitmask,
    BLOCK: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab_size
    word = cols // 32
    bits = tl.load(bitmask_ptr + g * stride_bitmask + word, mask=in_vocab & (word < words), other=0)
    allowed = ((bits >> (cols % 32)) & 1) != 0
    row = tl.load(rows_ptr + g).to(tl.int64)
    ninf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits + cols, ninf, mask=in_vocab & ~allowed)


def apply_token_bitmask_(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
) -> torch.Tensor:
    """Set ``logits[rows[g], t]`` to -inf wherever ``bitmask[g]`` forbids t, in place; return
    ``logits``. Shapes as at the top; ``logits`` float32, bfloat16 or float16 with contiguous
    rows, ``rows`` any integer dtype, all three on one device."""
    if logits.dtype not in _FLOATS or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(
            "apply_token_bitmask_: logits must be [B, V] float32, bfloat16 or float16, rows "
            "contiguous"
        )
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[0] != rows.shape[0]:
        raise ValueError("apply_token_bitmask_: bitmask must be [G, W] int32, one row per rows[g]")
    num_masked = bitmask.shape[0]
    vocab_size = logits.shape[1]
    if num_masked == 0 or vocab_size == 0:
        return logits
    grid = (num_masked, triton.cdiv(vocab_size, _BLOCK))
    _token_bitmask_kernel[grid](
        logits,
        _aligned(rows),
        _aligned(bitmask.contiguous()),
        vocab_size,
        bitmask.shape[1],
        logits.stride(0),
        bitmask.stride(0),
        BLOCK=_BLOCK,
    )
    return logits


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy when it does not start on 16 bytes: Triton compiles a variant of a
    kernel per pointer alignment it is given (16 bytes or not), and a compile in the middle
    of a run stalls that step. The engine's rows and masks start aligned; a caller's slice
    may not. A copy costs one small kernel."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def apply_token_bitmask_ref(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
) -> torch.Tensor:
    """A copy of ``logits`` with -inf at every token row ``rows[g]`` may not take. Unpacked
    on the device a byte at a time (the int32 words are little-endian), scattered into a
    [B, V] mask and applied in one pass: no host-device sync.

        word w of row g:  byte k, bit j ─► token 32w + 8k + j
    """
    num_rows, vocab_size = logits.shape
    num_masked = bitmask.shape[0]
    shifts = torch.arange(8, device=bitmask.device, dtype=torch.uint8)  # [8]
    bytes_ = bitmask.contiguous().view(torch.uint8)  # [G, 4W]
    forbidden = ((bytes_.unsqueeze(-1) >> shifts) & 1) == 0  # [G, 4W, 8]
    forbidden = forbidden.view(num_masked, -1)  # [G, 32W]
    if forbidden.shape[1] < vocab_size:
        forbidden = torch.nn.functional.pad(
            forbidden, (0, vocab_size - forbidden.shape[1]), value=True
        )
    forbidden = forbidden[:, :vocab_size]  # [G, V]
    full = torch.zeros((num_rows, vocab_size), dtype=torch.bool, device=logits.device)
    full.index_copy_(0, rows, forbidden)  # [B, V]: rows without a grammar forbid nothing
    return logits.masked_fill(full, float("-inf"))


def apply_token_bitmask_host_(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
) -> torch.Tensor:
    """``apply_token_bitmask_`` on the CPU (any float dtype): -inf wherever ``bitmask[g]``
    forbids a token of row ``rows[g]``, in place; returns ``logits``."""
    num_rows, vocab_size = logits.shape
    packed = bitmask.contiguous().numpy().view(np.uint8)  # [G, 4W], little-endian words
    # count pads with zero bits (forbidden) past 32W, or cuts the last word's spare bits
    allowed = np.unpackbits(packed, axis=1, count=vocab_size, bitorder="little")  # [G, V]
    forbidden = torch.from_numpy(allowed.view(np.bool_)).logical_not_()
    order = rows.tolist()
    if order == list(range(num_rows)):
        return logits.masked_fill_(forbidden, float("-inf"))
    for g, row in enumerate(order):  # row by row: no [G, V] gather and scatter to allocate
        logits[row].masked_fill_(forbidden[g], float("-inf"))
    return logits
