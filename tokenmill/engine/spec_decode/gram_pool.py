"""GramPool: Lookahead's n-gram pool in arrays. Each key token keeps its newest ``keep``
distinct continuations of L tokens; adding and looking up are numpy over all the grams of a
step at once (no loop over rows, grams or tokens).

    entry e = key % entries          (a direct-mapped table: a key takes its entry from
                                      another; with entries >= the vocabulary none collide)
    owner[e]      key + 1 (0: empty)
    conts[e, g]   a continuation [L], newest first
    print[e, g]   its fingerprint (a 64-bit hash: grams are told apart by it)
    stamp[e, g]   when it was last added (0: empty), so decreasing along g

Adding a gram already held refreshes it; the entry then keeps the newest ``keep`` of what it
held and what came. Two continuations of one key with the same fingerprint (odds ~2^-64)
count as one: the pool drafts less, never wrongly (verification keeps only the target's
tokens). The arrays are np.zeros, so the OS maps pages only where keys land.
"""

from __future__ import annotations

import numpy as np

__all__ = ["GramPool"]


_MULT = np.uint64(0x100000001B3)  # FNV-1a's 64-bit prime
_SEED = np.uint64(0xCBF29CE484222325)


def _fingerprint(conts: np.ndarray) -> np.ndarray:
    """[N] int64: a hash of each continuation [N, L] (FNV-1a over its tokens)."""
    h = np.full(len(conts), _SEED, dtype=np.uint64)
    for column in conts.T.astype(np.uint64):
        h = (h ^ column) * _MULT
    return h.view(np.int64)


def _run_starts(sorted_keys: np.ndarray) -> np.ndarray:
    """[N] bool: where a run of equal keys starts (the keys sorted or grouped)."""
    starts = np.empty(len(sorted_keys), dtype=np.bool_)
    starts[:1] = True
    np.not_equal(sorted_keys[1:], sorted_keys[:-1], out=starts[1:])
    return starts


def _rank_in_runs(starts: np.ndarray) -> np.ndarray:
    """Each element's place within its run (``starts``: _run_starts): 0, 1, .."""
    at = np.arange(len(starts))
    return at - np.maximum.accumulate(np.where(starts, at, 0))


class GramPool:
    """Continuations of ``length`` tokens, the newest ``keep`` per key, in ``entries``
    places (a key's place: key % entries)."""

    def __init__(self, length: int, keep: int, entries: int) -> None:
        if length < 1 or keep < 1 or entries < 1:
            raise ValueError(
                f"GramPool needs length, keep and entries >= 1, got {length}, {keep}, {entries}"
            )
        self.length, self.keep, self.entries = length, keep, entries
        self.owner = np.zeros(entries, dtype=np.int64)
        self.conts = np.zeros((entries, keep, length), dtype=np.int32)  # token ids < 2**31
        self.print = np.zeros((entries, keep), dtype=np.int64)
        self.stamp = np.zeros((entries, keep), dtype=np.int64)
        self._clock = 0

    def add(self, keys: np.ndarray, conts: np.ndarray) -> None:
        """Add grams in order (a later one is newer): ``keys`` [N], ``conts`` [N, L]."""
        keys = np.asarray(keys, dtype=np.int64)
        conts = np.asarray(conts, dtype=np.int64).reshape(len(keys), self.length)
        if not len(keys):
            return
        stamps = self._clock + 1 + np.arange(len(keys))
        self._clock += len(keys)
        prints = _fingerprint(conts)
        keys, conts, prints, stamps, taken = self._survivors(keys, conts, prints, stamps)
        # grouped by key (one key an entry now), newest first: an entry's grams are a run
        first = _run_starts(keys)
        slot = np.cumsum(first) - 1  # [N] -> 0 .. E-1
        rank = _rank_in_runs(first)  # a gram's place among its key's (< keep)
        key = keys[first]
        touched = key % self.entries
        e, g = len(touched), self.keep
        # What the touched entries hold (nothing where another key held them), less the
        # grams that came again (the new copy is newer), beside what came: [E, 2G].
        stamp = np.zeros((e, 2 * g), dtype=np.int64)
        kept = self.owner[touched] == key + 1
        if len(taken):
            kept &= ~np.isin(touched, taken)
        stamp[:, :g] = np.where(kept[:, None], self.stamp[touched], 0)
        held_print = self.print[touched]
        n_at, g_at = np.nonzero(held_print[slot] == prints[:, None])
        stamp[slot[n_at], g_at] = 0
        stamp[slot, g + rank] = stamps
        cont = np.zeros((e, 2 * g, self.length), dtype=np.int32)
        cont[:, :g] = self.conts[touched]
        cont[slot, g + rank] = conts
        fp = np.zeros((e, 2 * g), dtype=np.int64)
        fp[:, :g] = held_print
        fp[slot, g + rank] = prints
        # the newest ``keep`` of both, as flat indices into the [E * 2G] places
        newest = np.argsort(-stamp, axis=1, kind="stable")[:, :g]
        newest += np.arange(e)[:, None] * (2 * g)
        self.conts[touched] = cont.reshape(e * 2 * g, -1)[newest]
        self.print[touched] = fp.reshape(-1)[newest]
        self.stamp[touched] = stamp.reshape(-1)[newest]
        self.owner[touched] = key + 1

    def _survivors(
        self, keys: np.ndarray, conts: np.ndarray, prints: np.ndarray, stamps: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The grams that can stand after adding these: each distinct (key, cont) once, at
        its newest; at an entry two keys share, only the key added last, and of its grams
        those added after the other key's last; then the newest ``keep`` of each key (older
        ones would be pushed out). Also the entries another key took in between (what they
        held goes)."""
        order = np.lexsort((stamps, prints, keys))  # by key, cont, then time
        k, p = keys[order], prints[order]
        last = np.empty(len(k), dtype=np.bool_)  # the newest of a run of one gram
        last[-1:] = True
        np.not_equal(k[1:], k[:-1], out=last[:-1])
        last[:-1] |= p[1:] != p[:-1]
        kept = order[last]
        taken = np.zeros(0, dtype=np.int64)
        if keys.max() >= self.entries:  # keys may share an entry: the one added last wins
            entry = keys[kept] % self.entries
            by_entry = np.lexsort((stamps[kept], entry))
            newest = _run_starts(entry[by_entry][::-1])[::-1]  # the last of its entry
            winner = np.full(self.entries, -1, dtype=np.int64)
            winner[entry[by_entry][newest]] = keys[kept][by_entry][newest]
            lost = winner[entry] != keys[kept]
            since = np.zeros(self.entries, dtype=np.int64)  # the losers' last stamp
            np.maximum.at(since, entry[lost], stamps[kept][lost])
            taken = np.unique(entry[lost])
            kept = kept[~lost & (stamps[kept] > since[entry])]
        order = np.lexsort((-stamps[kept], keys[kept]))  # by key, newest first
        ordered = keys[kept][order]
        kept = kept[order[_rank_in_runs(_run_starts(ordered)) < self.keep]]
        return keys[kept], conts[kept], prints[kept], stamps[kept], taken

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """([K, keep, L] each key's continuations newest first, [K, keep] which are real:
        the real ones come first)."""
        keys = np.asarray(keys, dtype=np.int64)
        entry = keys % self.entries
        real = (self.stamp[entry] > 0) & (self.owner[entry] == keys + 1)[:, None]
        return self.conts[entry].astype(np.int64), real

    def continuations(self, key: int) -> list[list[int]]:
        """One key's continuations, newest first (for inspection and tests)."""
        conts, real = self.lookup(np.array([key]))
        return conts[0][real[0]].tolist()

    def __contains__(self, key: int) -> bool:
        return bool(len(self.continuations(key)))
