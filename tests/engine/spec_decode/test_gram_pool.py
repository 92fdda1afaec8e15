"""GramPool (Lookahead's n-gram pool in arrays) against a plain reference that adds one gram
at a time: a key's newest ``keep`` distinct continuations, a repeated one refreshed, and a
key taking its entry (key % entries) from another."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from tokenmill.engine.spec_decode.gram_pool import GramPool


class _Reference:
    def __init__(self, keep: int, entries: int) -> None:
        self.keep, self.entries = keep, entries
        self.places: dict[int, tuple[int, OrderedDict[tuple[int, ...], None]]] = {}

    def add(self, keys: np.ndarray, conts: np.ndarray) -> None:
        for key, cont in zip(keys.tolist(), conts.tolist(), strict=True):
            entry = key % self.entries
            owner, held = self.places.get(entry, (key, OrderedDict()))
            if owner != key:
                held = OrderedDict()
            held.pop(tuple(cont), None)
            held[tuple(cont)] = None  # newest last
            while len(held) > self.keep:
                held.popitem(last=False)
            self.places[entry] = (key, held)

    def continuations(self, key: int) -> list[list[int]]:
        owner, held = self.places.get(key % self.entries, (-1, OrderedDict()))
        return [list(c) for c in reversed(held)] if owner == key else []


@pytest.mark.parametrize("entries", [1 << 10, 7])  # no key shares an entry; many do
def test_batches_of_grams_match_adding_them_one_by_one(entries: int) -> None:
    rng = np.random.default_rng(entries)
    pool, ref = GramPool(length=3, keep=4, entries=entries), _Reference(4, entries)
    for _ in range(60):
        n = int(rng.integers(1, 200))
        keys = rng.integers(0, 30, size=n)  # few keys and tokens: many repeats
        conts = rng.integers(0, 4, size=(n, 3))
        pool.add(keys, conts)
        ref.add(keys, conts)
        for key in range(30):
            assert pool.continuations(key) == ref.continuations(key), key


def test_lookup_puts_real_continuations_first() -> None:
    pool = GramPool(length=2, keep=3, entries=100)
    pool.add(np.array([5, 5, 9]), np.array([[1, 2], [3, 4], [7, 7]]))
    conts, real = pool.lookup(np.array([5, 9, 6]))
    assert real.tolist() == [[True, True, False], [True, False, False], [False] * 3]
    assert conts[0, :2].tolist() == [[3, 4], [1, 2]] and conts[1, 0].tolist() == [7, 7]


def test_refuses_empty_shapes() -> None:
    with pytest.raises(ValueError, match="length, keep and entries"):
        GramPool(length=0, keep=1, entries=1)
