"""Append sampled tokens to batch slots and check every stop rule for all rows at once.

    tokens [R, M], counts [R]:  row r appends tokens[r, :counts[r]] (M > 1 after drafts)
    after each token, per row:  EOS (unless ignore_eos), a stop token id (both once
                                min_tokens outputs exist), max_tokens, max_model_len
    a row that meets one keeps the tokens up to it and ends there

Numpy, no torch; the scheduler turns the ends into finished requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenmill.engine.core.batch_slots import BatchSlots

__all__ = ["RowEnds", "StopRules", "append_tokens", "stop_rules", "tokens_by_row"]


@dataclass(frozen=True)
class RowEnds:
    """The rows (indices into the ``slots`` given to ``append_tokens``) that ended."""

    rows: np.ndarray  # [F]
    stopped: np.ndarray  # [F] bool: EOS or a stop token id (else a length limit)
    stop_token: np.ndarray  # [F] the stop token id that ended it, -1 for EOS or length


@dataclass(frozen=True)
class StopRules:
    """Per row and token [R, M]: which rule each token meets (EOS and stop ids take
    precedence over length: a token may meet both)."""

    eos: np.ndarray  # EOS, not ignored, once min_tokens outputs exist
    stop: np.ndarray  # a stop token id, once min_tokens outputs exist (and not EOS)
    length: np.ndarray  # max_tokens outputs, or max_model_len tokens, reached


def stop_rules(
    tokens: np.ndarray,  # [R, M] appended tokens
    num_tokens: np.ndarray,  # [R, M] the row's token count after each of them
    num_prompt: np.ndarray,  # [R]
    min_tokens: np.ndarray,  # [R]
    max_tokens: np.ndarray,  # [R]
    ignore_eos: np.ndarray,  # [R] bool
    eos_ids: np.ndarray,  # [R, E] padded with -1
    stop_ids: np.ndarray,  # [R, S] padded with -1
    max_model_len: int,
) -> StopRules:
    """The stop rules, for rows in slots and for a request without one alike."""
    outputs = num_tokens - num_prompt[:, None]
    allowed = outputs >= min_tokens[:, None]
    cube = tokens[:, :, None]
    eos = allowed & ~ignore_eos[:, None] & (eos_ids[:, None, :] == cube).any(axis=2)
    stop = allowed & ~eos & (stop_ids[:, None, :] == cube).any(axis=2)
    length = (outputs >= max_tokens[:, None]) | (num_tokens >= max_model_len)
    return StopRules(eos, stop, length)


def tokens_by_row(token_ids: np.ndarray, first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """[R, max(counts)]: row r holds token_ids[first[r] : first[r] + counts[r]], padded."""
    width = int(counts.max(initial=1))
    if not len(token_ids):
        return np.zeros((len(first), width), dtype=np.int64)
    index = np.minimum(first[:, None] + np.arange(width), len(token_ids) - 1)
    return token_ids[index]


def append_tokens(
    table: BatchSlots,
    slots: np.ndarray,
    tokens: np.ndarray,
    counts: np.ndarray,
    max_model_len: int,
) -> RowEnds:
    """Append ``tokens[r, :counts[r]]`` to slot ``slots[r]``; see the module docstring."""
    if not len(slots):
        empty = np.empty(0, dtype=np.int64)
        return RowEnds(empty, np.empty(0, dtype=np.bool_), empty)
    t = table
    n0 = t.num_tokens[slots].astype(np.int64)[:, None]  # [R, 1]
    valid = np.arange(tokens.shape[1]) < counts[:, None]  # [R, M]
    r, j = np.nonzero(valid)
    t.token_ids[slots[r], n0[r, 0] + j] = tokens[r, j]
    n = n0 + 1 + np.arange(tokens.shape[1])  # [R, M] the row's num_tokens after each token
    rules = stop_rules(
        tokens, n, t.num_prompt[slots], t.min_tokens[slots], t.max_tokens[slots],
        t.ignore_eos[slots], t.eos_ids[slots], t.stop_ids[slots], max_model_len,
    )  # fmt: skip
    eos, stop = rules.eos, rules.stop
    ends = (eos | stop | rules.length) & valid
    ended = ends.any(axis=1)
    at = np.argmax(ends, axis=1)  # [R] the first token that ends the row
    t.num_tokens[slots] = n0[:, 0] + np.where(ended, at + 1, counts)
    done = np.flatnonzero(ended)
    k = at[done]
    by_id = stop[done, k]
    return RowEnds(
        rows=done,
        stopped=eos[done, k] | by_id,
        stop_token=np.where(by_id, tokens[done, k], -1),
    )
