"""CleanedText: the clean-up of a growing text, tail by tail, against cleaning it whole."""

from __future__ import annotations

import random

from transformers import PreTrainedTokenizerBase

from tokenmill.engine.space_cleanup import CleanedText


class _Tokenizer:
    """Just transformers' clean-up (CleanedText needs nothing else of a tokenizer)."""

    clean_up_tokenization = PreTrainedTokenizerBase.clean_up_tokenization


def test_tail_by_tail_equals_whole() -> None:
    """Random texts over the patterns' characters and a few others, grown a few characters at
    a time: each result is the whole text's clean-up, and the settled part a prefix of it."""
    tokenizer = _Tokenizer()
    clean = tokenizer.clean_up_tokenization
    rng = random.Random(0)
    alphabet = list(" .?!,'ntmsvre") + ["a", "x", "\n", " 's", " n't", " ' "]
    settled = 0
    for _ in range(300):
        raw, cleaner = "", CleanedText(tokenizer)
        for _ in range(rng.randrange(1, 30)):
            raw += "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 4)))
            assert cleaner.peek(raw) == clean(raw)
            assert cleaner.update(raw) == clean(raw)
            assert clean(raw).startswith(cleaner.settled)
        settled += len(cleaner.settled)
    assert settled > 0  # (the tails were not the whole texts)
