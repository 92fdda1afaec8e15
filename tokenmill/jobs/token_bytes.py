"""The raw bytes of tokens, for OpenAI's logprob ``bytes`` fields.

A token may hold part of a character (an emoji is three or four byte-level tokens): decoded
alone it reads "\\ufffd", and only its bytes, joined with its neighbours', give the text back.
They come from the tokenizer's own pieces:

    byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen)   each piece character stands for one byte
                                                     (the 256 printable stand-ins of GPT-2)
    SentencePiece with byte fallback (Llama 2)       "▁" is a space, "<0xE2>" the byte 0xE2
    special and added tokens                         their text's UTF-8 (nothing when the
                                                     output skips special tokens)

Any other tokenizer gets None (OpenAI's "no bytes representation"), never a guess.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

from tokenmill.engine.detokenizer import BYTE_TOKEN, has_decoder_step

__all__ = ["token_bytes"]


def token_bytes(
    tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool
) -> dict[int, bytes | None]:
    """Token id -> its bytes (None where the tokenizer's kind is not one of the above)."""
    kind = _kind(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(ids))
    added = getattr(tokenizer, "added_tokens_decoder", {})  # id -> AddedToken
    special = set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
    out: dict[int, bytes | None] = {}
    for token, piece in zip(ids, pieces, strict=True):
        if piece is None:  # an id past the tokenizer's vocabulary
            out[token] = b""
        elif token in special:  # decoded as the text is: left out when it skips them
            text = added[token].content if token in added else piece
            out[token] = b"" if skip_special_tokens else text.encode()
        elif token in added:
            out[token] = added[token].content.encode()
        else:
            out[token] = _piece_bytes(piece, kind)
    return out


def _kind(tokenizer: Any) -> str | None:
    if has_decoder_step(tokenizer, "ByteLevel"):
        return "byte-level"
    if has_decoder_step(tokenizer, "ByteFallback"):
        return "byte-fallback"
    return None


def _piece_bytes(piece: str, kind: str | None) -> bytes | None:
    if kind == "byte-level":
        table = _byte_of_char()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return piece.encode()
    if kind == "byte-fallback":
        byte = BYTE_TOKEN.fullmatch(piece)
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        return piece.replace("\u2581", " ").encode()
    return None


@cache
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable bytes stand for themselves, the
    other 68 for the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(0x100 + shift)
            shift += 1
    return {c: b for b, c in chars.items()}
