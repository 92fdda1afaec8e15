"""The text of each token a logprobs entry names: vLLM's ``Logprob.decoded_token`` (special
tokens spelled out) and the ``token`` of a job's logprobs columns (special tokens as the
completion's text has them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.engine.outputs import TokenLogprob

__all__ = ["logprob_texts", "special_token_ids"]


def logprob_texts(
    entries: Sequence[TokenLogprob], tokenizer: Any, skip_special_tokens: bool
) -> dict[int, str]:
    """Token id -> its text after another word, for every token and alternative of
    ``entries``: each distinct id decoded once behind an anchor token, in one batch call (a
    prompt has thousands of positions). Decoded alone, a SentencePiece token loses its
    leading space (``▁the`` -> ``the``), and the tokens no longer join to the text."""
    ids = sorted({t for e in entries for t in (e.token_id, *e.top)})
    if not ids:
        return {}
    anchor = tokenizer.encode("a", add_special_tokens=False)[-1:]
    skip = {"skip_special_tokens": skip_special_tokens}
    behind = tokenizer.batch_decode([[*anchor, t] for t in ids], **skip)
    base = tokenizer.decode(anchor)
    alone = tokenizer.batch_decode([[t] for t in ids], **skip)
    return {
        t: pair[len(base) :] if anchor and pair.startswith(base) else single
        for t, pair, single in zip(ids, behind, alone, strict=True)
    }


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids decoding skips under ``skip_special_tokens``: the tokenizer's special tokens
    and the added tokens marked special (chat turn markers often are only that)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    marked = {i for i, token in added.items() if getattr(token, "special", False)}
    return frozenset(marked | set(getattr(tokenizer, "all_special_ids", ())))
