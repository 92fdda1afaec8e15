"""The ids of a tokenizer's special tokens: the named ones (BOS, EOS, ...) and every added
token marked special (chat markers such as ``<|im_start|>``, ``[INST]``), which
``all_special_ids`` may leave out."""

from __future__ import annotations

from typing import Any


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False):
            ids.add(int(token_id))
    return frozenset(ids)
