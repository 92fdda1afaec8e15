"""The llguidance grammar backend of structured output (structured_output.py has the rest).

llguidance shares one lexer (its cache of lexer states) between a compiled matcher and all
its copies and locks it for a whole mask, so copies of one compiled matcher fill their
masks one at a time whatever the threads. Each constraint is therefore compiled once per
executor thread (a "lexer group"); requests take the groups in turn, and a step hands
llguidance its rows sorted by group, so its threads, which split the rows into contiguous
runs, mostly work on different lexers. Masks are filled and tokens consumed on llguidance's
threads, without the GIL.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from tokenmill.engine.structured_output_params import (
    REJECTED,
    STOPPED,
    TAKEN,
    describe,
    grammar_error,
    grammar_text,
    load_llguidance,
    require_tokenizer,
)

__all__ = ["LlguidanceGrammars", "executor_threads"]

_PARAM = "SamplingParams.structured_output"
log = logging.getLogger(__name__)
Row = tuple[Any, int]  # (a request's matcher, its lexer group)


class LlguidanceGrammars:
    """Matchers, masks and token consumption through llguidance (loaded on first use)."""

    name = "llguidance"
    # positions after a draft may go unmasked (grammar_drafts.py): ``accepting`` and
    # ``allows`` answer without changing a matcher
    leaves_masks_open = True

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        threads: int | None = None,  # None: executor_threads()
    ) -> None:
        self._tokenizer = tokenizer
        self._threads = threads
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._llg: Any = None
        self._ll_tokenizer: Any = None
        self._executor: Any = None
        # canonical value -> one matcher in its start state per lexer group
        self.fresh: dict[str, list[Any]] = {}
        self.num_groups = 1  # the executor's threads, once llguidance is loaded
        self._next_group = 0

    def matcher(self, spec: str) -> Row:
        """A matcher in its start state for a new request, and its lexer group. Raises
        ValueError when llguidance cannot compile ``spec`` for this tokenizer."""
        fresh = self.fresh.get(spec)
        if fresh is None:
            first = self._compile(spec)
            # The other groups' copies compile from scratch (a copy would share the lexer).
            fresh = [first] + [
                self._llg.LLMatcher(self._ll_tokenizer, grammar_text(spec), log_level=0)
                for _ in range(self.num_groups - 1)
            ]
            if len(self.fresh) >= 64:  # a job rarely has more schemas; keep the newest
                self.fresh.pop(next(iter(self.fresh)))
            self.fresh[spec] = fresh
        group = self._next_group
        self._next_group = (group + 1) % self.num_groups
        return fresh[group].deep_copy(), group

    def fill(self, rows: Sequence[Row], mask: np.ndarray, at: Sequence[int] | None = None) -> None:
        """Row ``at[i]`` (default i) of ``mask`` [rows, words] int32 <- rows[i]'s next-token
        bitmask."""
        order = sorted(range(len(rows)), key=lambda i: rows[i][1])
        place = range(len(rows)) if at is None else at
        pairs = [(rows[i][0], place[i]) for i in order]
        self._llg.numpy.fill_next_token_bitmask_par(self._executor, pairs, mask)

    def consume(self, rows: Sequence[Row], tokens: Sequence[int]) -> np.ndarray:
        """Each row's matcher takes its token: [rows] uint8, TAKEN, STOPPED or REJECTED
        (structured_output_params) per row, in input order."""
        order = sorted(range(len(rows)), key=lambda i: rows[i][1])
        taken = self._executor.consume_token_par([(rows[i][0], tokens[i]) for i in order])
        status = np.full(len(rows), REJECTED, dtype=np.uint8)
        for i, ok in zip(order, taken, strict=True):
            if ok:
                status[i] = STOPPED if rows[i][0].is_stopped() else TAKEN
        return status

    def advance(self, rows: Sequence[Row], tokens: Sequence[int]) -> np.ndarray:
        """Each row's matcher takes its draft token for now, to fill the masks after it
        (grammar_drafts.py): [rows] bool, whether it took it (a token it does not allow
        leaves it as it was, not in its error state); no stop token. ``rollback`` undoes
        it."""
        return self._each_takes(rows, tokens, "try_consume_tokens")

    def rollback(self, rows: Sequence[Row], counts: Sequence[int]) -> None:
        """Each row's matcher gives back its last ``counts[i]`` tokens (``advance``'s)."""
        for (matcher, _), count in zip(rows, counts, strict=True):
            matcher.rollback(int(count))

    def accepting(self, rows: Sequence[Row]) -> np.ndarray:
        """[rows] bool: whether each row's grammar could end where it is (EOS allowed)."""
        return np.fromiter((m.is_accepting() for m, _ in rows), dtype=bool, count=len(rows))

    def allows(self, rows: Sequence[Row], tokens: Sequence[int]) -> np.ndarray:
        """[rows] bool: whether each row's matcher would take its token (not a stop token);
        no matcher changes."""
        return self._each_takes(rows, tokens, "validate_tokens")

    def _each_takes(self, rows: Sequence[Row], tokens: Sequence[int], how: str) -> np.ndarray:
        """[rows] bool: each row's token not a stop token and one its matcher's ``how``
        (try_consume_tokens: takes it; validate_tokens: only checks) counts as taken."""
        eos = self._eos
        return np.fromiter(
            (
                int(t) not in eos and getattr(m, how)([int(t)]) == 1
                for (m, _), t in zip(rows, tokens, strict=True)
            ),
            dtype=bool,
            count=len(rows),
        )

    def open_mask(self) -> np.ndarray:
        """[words] int32: every token of the vocabulary but the stop tokens, the mask of a
        position left open (grammar_drafts.py)."""
        words = -(-self.vocab_size // 32)
        allowed = np.ones(words * 32, dtype=bool)
        allowed[self.vocab_size :] = False
        allowed[[t for t in self._eos if 0 <= t < self.vocab_size]] = False
        return np.packbits(allowed, bitorder="little").view(np.int32)

    def release(self, rows: Sequence[Row]) -> None:
        """Finished requests' matchers: nothing to do (they go with their last reference)."""

    def error(self, row: Row) -> str:
        """Why ``row``'s last token was rejected: llguidance's error line, without the
        parser state and timings it appends (they differ from run to run)."""
        return grammar_error(row[0].get_error())

    def _compile(self, spec: str) -> Any:
        if self._ll_tokenizer is None:
            self._load_tokenizer()
        llg = self._llg
        grammar = grammar_text(spec)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(
            grammar, self._ll_tokenizer
        )
        matcher = None if is_error else llg.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if matcher is None or matcher.is_error():
            error = messages[0] if is_error else matcher.get_error()
            raise ValueError(
                f"{_PARAM}: llguidance cannot use this {describe(spec)}: {grammar_error(error)}"
            )
        return matcher

    def _load_tokenizer(self) -> None:
        require_tokenizer(self._tokenizer)
        llg = load_llguidance()
        from llguidance.hf import from_tokenizer

        try:
            self._ll_tokenizer = self._with_eos(from_tokenizer)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise ValueError(
                f"{_PARAM}: llguidance cannot read the model's tokenizer "
                f"({type(exc).__name__}: {exc}); it needs a fast (tokenizer.json) tokenizer"
            ) from None
        self.num_groups = self._threads or executor_threads()
        self._executor = llg.LLExecutor(num_threads=self.num_groups)
        self._llg = llg

    def _with_eos(self, from_tokenizer: Any) -> Any:
        """llguidance's tokenizer with the model's EOS ids: one id as an int, several as a
        list. Older llguidance releases take an int only (1.6.1, what pip installs on a
        manylinux_2_28 host, is one): with several ids they get the first, which then is
        the one EOS a finished grammar allows."""
        eos = self._eos
        if len(eos) > 1:
            try:
                return from_tokenizer(self._tokenizer, n_vocab=self.vocab_size, eos_token=eos)
            except TypeError:
                log.warning(
                    "structured output: this llguidance takes one EOS id; grammars end with "
                    "%d of the model's %s",
                    eos[0],
                    eos,
                )
        first = eos[0] if eos else None
        return from_tokenizer(self._tokenizer, n_vocab=self.vocab_size, eos_token=first)


def executor_threads() -> int:
    """Grammar threads: 80% of this process's CPUs (llguidance's own default), 1 to 32."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(32, cpus * 4 // 5))
