"""ngram_match (Triton) and ngram_match_ref against a brute-force search of each row and
against the host proposer (spec_decode/ngram.py, a wide index: no hash collision): the same
drafts for rows of any length (empty, one token, past a block of positions), small and
large vocabularies (long and short matches), any order of slots, and every size range."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine.spec_decode.test_ngram import _brute_force
from tokenmill.engine.core.batch_slots import BatchSlots
from tokenmill.engine.spec_decode.ngram import NgramProposer
from tokenmill.kernels.ngram_match import (
    ngram_match,
    ngram_match_ref,
    ngram_suffix_match,
    ngram_suffix_match_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rows(seed: int, count: int, vocab: int, longest: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = [0, 1, 2, longest, *rng.integers(3, longest, count - 4).tolist()]
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def _tensors(rows: list[list[int]], width: int, dtype: torch.dtype = torch.int32):
    tokens = torch.full((len(rows) + 2, width), 7, dtype=dtype)  # 2 slots no row uses
    order = list(range(len(rows) + 2))[::-1][: len(rows)]  # rows in slots, reversed
    for slot, row in zip(order, rows, strict=True):
        tokens[slot, : len(row)] = torch.tensor(row, dtype=dtype)
    slots = torch.tensor(order, dtype=torch.int32)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int32)
    return tokens, slots, lengths


@pytest.mark.parametrize(("vocab", "min_n", "max_n"), [(3, 1, 4), (20, 2, 4), (5, 3, 8)])
def test_the_reference_is_the_brute_force_search(vocab: int, min_n: int, max_n: int) -> None:
    rows = _rows(vocab, 12, vocab, 90)
    tokens, slots, lengths = _tensors(rows, 96)
    got = ngram_match_ref(tokens, slots, lengths, min_n, max_n, 5).tolist()
    assert got == [_brute_force(r, 5, min_n, max_n) for r in rows]


def test_the_reference_drafts_what_the_host_proposer_drafts() -> None:
    rows = _rows(1, 16, 6, 200)
    tokens, slots, lengths = _tensors(rows, 200)
    table = BatchSlots(len(rows) + 2, 200, 16)
    table.token_ids[:] = tokens.numpy()
    table.num_tokens[slots.numpy()] = lengths.numpy()
    for slot in slots.tolist():
        table.requests[slot] = object()
    host = NgramProposer(4, min_n=2, max_n=4, table_bits=20).predict(table, slots.numpy(), 4)
    assert ngram_match_ref(tokens, slots, lengths, 2, 4, 4).tolist() == host.tolist()


@pytest.mark.parametrize(
    ("vocab", "longest", "min_n", "max_n", "count", "dtype"),
    [
        (3, 40, 1, 4, 4, torch.int32),  # short rows, many matches
        (50, 700, 2, 4, 7, torch.int64),  # past one block of positions, few matches
        (4, 1100, 3, 8, 3, torch.int32),  # three blocks, long matches
    ],
)
def test_the_kernel_gives_the_reference_drafts(
    vocab: int, longest: int, min_n: int, max_n: int, count: int, dtype: torch.dtype
) -> None:
    rows = _rows(longest, 9, vocab, longest)
    tokens, slots, lengths = (t.to(DEVICE) for t in _tensors(rows, longest + 4, dtype))
    want = ngram_match_ref(tokens, slots, lengths, min_n, max_n, count)
    got = ngram_match(tokens, slots, lengths, min_n, max_n, count)
    assert got.dtype == torch.int64 and got.tolist() == want.tolist()
    assert (want >= 0).any() and (want < 0).any()  # rows with a match and without


@pytest.mark.parametrize(("vocab", "longest", "min_n", "max_n"), [(3, 40, 1, 4), (4, 1100, 2, 6)])
def test_the_kernel_gives_the_reference_matches(vocab: int, longest: int, min_n: int, max_n: int):
    """(start, length) of each row's match: the kernel's, the reference's and the host
    proposer's (a wide index) alike."""
    rows = _rows(longest + 1, 9, vocab, longest)
    tokens, slots, lengths = (t.to(DEVICE) for t in _tensors(rows, longest + 4))
    want = ngram_suffix_match_ref(tokens, slots, lengths, min_n, max_n)
    got = ngram_suffix_match(tokens, slots, lengths, min_n, max_n)
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
    host = BatchSlots(len(rows) + 2, longest + 4, 16)
    host.token_ids[:] = tokens.cpu().numpy()
    host.num_tokens[slots.cpu().numpy()] = lengths.cpu().numpy()
    host.requests[:] = [object() for _ in range(len(rows) + 2)]
    proposer = NgramProposer(2, min_n, max_n, table_bits=20)
    by_host = proposer.match(host, slots.cpu().numpy().astype(np.int64))
    assert [h.tolist() for h in by_host] == [w.tolist() for w in want]
    assert (want[1] > 0).any() and (want[1] == 0).any()


def test_bad_arguments_are_refused() -> None:
    tokens, slots, lengths = _tensors([[1, 2, 1, 2]], 8)
    with pytest.raises(ValueError, match="min_n"):
        ngram_match_ref(tokens, slots, lengths, 3, 2, 4)
    with pytest.raises(ValueError, match="count"):
        ngram_match(tokens, slots, lengths, 1, 2, 0)
    with pytest.raises(ValueError, match="contiguous"):
        ngram_match(tokens.t().contiguous().t(), slots, lengths, 1, 2, 4)
