"""N-gram prompt lookup on the device: each row's drafts from the latest earlier occurrence of
its longest matching suffix, by a search of the row's tokens (no index to keep).

    tokens [C, W] int32/int64   a slot's tokens in its row (prompt, then output so far)
    slots  [R]                  the rows to draft for, and their lengths [R] (n, known tokens)
    drafts [R, K] int64         t[p + 1 ..] after the match ending at p, -1 where none

For a row of n tokens and the longest m in [min_n, max_n] whose last m tokens occurred
before, ending at p <= n - 2, the drafts are t[p + 1 .. p + K], and past the known tokens the
row repeats t[p + 1 .. n - 1] (a cycle as short as the gap between the two occurrences): the
drafts of spec_decode/ngram.py's NgramProposer, which keeps a hash index per row on the host
and pays ~0.7 us a token indexed inside the engine on an H100 host (BENCHMARKS.md, session
46). Here every position of a row is compared with the row's suffix, ``max_n`` tokens deep:
for the longest-match-then-latest order one score a position suffices,

    score(p) = l(p) * W + p     l(p): how many tokens before and at p equal the suffix's
                                last ones (at most max_n; 0 where fewer than min_n)

and the row's match is the position of the largest score. ``ngram_match_ref`` is the
reference (pure PyTorch, any device: every row at once, [R, W] comparisons a depth);
``ngram_match`` the Triton kernel: a program a row, blocks of positions from the row's
start, the best score kept across blocks. Both give the same drafts, bit for bit.
``ngram_suffix_match`` (and its ``_ref``) give each row's match instead, as (the position
after it, its length): what spec_decode/device_ngram.py hands the proposers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["ngram_match", "ngram_match_ref", "ngram_suffix_match", "ngram_suffix_match_ref"]

_BLOCK = 512  # positions a program compares at once


def _check(tokens: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, min_n: int,
           max_n: int, count: int) -> None:  # fmt: skip
    if not 1 <= min_n <= max_n:
        raise ValueError(f"n-gram sizes: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if tokens.dim() != 2 or slots.shape != lengths.shape or slots.dim() != 1:
        raise ValueError(
            f"ngram_match: tokens [C, W], slots [R] and lengths [R], got {tuple(tokens.shape)}, "
            f"{tuple(slots.shape)}, {tuple(lengths.shape)}"
        )


def ngram_match_ref(
    tokens: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    min_n: int,
    max_n: int,
    count: int,
) -> torch.Tensor:
    """[R, count] int64 drafts of the rows ``slots`` (``lengths`` known tokens each), -1
    where a row has no match."""
    _check(tokens, slots, lengths, min_n, max_n, count)
    rows = tokens[slots.long()].long()  # [R, W]
    n = lengths.long()[:, None]  # [R, 1]
    width = rows.shape[1]
    start, _ = _start_and_length(_best_ref(rows, n, min_n, max_n), width)  # [R, 1]
    period = (n - start).clamp(min=1)
    cols = start + torch.arange(count, device=rows.device)[None, :] % period
    drafts = rows.gather(1, cols.clamp(min=0, max=width - 1))
    return torch.where(start >= 0, drafts, -1)


def ngram_suffix_match_ref(
    tokens: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, min_n: int, max_n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """([R] the position after each row's match, -1 where none; [R] the matched gram's
    length, 0 where none) int64: what NgramProposer.match gives (without its index)."""
    _check(tokens, slots, lengths, min_n, max_n, 1)
    rows = tokens[slots.long()].long()
    best = _best_ref(rows, lengths.long()[:, None], min_n, max_n)[:, 0]
    return _start_and_length(best, rows.shape[1])


def _start_and_length(best: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    found = best >= 0
    return torch.where(found, best % width + 1, -1), torch.where(found, best // width, 0)


def _best_ref(rows: torch.Tensor, n: torch.Tensor, min_n: int, max_n: int) -> torch.Tensor:
    """[R, 1] each row's best score (-1: no match) over its positions ``rows`` [R, W]."""
    width = rows.shape[1]
    pos = torch.arange(width, device=rows.device)[None, :]  # [1, W]
    run = pos <= n - 2  # positions p < n - 1 (never the suffix itself)
    depth = torch.zeros_like(rows)
    for j in range(max_n):
        back = torch.roll(rows, j, dims=1)  # back[p] = t[p - j] (wrapped where p < j)
        last = rows.gather(1, (n - 1 - j).clamp(min=0))  # the suffix's token j back
        run = run & (pos >= j) & (back == last)  # (pos >= j also means n - 1 - j >= 0)
        depth += run.long()
    score = torch.where(depth >= min_n, depth * width + pos, -1)
    return score.max(dim=1, keepdim=True).values


@triton.jit(do_not_specialize=["width", "stride_tokens"])
def _ngram_match_kernel(
    tokens_ptr,
    slots_ptr,
    lengths_ptr,
    drafts_ptr,
    best_ptr,
    width,
    stride_tokens,
    MIN_N: tl.constexpr,
    MAX_N: tl.constexpr,
    COUNT: tl.constexpr,
    COUNT_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    n = tl.load(lengths_ptr + r).to(tl.int64)
    row = tokens_ptr + slot * stride_tokens
    best = tl.full((), -1, tl.int64)
    for first in range(0, n - 1, BLOCK):
        pos = first + tl.arange(0, BLOCK).to(tl.int64)
        run = pos <= n - 2
        depth = tl.zeros((BLOCK,), tl.int64)
        for j in tl.static_range(MAX_N):
            at = n - 1 - j
            last = tl.load(row + tl.maximum(at, 0))
            back = tl.load(row + pos - j, mask=run & (pos >= j), other=0)
            run = run & (pos >= j) & (back == last)  # (pos >= j also means at >= 0)
            depth += run.to(tl.int64)
        score = tl.where(depth >= MIN_N, depth * width + pos, -1)
        best = tl.maximum(best, tl.max(score, axis=0))
    tl.store(best_ptr + r, best)
    start = tl.where(best >= 0, best % width + 1, -1)
    period = tl.maximum(n - start, 1)
    i = tl.arange(0, COUNT_PAD).to(tl.int64)
    cols = start + i % period
    found = (start + 0 * i >= 0) & (i < COUNT)
    drafts = tl.load(row + cols, mask=found, other=-1).to(tl.int64)
    tl.store(drafts_ptr + r * COUNT + i, drafts, mask=i < COUNT)


def ngram_match(
    tokens: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    min_n: int,
    max_n: int,
    count: int,
) -> torch.Tensor:
    """``ngram_match_ref`` as one Triton program a row (``tokens`` contiguous in its rows)."""
    return _launch(tokens, slots, lengths, min_n, max_n, count)[0]


def ngram_suffix_match(
    tokens: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, min_n: int, max_n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ngram_suffix_match_ref`` by the Triton kernel."""
    best = _launch(tokens, slots, lengths, min_n, max_n, 1)[1]
    return _start_and_length(best, tokens.shape[1])


def _launch(
    tokens: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, min_n: int, max_n: int,
    count: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(drafts [R, count], best scores [R]) int64."""
    _check(tokens, slots, lengths, min_n, max_n, count)
    if tokens.stride(1) != 1:
        raise ValueError("ngram_match: each row of tokens must be contiguous")
    drafts = torch.empty((len(slots), count), dtype=torch.int64, device=tokens.device)
    best = torch.empty(len(slots), dtype=torch.int64, device=tokens.device)
    if len(slots):
        _ngram_match_kernel[(len(slots),)](
            tokens, slots, lengths, drafts, best, tokens.shape[1], tokens.stride(0),
            MIN_N=min_n, MAX_N=max_n, COUNT=count, COUNT_PAD=triton.next_power_of_2(count),
            BLOCK=_BLOCK,
        )  # fmt: skip
    return drafts, best
