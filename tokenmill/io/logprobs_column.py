"""Output logprobs as a job writes them: one entry per completion token, in every format.

A row whose sampling asks for ``logprobs=k`` (job.yaml's ``sampling.logprobs``; an OpenAI
Batch body's ``logprobs: true`` with ``top_logprobs: k`` on /v1/chat/completions, or
``logprobs: k`` on /v1/completions) carries, per generated token, the token's logprob under
the model's own distribution (before penalties, logit bias, temperature and structured
output), its rank among all tokens, and the k most likely tokens at that step (the engine's
``CompletionOutput.logprobs``, decoded). The entries hold the same fields as
prompt_logprobs_column.py's, and none is null: every completion token was predicted.

    completion  t0                                            t1   ...
    entries     {"token_id": 71, "token": " cat",             {...}
                 "logprob": -0.4, "rank": 1,
                 "top_logprobs": [{"token_id": 71, "token": " cat", "logprob": -0.4},
                                  ... k of them, most likely first]}

JSONL and Parquet output hold these entries as they are, in a ``logprobs`` column (Parquet:
``LOGPROBS_FIELD``, in the job's one schema when its sampling section sets ``logprobs``).
Their rows hold one completion each (several, ``n > 1``, need OpenAI Batch output), so the
entries are that completion's. OpenAI Batch output writes each choice's own in OpenAI's
shapes, which have no token ids or ranks: a chat choice's ``logprobs.content``
(``openai_chat_logprobs``), a text completion choice's parallel lists
(``openai_completion_logprobs``).
"""

from __future__ import annotations

import codecs
import itertools
from typing import Any

import pyarrow as pa

from tokenmill.io.prompt_logprobs_column import LOGPROB_ENTRY

__all__ = [
    "LOGPROBS",
    "LOGPROBS_FIELD",
    "LogprobEntries",
    "openai_chat_logprobs",
    "openai_completion_logprobs",
]

LOGPROBS = "logprobs"

# One entry per completion token; see the module docstring.
LogprobEntries = list[dict[str, Any]]

# Items named "element" (Parquet's name) and marked by metadata, as the prompt_logprobs
# column is: the files read back in exactly this schema, and a passthrough column named
# "logprobs" is never taken for this one.
LOGPROBS_FIELD = pa.field(
    LOGPROBS,
    pa.list_(pa.field("element", LOGPROB_ENTRY)),
    metadata={b"tokenmill.column": b"logprobs"},
)


def openai_chat_logprobs(entries: LogprobEntries) -> dict[str, Any]:
    """A chat.completion choice's ``logprobs``: ``{"content": [{"token", "bytes", "logprob",
    "top_logprobs": [{"token", "bytes", "logprob"}, ...]}, ...]}``; ``bytes`` (the token's
    UTF-8 bytes, which join to the text where a character spans tokens) when the entries
    carry them."""

    def one(t: dict[str, Any]) -> dict[str, Any]:
        out = {"token": t["token"], "logprob": t["logprob"]}
        if "bytes" in t:
            out["bytes"] = t["bytes"]
        return out

    return {
        "content": [
            {**one(e), "top_logprobs": [one(t) for t in e["top_logprobs"]]} for e in entries
        ]
    }


def openai_completion_logprobs(entries: LogprobEntries, text: str) -> dict[str, Any]:
    """A text_completion choice's ``logprobs``, the legacy shape: parallel lists, the top
    alternatives and the sampled token as ``{token: logprob}`` (tokens decoding alike
    collapse into one key, which keeps the likeliest one's logprob), and ``text_offset``,
    where each token starts in ``text``, the completion (the prompt is not echoed, so from
    0): the tokens' lengths added up, as vLLM does (with the tokens' ``bytes``, when the
    entries carry them: the whole characters before each token), less the leading space a
    SentencePiece tokenizer drops from the text's first token (the tokens keep theirs)."""
    tokens = [e["token"] for e in entries]
    if entries and all(e.get("bytes") is not None for e in entries):
        starts = _char_starts([bytes(e["bytes"]) for e in entries])
    else:
        starts = [0, *itertools.accumulate(len(t) for t in tokens)][: len(tokens)]
    first = tokens[0] if tokens else ""
    dropped = int(first.startswith(" ") and not text.startswith(" ") and bool(first.strip()))
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [_with_the_sampled(e) for e in entries],
        "text_offset": [max(0, start - dropped) for start in starts],
    }


def _decoded_length(data: bytes) -> int:
    """Characters ``data`` decodes to as the text was decoded (invalid bytes a "\ufffd"
    each), an incomplete last character not yet counted."""
    return len(codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data))


def _char_starts(token_bytes: list[bytes]) -> list[int]:
    """Where each token starts in the text: the whole characters before it. A character
    split over tokens ("\ufffd" each) is whole only after its last byte, so it starts no
    token before that; bytes held back as a character's beginning that the next token's
    bytes show invalid are the earlier tokens' "\ufffd", before the next token (they were
    counted at it: an offset one short after such a byte)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    starts, decoded = [], 0
    for data in token_bytes:
        held = decoder.getstate()[0]  # the bytes before this token not yet a character
        extra = _decoded_length(held + data) - _decoded_length(data) if held else 0
        starts.append(decoded + max(extra, 0))
        decoded += len(decoder.decode(data))
    return starts


def _with_the_sampled(entry: dict[str, Any]) -> dict[str, float]:
    """A position's ``{token: logprob}``: its top alternatives, and the sampled token's own
    where it is not among them (OpenAI's legacy completions always give it: up to
    logprobs + 1 entries; ``logprobs: 0`` gave an empty dict)."""
    out = _likeliest_by_text(entry["top_logprobs"])
    out.setdefault(entry["token"], entry["logprob"])
    return out


def _likeliest_by_text(top: list[dict[str, Any]]) -> dict[str, float]:
    """``{token: logprob}`` of alternatives given most likely first: the first of those
    decoding alike."""
    out: dict[str, float] = {}
    for t in top:
        out.setdefault(t["token"], t["logprob"])
    return out
