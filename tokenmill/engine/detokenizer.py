"""IncrementalDetokenizer: output tokens to text, a few tokens at a time, with stop strings.

Decoding each new token alone is wrong (byte-level BPE splits one character over several
tokens; SentencePiece drops a leading space) and decoding everything each step is quadratic.
Instead keep two offsets into the output tokens and decode a short window:

    token_ids:  [ ... committed ... | prefix window | unread (new) tokens ]
                                    ^prefix_offset  ^read_offset
    new text = decode(ids[prefix:])[len(decode(ids[prefix:read])):]

The prefix window gives the new tokens their left context. When the new text ends in U+FFFD
its last character is still incomplete: only the text before it is emitted and the offsets
stay, so the next tokens are decoded together with it. Once the text ends on a whole
character, the offsets move on: prefix <- read, read <- len(ids). With a ByteFallback
decoder (SentencePiece's ``<0x..>`` byte tokens), a run of byte tokens decodes as one: when
the run's bytes are not UTF-8, every byte of it becomes U+FFFD, the valid ones before the
bad one included; so nothing is emitted while the tokens end in a byte token, and the run is
decoded whole once it ends (a skipped special token does not end it: decode drops it first).

Stop strings are searched only where a new match can be: each ends in the new text (so
starts at most ``len(stop) - 1`` characters before it). As vLLM's, a stop string counts only
once more than ``min_tokens`` tokens are out: one completed by an earlier token is never
found, as an EOS is not sampled before then. Several tokens at once (a drafted step's
accepted ones) are taken one at a time while there are stop strings to watch, as that many
one-token steps would: a stop string ends the text at the token that completed it (the
tokens after it are not taken: ``output_token_ids`` says how many were), and ``min_tokens``
counts to the token, not to the step.

Where transformers cleans up the decoded text's spaces (``clean_up_tokenization_spaces`` on
a WordPiece / Unigram tokenizer: ``a . b ' s`` -> ``a. b's``), the windows are decoded raw
and the whole text is cleaned as it grows (space_cleanup.py), so that it is what decoding
the output at the end gives, as for a request without stop strings. Stop strings are looked
for in that cleaned text, the text the request outputs: a stop ``"."`` after ``a`` cuts
before the ``.`` of ``a.``, leaving ``a``, not the ``a `` of the raw ``a .``.
"""

from __future__ import annotations

import os
import re
import weakref

from transformers import PreTrainedTokenizerBase

from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.space_cleanup import CleanedText, cleanup_policy
from tokenmill.engine.special_ids import special_token_ids

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT_CHAR = "\ufffd"
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a ByteFallback byte token; group 1: its byte
# tokenizer -> its ByteFallback byte tokens' ids (empty without that decoder)
_byte_tokens: weakref.WeakKeyDictionary[object, frozenset[int]] = weakref.WeakKeyDictionary()


def byte_fallback_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The ids of ``tokenizer``'s ``<0x..>`` byte tokens when its decoder joins them with
    ByteFallback (SentencePiece models); empty otherwise. Read once per tokenizer."""
    known = _byte_tokens.get(tokenizer)
    if known is not None:
        return known
    ids: frozenset[int] = frozenset()
    if has_decoder_step(tokenizer, "ByteFallback"):
        vocab = tokenizer.get_vocab()
        ids = frozenset(i for token, i in vocab.items() if BYTE_TOKEN.fullmatch(token))
    _byte_tokens[tokenizer] = ids
    return ids


def has_decoder_step(tokenizer: PreTrainedTokenizerBase, step: str) -> bool:
    """Whether ``tokenizer``'s decoder runs ``step`` ("ByteFallback", "ByteLevel"). The
    decoder's repr lists its steps (Sequence(decoders=[..., ByteFallback(), ...])): no need
    to serialize the whole tokenizer, megabytes for a large vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and f"{step}(" in repr(backend.decoder)


class IncrementalDetokenizer:
    """Decodes one request's output tokens incrementally and watches for its stop strings.

    ``output_text`` is the text decoded so far, never ending in a half-decoded character. Once
    the sequence is complete, ``flush()`` releases any held-back tail; after that (and when no
    stop string matched) ``output_text == tokenizer.decode(output_ids, skip_special_tokens=...)``.
    ``prompt_token_ids`` is accepted for interface symmetry but unused: the output is decoded
    on its own so that the text is exactly what decoding the output tokens gives.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self._tokenizer = tokenizer
        self._params = params
        self._watch_stops = bool(params.stop)  # (each stop string looks back its own length)
        self._token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._num_pending_chars = 0  # text emitted past read_offset's (incomplete tail held)
        self._text = ""  # the raw decoded text (before any space clean-up)
        self._stop_string: str | None = None
        # With transformers' space clean-up: the cleaned text, which stop strings end.
        self._cleaner = CleanedText(tokenizer) if cleanup_policy(tokenizer) is True else None
        self._cleaned = ""
        # Tokens the text may not settle on: byte tokens, and (skipped) special tokens after
        # which a run of byte tokens may go on, as decode joins the two sides.
        # ids past the tokenizer's vocabulary (a model's padding rows) decode to nothing too.
        self._run_ids = byte_fallback_ids(tokenizer)
        if self._run_ids and params.skip_special_tokens:
            self._run_ids = self._run_ids | special_token_ids(tokenizer)
        self._vocab_end = len(tokenizer) if self._run_ids else 1 << 62

    @property
    def output_text(self) -> str:
        """Text so far; after a stop string, cut before it (or after it, when included)."""
        return self._text if self._cleaner is None else self._cleaned

    @property
    def output_token_ids(self) -> list[int]:
        return self._token_ids

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text, if any."""
        return self._stop_string

    def append(self, token_ids: list[int]) -> str | None:
        """Feed newly generated tokens; return the stop string they completed, else None.
        A stop string completed before the last of them leaves the rest untaken.

        Stop strings are not looked for until more than ``params.min_tokens`` tokens have been
        generated (vLLM's rule: the token completing one comes after min_tokens others).
        Raises RuntimeError when called after a stop string matched.
        """
        if self._stop_string is not None:
            raise RuntimeError(
                f"IncrementalDetokenizer.append: the text already stopped at "
                f"{self._stop_string!r}; finish the request instead of feeding more tokens"
            )
        if not self._watch_stops:
            self._token_ids.extend(token_ids)
            return self._decode_new(final=False)
        for token_id in token_ids:
            self._token_ids.append(token_id)
            stop = self._decode_new(final=False)
            if stop is not None:
                return stop
        return None

    def flush(self) -> str | None:
        """Emit a held-back incomplete tail (as U+FFFD, like ``decode``) once no more tokens come.

        Call it when the request finishes for another reason than a stop string (EOS, length).
        Returns the stop string the tail completed, else None; a no-op after a stop string.
        """
        if self._stop_string is not None:
            return None
        return self._decode_new(final=True)

    def _decode_new(self, final: bool) -> str | None:
        ids = self._token_ids
        if self._read_offset == len(ids):
            return None
        if not final and (ids[-1] in self._run_ids or ids[-1] >= self._vocab_end):
            return None  # inside a run of byte tokens: it decodes whole once it ends
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset :])[len(prefix_text) :]
        complete = final or not new_text.endswith(_REPLACEMENT_CHAR)
        if not complete:
            # Only the trailing incomplete character waits; the text before it is settled.
            new_text = new_text.rstrip(_REPLACEMENT_CHAR)
        start = len(self._text)
        searched_from = start
        if self._watch_stops and self._read_offset < self._params.min_tokens < len(ids):
            # A run of byte tokens decodes whole: the text its tokens up to min_tokens gave
            # is not searched, as it would not be had they been decoded one at a time.
            settled = start - self._num_pending_chars
            searched_from = max(start, settled + self._text_through_min_tokens(new_text))
        self._text += new_text[self._num_pending_chars :]
        if final or (complete and new_text):
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)
            self._num_pending_chars = 0
        else:
            # Offsets stay (nothing new, e.g. skipped special tokens, or an incomplete
            # character); remember what of this window's text was already emitted.
            self._num_pending_chars = len(new_text)
        if self._cleaner is not None:
            searched_from = self._clean(self._cleaner, searched_from)
        if (
            len(self.output_text) > searched_from
            and self._watch_stops
            and len(ids) > self._params.min_tokens
        ):
            return self._find_stop(searched_from)
        return None

    def _clean(self, cleaner: CleanedText, raw_from: int) -> int:
        """Clean the raw text grown since the last call; return where in the cleaned text the
        raw text past ``raw_from`` begins: past what the cleaned text up to it and the new one
        share (a clean-up can rewrite the last few characters: ``a `` became ``a.``)."""
        settled = len(cleaner.settled)  # (both texts start with it)
        before = cleaner.peek(self._text[:raw_from])  # first: update settles past raw_from
        self._cleaned = cleaner.update(self._text)
        shared = os.path.commonprefix([before[settled:], self._cleaned[settled:]])
        return settled + len(shared)

    def _text_through_min_tokens(self, new_text: str) -> int:
        """How much of ``new_text`` (the window's text past ``read_offset``) the tokens up to
        ``min_tokens`` complete: the most any of their prefixes gives without a trailing
        incomplete character (a byte run that goes on invalid decodes as U+FFFD only)."""
        prefix_len = len(self._decode(self._token_ids[self._prefix_offset : self._read_offset]))
        most = 0
        for end in range(self._read_offset + 1, self._params.min_tokens + 1):
            text = self._decode(self._token_ids[self._prefix_offset : end])[prefix_len:]
            text = text.rstrip(_REPLACEMENT_CHAR)
            if new_text.startswith(text):
                most = max(most, len(text))
        return most

    def _decode(self, token_ids: list[int]) -> str:
        if self._cleaner is None:
            return self._tokenizer.decode(
                token_ids, skip_special_tokens=self._params.skip_special_tokens
            )
        # raw: a clean-up of the window alone would miss a pattern reaching before it
        return self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._params.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _find_stop(self, new_from: int) -> str | None:
        """Cut the text at the stop string whose first match ending past ``new_from`` (in
        the text just added) ends earliest (ties: list order).

        Earliest end is what streaming the text one character at a time would find, so the
        result does not depend on how the text was split into tokens. Each stop string is
        looked for from its own length back, never further: text added before
        ``min_tokens`` was not searched, and a stop it holds must not be found later (a
        longer stop string's look-back reached it, so the result depended on the others).
        """
        text = self.output_text
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self._params.stop:
            start = text.find(stop, max(0, new_from - len(stop) + 1))
            if start >= 0 and (best is None or start + len(stop) < best[0]):
                best = (start + len(stop), start, stop)
        if best is None:
            return None
        end, start, stop = best
        text = text[: end if self._params.include_stop_str_in_output else start]
        if self._cleaner is None:
            self._text = text
        else:
            self._cleaned = text
        self._stop_string = stop
        return stop
