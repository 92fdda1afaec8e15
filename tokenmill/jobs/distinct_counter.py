"""DistinctCounter: how many distinct keys a stream holds, exactly while that fits a bounded
set, then estimated by a HyperLogLog sketch with a stated error.

    key (64-bit hash) ─┬─► exact set, up to max_exact keys ──► "seen before?" per key
                       └─► HyperLogLog, 2^p one-byte registers ──► distinct ≈ estimate

Every key goes to both. While the set holds every distinct key the count is exact; past
``max_exact`` the set stops growing (its memory stays bounded: ~70 bytes a key) and the
count comes from the sketch, whose standard error is 1.04 / sqrt(2^p) of the count (0.81%
at p = 14, 16 kB of registers). The dry run counts duplicate rows with it: rows minus
distinct (prompt, sampling) keys.

HyperLogLog: a key's first p bits pick a register; the register keeps the largest "rank"
(position of the first 1 bit in the key's other 64 - p bits) seen. Long runs of leading
zeros are rare, so the ranks say how many distinct keys went by; the harmonic mean over
registers with the usual bias constant gives the estimate, and linear counting on empty
registers covers small counts.
"""

from __future__ import annotations

import math

__all__ = ["DistinctCounter"]

_MASK64 = (1 << 64) - 1


class DistinctCounter:
    """Distinct 64-bit keys: exact up to ``max_exact`` of them, then estimated."""

    def __init__(self, max_exact: int = 1_000_000, precision: int = 14) -> None:
        if max_exact < 0 or not 4 <= precision <= 18:
            raise ValueError(
                f"max_exact must be >= 0 and precision in [4, 18], got {max_exact}, {precision}"
            )
        self.max_exact = max_exact
        self.precision = precision
        self._seen: set[int] = set()
        self._overflowed = False
        self._registers = bytearray(1 << precision)

    def add(self, key: int) -> bool:
        """Count ``key`` (an unsigned 64-bit hash); True when the exact set already held it
        (past ``max_exact`` a repeat of a key the set could not take is not recognised)."""
        key &= _MASK64
        rest_bits = 64 - self.precision
        index = key >> rest_bits
        rest = key & ((1 << rest_bits) - 1)
        rank = rest_bits - rest.bit_length() + 1
        if rank > self._registers[index]:
            self._registers[index] = rank
        if key in self._seen:
            return True
        if len(self._seen) < self.max_exact:
            self._seen.add(key)
        else:
            self._overflowed = True
        return False

    @property
    def exact(self) -> bool:
        """Whether ``distinct`` is an exact count (the set never had to refuse a key)."""
        return not self._overflowed

    @property
    def relative_error(self) -> float:
        """One standard error of the estimate, as a fraction of the count (0 when exact)."""
        return 0.0 if self.exact else 1.04 / math.sqrt(len(self._registers))

    def distinct(self) -> int:
        """The number of distinct keys added: exact, or the sketch's estimate."""
        if self.exact:
            return len(self._seen)
        m = len(self._registers)
        alpha = 0.7213 / (1 + 1.079 / m)
        estimate = alpha * m * m / sum(2.0**-r for r in self._registers)
        empty = self._registers.count(0)
        if estimate <= 2.5 * m and empty:
            estimate = m * math.log(m / empty)
        # never fewer than the keys the set holds: those are known to be distinct
        return max(round(estimate), len(self._seen))
