"""Space clean-up: what transformers' ``decode`` does to the Rust tokenizer's text, whole or
as it grows.

Tokenizers with ``clean_up_tokenization_spaces`` (WordPiece, WordLevel, Unigram: BERT- and
T5-like) decode ``a . b ' s`` and transformers then rewrites it to ``a. b's``
(``clean_up_tokenization``: " ." -> ".", " ' " -> "'", " 's" -> "'s", ...). Text decoded
once at the end takes that clean-up whole; text decoded a few tokens at a time (a request
with stop strings) must get the same, and cleaning each window alone misses a pattern over
more tokens than the window holds (``a`` ``'`` ``s``). ``CleanedText`` cleans the raw text
as it grows, redoing only its tail:

    raw:      [ settled .................. | tail (may still change) ]
                                           ^ after a character no pattern holds
    cleaned = clean(settled) + clean(tail)

The split is exact: a character no pattern holds is never removed (the clean-up removes only
spaces) and no match of any pattern covers it, so each ``str.replace`` pass finds the same
matches on either side as on the whole.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

__all__ = ["CleanedText", "cleanup_policy"]

# Text for the probe's decode: every pattern clean_up_tokenization rewrites (" ." -> "."...).
_CLEANUP_PROBE = "a . b ? c ! d , e ' f n't g 'm h 's i 've j 're"
_PATTERN_CHARS = frozenset(" .?!,'ntmsvre")  # the characters those patterns are made of
# tokenizer -> (its clean_up_tokenization_spaces when probed, its policy)
_policies: weakref.WeakKeyDictionary[object, tuple[Any, bool | None]] = weakref.WeakKeyDictionary()


def cleanup_policy(tokenizer: Any) -> bool | None:
    """What ``tokenizer.decode`` does to its Rust tokenizer's text, seen on a probe: False
    (returns it as is), True (applies ``clean_up_tokenization``), None (something else, not
    a fast tokenizer, or a class with a decode of its own). Asked of the tokenizer because
    the answer depends on the transformers release, not only on
    ``clean_up_tokenization_spaces``: recent ones ignore that setting for BPE tokenizers.
    Probed once per tokenizer and setting (each request with stop strings asks)."""
    setting = getattr(tokenizer, "clean_up_tokenization_spaces", None)
    try:
        known = _policies.get(tokenizer)
    except TypeError:  # a tokenizer that takes no weak reference
        return _probe(tokenizer)
    if known is not None and known[0] == setting:
        return known[1]
    policy = _probe(tokenizer)
    _policies[tokenizer] = (setting, policy)
    return policy


def _probe(tokenizer: Any) -> bool | None:
    from transformers import PreTrainedTokenizerFast

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(tokenizer, "clean_up_tokenization"):
        return None
    # A model's tokenizer class that decodes its own way (transformers has a dozen) may
    # differ only on text the probe lacks: such classes go through transformers.
    kind = type(tokenizer)
    if any(
        getattr(kind, name, None) is not getattr(PreTrainedTokenizerFast, name)
        for name in ("decode", "_decode", "batch_decode")
    ):
        return None
    # Whether decode cleans up is seen by its call, not by its text: a vocabulary that does
    # not spell the probe's " ." and " 's" (unknown pieces, no spaces between them) decodes
    # it the same cleaned or not, and read as False, text a few tokens at a time was cleaned
    # window by window ("a ' s") and text decoded whole not at all, where decode gives "a's".
    cleaned: list[str] = []

    def clean_up(text: str) -> str:
        cleaned.append(text)
        return text

    try:  # an optimisation's probe: a tokenizer it trips up decodes through transformers
        watched = copy.copy(tokenizer)  # (shares the Rust tokenizer; the original is untouched)
        watched.clean_up_tokenization = clean_up
        ids = tokenizer.encode(_CLEANUP_PROBE, add_special_tokens=False)
        raw = backend.decode(ids, skip_special_tokens=False)
        text = watched.decode(ids, skip_special_tokens=False)
    except Exception:
        return None
    if text != raw or cleaned not in ([], [raw]):
        return None  # decode changes the text some other way
    return cleaned == [raw]


class CleanedText:
    """``tokenizer.clean_up_tokenization(raw)`` for a raw text that only grows, each call
    cleaning the tail since the last character no pattern holds (the module docstring says
    why that is exact). A class with a clean-up of its own settles nothing: its patterns are
    unknown, so each call cleans the whole text."""

    def __init__(self, tokenizer: Any) -> None:
        from transformers import PreTrainedTokenizerBase

        self._clean = tokenizer.clean_up_tokenization
        base = PreTrainedTokenizerBase.clean_up_tokenization
        self._settles = getattr(type(tokenizer), "clean_up_tokenization", None) is base
        self._raw_settled = 0  # raw[:_raw_settled] ends in a character no pattern holds
        self._settled = ""  # clean(raw[:_raw_settled]): a prefix of every later result

    @property
    def settled(self) -> str:
        """The cleaned text no later raw text changes."""
        return self._settled

    def peek(self, raw: str) -> str:
        """``clean(raw)``, settling nothing: ``raw`` may be shorter than the next call's."""
        return self._settled + self._clean(raw[self._raw_settled :])

    def update(self, raw: str) -> str:
        """``clean(raw)``; ``raw`` extends every earlier call's (the text decoded so far)."""
        tail = raw[self._raw_settled :]
        cleaned = self._settled + self._clean(tail)
        if self._settles:
            cut = next((i for i in range(len(tail), 0, -1) if tail[i - 1] not in _PATTERN_CHARS), 0)
            if cut:
                self._settled += self._clean(tail[:cut])
                self._raw_settled += cut
        return cleaned
