"""min_tokens as vLLM has it: a row may not sample its stop tokens before it has that many.

A request with ``min_tokens`` m cannot end before its m-th output token; its EOS (unless
``ignore_eos``) and its ``stop_token_ids`` are therefore not sampled while fewer than m
outputs exist: their logits are -inf on those rows (one sparse add, with the logit bias). A
token that could not end the request would otherwise still be written into its output (an
EOS mid-text, and the model going on past it).

    logits row i ──► position p[i] (outputs before it) < min_tokens ─► row i * V + each of
                     its stop ids, banned

Numpy over a step's logits rows (a drafted row's positions count its drafts before them).
"""

from __future__ import annotations

import numpy as np

from tokenmill.engine.core.batch_slots import BatchSlots

__all__ = ["banned_stop_tokens"]


def banned_stop_tokens(
    table: BatchSlots, row_slots: np.ndarray, positions: np.ndarray, vocab_size: int
) -> np.ndarray | None:
    """[K] int64 flat indices (logits row * V + token) of the stop tokens that the step's
    logits rows (slots ``row_slots`` [N], each at output ``positions`` [N]) may not sample
    yet; None when every row has its ``min_tokens``."""
    short = np.flatnonzero(positions < table.min_tokens[row_slots])
    if not len(short):
        return None
    slots = row_slots[short]
    eos = np.where(table.ignore_eos[slots, None], -1, table.eos_ids[slots])
    ids = np.concatenate([eos, table.stop_ids[slots]], axis=1)  # [n, E + S], -1 padded
    rows = np.broadcast_to(short[:, None].astype(np.int64), ids.shape)
    keep = (ids >= 0) & (ids < vocab_size)
    if not keep.any():
        return None
    return rows[keep] * vocab_size + ids[keep]
