"""PromptStats: what a dry run learns from the good rows' tokenized prompts, in bounded memory.

    row: prompt ids, sampling params
      ├─► full KV blocks, chained hashes (as the prefix cache keys them) ─► shared-prefix tokens
      ├─► hash(prompt ids, sampling params) ─► DistinctCounter ─────────► duplicate rows
      └─► min(max_tokens, context left) x completions ──────────────────► output tokens, at most

Shared prefix: a prompt's leading full blocks of ``block_size`` tokens are hashed the way the
engine's prefix cache keys them (each block's key chains its parent's), and the tokens of a
block whose key an earlier row already produced count as shared: with prefix caching on,
the engine would find their KV cached (if not evicted meanwhile), so the share is an upper
bound on what caching saves. At most ``max_blocks`` keys are kept (about 70 bytes each); past
that, blocks new to the set are not remembered and the share becomes a lower bound
(``prefix_capped``).

Duplicates: rows with the same prompt tokens and the same sampling settings. Greedy or
seeded, they produce the same completion; a planner could run one and copy it. Counted
exactly up to ``max_distinct`` distinct rows, estimated past that (distinct_counter.py).
"""

from __future__ import annotations

import hashlib
from array import array

from tokenmill.engine.core import hash_block_tokens
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.jobs.distinct_counter import DistinctCounter
from tokenmill.scheduling.dedup import reproducible

__all__ = ["PromptStats"]


class PromptStats:
    """Shared-prefix tokens, duplicate rows and the output tokens good rows may generate."""

    def __init__(
        self, block_size: int, max_blocks: int = 2_000_000, max_distinct: int = 1_000_000
    ) -> None:
        if block_size < 1:
            raise ValueError(f"engine.block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.rows = 0
        self.sequences = 0  # engine requests: a row asking for n (best_of) completions is n
        self.prompt_tokens = 0
        self.longest_prompt = 0
        self.shared_prefix_tokens = 0
        self.prefix_capped = False
        self.duplicate_rows = 0  # recognised by the exact set (all of them while it is exact)
        self._keyed_rows = 0  # rows whose result is reproducible: the ones dedup may copy
        self.max_output_tokens = 0  # every row generating until max_tokens or the context
        self.all_ignore_eos = True  # then every row reaches it: the count is exact
        self._blocks: set[int] = set()
        self._rows = DistinctCounter(max_exact=max_distinct)

    def add(self, ids: list[int], params: SamplingParams, max_len: int) -> None:
        """Count a good row: its prompt ``ids`` and ``params``, in a context of ``max_len``."""
        self.rows += 1
        self.prompt_tokens += len(ids)
        self.longest_prompt = max(self.longest_prompt, len(ids))
        self._add_blocks(ids)
        if reproducible(params):  # a row sampled without a seed is never copied
            self._keyed_rows += 1
            if self._rows.add(_row_key(ids, params)):
                self.duplicate_rows += 1
        completions = getattr(params, "best_of", None) or params.n
        self.sequences += completions
        self.max_output_tokens += min(params.max_tokens, max_len - len(ids)) * completions
        self.all_ignore_eos = self.all_ignore_eos and params.ignore_eos

    @property
    def duplicates(self) -> tuple[int, int]:
        """(duplicate rows, one standard error): exact (error 0) while the distinct rows fit
        the exact set, else rows minus the sketch's distinct count."""
        if self._rows.exact:
            return self.duplicate_rows, 0
        distinct = self._rows.distinct()
        error = round(self._rows.relative_error * distinct)
        return max(self._keyed_rows - distinct, self.duplicate_rows), error

    @property
    def shared_prefix_share(self) -> float:
        return self.shared_prefix_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def _add_blocks(self, ids: list[int]) -> None:
        block, parent = self.block_size, None
        for start in range(0, len(ids) - block + 1, block):
            parent = hash_block_tokens(parent, tuple(ids[start : start + block]), ())
            if parent in self._blocks:
                self.shared_prefix_tokens += block
            elif len(self._blocks) < self.max_blocks:
                self._blocks.add(parent)
            else:
                self.prefix_capped = True


def _row_key(ids: list[int], params: SamplingParams) -> int:
    """A 64-bit digest of the prompt's token ids and the row's sampling settings (a
    dataclass: its repr lists every field in order)."""
    digest = hashlib.blake2b(array("q", ids).tobytes(), digest_size=8)
    digest.update(repr(params).encode())
    return int.from_bytes(digest.digest(), "little")
