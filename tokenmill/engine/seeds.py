"""Seeds derived from seeds: each mixes two numbers into a 63-bit generator seed through
splitmix64's finalizer, so derived seeds are reproducible and unrelated to one another.

    request seed s ──► sample_seed(s, i)       completion i of n / best_of (i = 0: s itself)
                   ──► row_seed(s, position)   the draw at an output position (the sampler)
    job seed j     ──► input_row_seed(j, r)    input row r's own seed (jobs/requests.py)
    engine seed e  ──► generator_seed(e, dev)  what a generator on dev is seeded with
"""

from __future__ import annotations

__all__ = ["generator_seed", "input_row_seed", "row_seed", "sample_seed"]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / the golden ratio: consecutive indexes spread apart


def row_seed(seed: int, position: int) -> int:
    """The seed of a seeded request's draw at output ``position``: it depends on nothing
    else, so the draw is the same in any batch and any row."""
    return _finish(seed * _GOLDEN + position + 0x632BE59BD9B4E019)


def sample_seed(seed: int, index: int) -> int:
    """The seed of completion ``index`` of a request seeded with ``seed``; completion 0 keeps
    ``seed`` (so ``n=1`` samples as without n)."""
    if index == 0:
        return seed
    return _finish(((seed & _MASK64) ^ 0x5851F42D4C957F2D) + index * _GOLDEN)


def input_row_seed(seed: int, row_index: int) -> int:
    """The seed of input row ``row_index`` of a job whose sampling section has ``seed``."""
    return _finish(((seed & _MASK64) ^ 0xD1B54A32D192ED03) + (row_index + 1) * _GOLDEN)


def generator_seed(seed: int, device_type: str) -> int:
    """What a ``torch.Generator`` on a ``device_type`` device is seeded with for a 64-bit
    ``seed`` (the engine's: unseeded requests, random weights). CUDA's Philox keeps all 64
    bits, so it takes the seed as it is. The CPU's mt19937 keeps the low 32 bits alone, so
    0 and 2**32 (or -1 and 2**63 - 1) drew alike; there the 64 bits are mixed in first."""
    if device_type == "cuda":
        return seed
    return _finish((seed & _MASK64) ^ 0x2545F4914F6CDD1D)


def _finish(x: int) -> int:
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1
