"""Speculative decoding: proposers of draft tokens (the engine verifies them in its normal
batched step, see engine/core/drafts.py), picked by the engine's SpeculativeConfig."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from tokenmill.engine.core.drafts import DraftProposer
from tokenmill.engine.engine_config import SpeculativeConfig
from tokenmill.engine.spec_decode.ngram import NgramProposer

__all__ = ["LearnsFromOutputs", "build_proposer"]


@runtime_checkable
class LearnsFromOutputs(Protocol):
    """A proposer that drafts from finished outputs: the engine hands them over, and closes
    it (its background work) when the engine closes."""

    def observe(self, outputs: list[list[int]]) -> None: ...

    def close(self) -> None: ...


def build_proposer(config: SpeculativeConfig) -> DraftProposer | None:
    """The proposer ``config`` names; None when speculation is off. The n-gram matches of
    ngram and suffix (auto) come from the host index (ngram.py): the device search
    (device_ngram.py) measured slower a call inside the engine (BENCHMARKS.md, session 47)."""
    if config.method == "off":
        return None
    if config.method == "lookahead":
        from tokenmill.engine.spec_decode.lookahead import LookaheadProposer

        return LookaheadProposer(
            config.max_tokens + 1, config.lookahead_window, config.lookahead_candidates, seed=0
        )
    if config.method not in ("ngram", "suffix", "auto"):
        raise ValueError(f"speculative.method {config.method!r} has no proposer")
    own = _ngram_proposer(config)
    if config.method == "ngram":
        return own
    from tokenmill.engine.spec_decode.suffix import SuffixProposer

    return SuffixProposer(config.max_tokens, config.ngram_min, config.ngram_max, own=own)


def _ngram_proposer(config: SpeculativeConfig) -> NgramProposer:
    return NgramProposer(config.max_tokens, config.ngram_min, config.ngram_max)
