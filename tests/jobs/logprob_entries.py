"""Checking a job's logprob entries (completion or prompt) against the engine's own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tokenmill.engine.outputs import TokenLogprob

# The job's batches differ from the reference call's (other rows, other shapes), which may
# move a float's last bits; token ids and ranks must match exactly.
TOL = 1e-5


def check_entry(
    entry: dict[str, Any],
    lp: TokenLogprob,
    token: int,
    decode: Callable[[list[int]], str],
    k: int,
) -> None:
    """One position's entry: the token, its rank and logprob, and its k alternatives, most
    likely first, each decoded alone."""
    assert lp.token_id == token
    assert (entry["token_id"], entry["rank"]) == (token, lp.rank)
    assert entry["token"] == decode([token])
    assert entry["logprob"] == pytest.approx(lp.logprob, abs=TOL)
    top = sorted(lp.top.items(), key=lambda kv: -kv[1])
    assert len(top) == k
    assert [t["token_id"] for t in entry["top_logprobs"]] == [t for t, _ in top]
    assert [t["token"] for t in entry["top_logprobs"]] == [decode([t]) for t, _ in top]
    for alt, (_, value) in zip(entry["top_logprobs"], top, strict=True):
        assert alt["logprob"] == pytest.approx(value, abs=TOL)
