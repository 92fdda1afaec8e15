"""The xgrammar grammar backend of structured output (``structured_output_backend:
xgrammar``; structured_output.py has the rest).

One compiled grammar per constraint (xgrammar caches what it computes per grammar, not per
matcher), a ``GrammarMatcher`` per request, masks filled and tokens taken for a whole step
in one ``BatchGrammarMatcher`` call on its threads. Unlike llguidance it holds the GIL while
it fills, so the engine's processing beside the fill waits for it.

The constraint kinds map to xgrammar's compilers: a JSON schema (and json_object, as the
schema ``{"type": "object"}``) compiled compactly (no free whitespace, separators "," and
":", as the llguidance backend writes JSON); a regex with xgrammar's regex syntax; a choice
as a grammar of its quoted strings. A request ends ("stop") once its output is complete and
nothing but a stop token may follow, as with llguidance: checked on the rows whose grammar
says complete, from a one-row mask.

JSON rows never get a token with a control character (a byte below 0x20) in it: compact JSON
has no whitespace between values and a string holds control characters only escaped, but
xgrammar 0.2.9's rule for a string with ``maxLength`` is ``[^"\\\r\n]{0,n}``, which lets a
raw tab or NUL through (a random model wrote them: 18% of rows failed ``json.loads``). Their
masks are ANDed with one that drops those tokens; regex and choice rows keep what their
pattern allows.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from tokenmill.engine.grammar_llguidance import executor_threads
from tokenmill.engine.structured_output_params import (
    CHOICE_PREFIX,
    JSON_OBJECT,
    REGEX_PREFIX,
    REJECTED,
    STOPPED,
    TAKEN,
    describe,
    require_tokenizer,
)

__all__ = ["XgrammarGrammars", "load_xgrammar"]

_PARAM = "SamplingParams.structured_output"
_ANY_OBJECT = '{"type":"object"}'
Row = tuple[Any, bool]  # (a request's matcher, whether its output is JSON)


def load_xgrammar() -> Any:
    """The xgrammar module. Raises ImportError saying how to install it."""
    try:
        import xgrammar
    except ImportError as exc:
        raise ImportError(
            "structured_output_backend xgrammar needs the xgrammar package: pip install "
            "xgrammar (or use the default backend, llguidance)"
        ) from exc
    return xgrammar


class XgrammarGrammars:
    """Matchers, masks and token consumption through xgrammar (loaded on first use)."""

    name = "xgrammar"

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        threads: int | None = None,  # None: executor_threads()
    ) -> None:
        self._tokenizer = tokenizer
        self._threads = threads
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._stop_ids = frozenset(self._eos)
        self._xgr: Any = None
        self._compiler: Any = None
        self._batch: Any = None
        self._compiled: dict[str, Any] = {}
        self._one = np.zeros((1, -(-vocab_size // 32)), dtype=np.int32)  # _stopped's mask
        self._json_tokens: np.ndarray | None = None  # [words] int32: tokens JSON may hold

    def matcher(self, spec: str) -> Row:
        """A matcher in its start state for a new request. Raises ValueError when xgrammar
        cannot compile ``spec`` for this tokenizer."""
        compiled = self._compiled.get(spec)
        if compiled is None:
            compiled = self._compile(spec)
            if len(self._compiled) >= 64:  # a job rarely has more schemas; keep the newest
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[spec] = compiled
        json_output = not spec.startswith((REGEX_PREFIX, CHOICE_PREFIX))
        return self._xgr.GrammarMatcher(compiled), json_output

    def fill(self, rows: Sequence[Row], mask: np.ndarray, at: Sequence[int] | None = None) -> None:
        """Row ``at[i]`` (default i) of ``mask`` [rows, words] int32 <- rows[i]'s next-token
        bitmask."""
        places = None if at is None else list(at)
        self._batch.batch_fill_next_token_bitmask([m for m, _ in rows], mask, places)
        json_rows = [i for i, (_, json_output) in enumerate(rows) if json_output]
        if len(json_rows) == len(rows) and places is None:
            mask[: len(rows)] &= self._json_tokens
        elif json_rows:
            mask[json_rows if places is None else [places[i] for i in json_rows]] &= (
                self._json_tokens
            )

    def consume(self, rows: Sequence[Row], tokens: Sequence[int]) -> np.ndarray:
        """Each row's matcher takes its token: [rows] uint8, TAKEN, STOPPED or REJECTED
        (structured_output_params) per row, in input order."""
        matchers = [m for m, _ in rows]
        taken = self._xgr.BatchGrammarMatcher.batch_accept_token(matchers, list(tokens))
        status = np.full(len(rows), REJECTED, dtype=np.uint8)
        for i, ((matcher, json_output), ok) in enumerate(zip(rows, taken, strict=True)):
            if ok:
                status[i] = STOPPED if self._stopped(matcher, json_output) else TAKEN
        return status

    def release(self, rows: Sequence[Row]) -> None:
        """Finished requests' matchers: nothing to do (they go with their last reference)."""

    def error(self, row: Row) -> str:
        """Why ``row``'s last token was rejected."""
        return "xgrammar does not allow this token here"

    def _stopped(self, matcher: Any, json_output: bool) -> bool:
        """The output is complete: nothing but a stop token may follow."""
        if matcher.is_terminated():
            return True
        if not matcher.is_completed():
            return False
        matcher.fill_next_token_bitmask(self._one, 0)
        if json_output:
            self._one &= self._json_tokens
        bits = np.unpackbits(self._one.view(np.uint8), bitorder="little")[: self.vocab_size]
        return set(np.flatnonzero(bits).tolist()) <= self._stop_ids

    def _compile(self, spec: str) -> Any:
        if self._compiler is None:
            self._load()
        compiler = self._compiler
        try:
            if spec.startswith(REGEX_PREFIX):
                return compiler.compile_regex(spec[len(REGEX_PREFIX) :])
            if spec.startswith(CHOICE_PREFIX):
                choices = json.loads(spec[len(CHOICE_PREFIX) :])
                return compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c) for c in choices)
                )
            schema = _ANY_OBJECT if spec == JSON_OBJECT else spec
            return compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(
                f"{_PARAM}: xgrammar cannot use this {describe(spec)}: {_message(exc)}"
            ) from None

    def _load(self) -> None:
        require_tokenizer(self._tokenizer)
        xgr = load_xgrammar()
        try:
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._eos or None
            )
        except (ValueError, TypeError, RuntimeError) as exc:
            raise ValueError(
                f"{_PARAM}: xgrammar cannot read the model's tokenizer "
                f"({type(exc).__name__}: {exc})"
            ) from None
        self._json_tokens = _without_control_bytes(info.decoded_vocab, self.vocab_size, self._eos)
        threads = self._threads or executor_threads()
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads)
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self._xgr = xgr


def _without_control_bytes(
    vocab: Sequence[bytes], vocab_size: int, stop_ids: Sequence[int]
) -> np.ndarray:
    """[ceil(vocab_size / 32)] int32: bit t set unless token t's bytes hold one below 0x20
    (stop tokens always set; ids past the tokenizer's vocabulary too: no grammar allows
    them anyway)."""
    allowed = np.ones(-(-vocab_size // 32) * 32, dtype=np.uint8)
    for token, text in enumerate(vocab[:vocab_size]):
        if min(text, default=32) < 32:
            allowed[token] = 0
    allowed[list(stop_ids)] = 1
    return np.packbits(allowed, bitorder="little").view(np.int32)


def _message(exc: Exception) -> str:
    """xgrammar's error without its log prefix ("[hh:mm:ss] file.cc:94: ")."""
    lines = str(exc).strip().splitlines()
    if not lines:
        return type(exc).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[0])
