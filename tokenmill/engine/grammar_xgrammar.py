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

What xgrammar lets through that a constraint forbids is kept out (xgrammar_limits.py):
every row's mask is ANDed with one without special tokens and surrogate halves (JSON rows':
without control bytes too), and schemas and regexes using what xgrammar does not enforce
are refused, naming it.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tokenmill.engine.date_format import with_date_patterns
from tokenmill.engine.grammar_llguidance import executor_threads
from tokenmill.engine.special_ids import special_token_ids
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
from tokenmill.engine.xgrammar_limits import (
    check_schema,
    surrogate_edges,
    token_masks,
    xgrammar_false_properties,
    xgrammar_format_patterns,
    xgrammar_regex,
    xgrammar_schema_patterns,
)

__all__ = ["XgrammarGrammars", "load_xgrammar", "xgrammar_refusal"]

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


@functools.lru_cache(maxsize=64)  # a job's rows share a few constraints
def xgrammar_refusal(spec: str) -> str | None:
    """Why the xgrammar backend cannot run the canonical constraint ``spec``, or None (no
    tokenizer needed: a job's constraints are checked before its model loads); the callers
    name where the constraint came from. Raises ImportError without xgrammar."""
    grammar = load_xgrammar().Grammar
    try:
        _built(spec, grammar.from_regex, grammar.from_ebnf, grammar.from_json_schema)
    except ValueError as exc:
        return str(exc).removeprefix(f"{_PARAM}: ")
    return None


def _built(
    spec: str,
    regex: Callable[[str], Any],
    ebnf: Callable[[str], Any],
    schema: Callable[..., Any],
) -> Any:
    """What ``regex``, ``ebnf`` or ``schema`` (xgrammar's compilers, with or without a
    tokenizer) make of the canonical constraint ``spec``, after refusing what xgrammar would
    not enforce (xgrammar_limits.py). Raises ValueError naming ``SamplingParams
    .structured_output``."""
    try:
        if spec.startswith(REGEX_PREFIX):
            return regex(xgrammar_regex(spec[len(REGEX_PREFIX) :]))
        if spec.startswith(CHOICE_PREFIX):
            choices = json.loads(spec[len(CHOICE_PREFIX) :])
            return ebnf(  # characters as they are: an escaped astral one (\ud83d\ude00)
                "root ::= "  # would be two broken halves
                + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
            )
        text = _ANY_OBJECT if spec == JSON_OBJECT else spec
        check_schema(text)
        text = xgrammar_false_properties(text)  # (it compiles no "b": false)
        # strict_mode off: an object without additionalProperties takes other keys, as
        # JSON Schema says and llguidance does (xgrammar's default allowed none, and refused
        # minProperties past the properties listed)
        text = with_date_patterns(text)  # (its "date" lets 2024-04-31 through)
        text = xgrammar_format_patterns(text)  # (its "ipv4" lets 01.2.3.4 through)
        text = xgrammar_schema_patterns(text)  # (and the date patterns' optional parts)
        return schema(text, any_whitespace=False, separators=(",", ":"), strict_mode=False)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(
            f"{_PARAM}: xgrammar cannot use this {describe(spec)}: {_message(exc)}"
        ) from None


class XgrammarGrammars:
    """Matchers, masks and token consumption through xgrammar (loaded on first use)."""

    name = "xgrammar"
    leaves_masks_open = False  # (grammar_drafts.py; it has no side-effect-free token check)

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
        self._xgr: Any = None
        self._compiler: Any = None
        self._batch: Any = None
        self._compiled: dict[str, Any] = {}
        self._one = np.zeros((1, -(-vocab_size // 32)), dtype=np.int32)  # _stopped's mask
        # [words] int32: the tokens JSON rows, and regex and choice rows, may take
        self._json_tokens: np.ndarray | None = None
        self._text_tokens: np.ndarray | None = None
        # surrogate_edges: [vocab] bool, token ends with 0xED; bytes, token starts A0-BF
        self._ends_lead = np.zeros(0, dtype=bool)
        self._continues = b""
        self._after_lead: set[int] = set()  # matchers whose last token ended with 0xED
        self._broken: set[int] = set()  # matchers rejected for a split surrogate
        # Matchers that took a stop token, by id (held, so no other matcher takes the id):
        # xgrammar fills them no mask (it raises), but with async scheduling their row's
        # next step is scheduled before their request ends (structured_output.py): that row
        # may take a stop token only, and its token goes. Released ones are forgotten at the
        # next consume: the engine releases a request's matcher while that step's masks are
        # being filled (``bitmask(beside=...)``), where the fill still needs to know.
        self._terminated: dict[int, Any] = {}
        self._released: list[int] = []

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
        matchers = [m for m, _ in rows]
        if self._terminated and not self._terminated.keys().isdisjoint(map(id, matchers)):
            places = list(range(len(rows))) if places is None else places
            ended = [id(m) in self._terminated for m in matchers]
            mask[[p for p, e in zip(places, ended, strict=True) if e]] = self._stop_tokens
            live = [i for i, e in enumerate(ended) if not e]
            matchers, live_places = [matchers[i] for i in live], [places[i] for i in live]
            self._batch.batch_fill_next_token_bitmask(matchers, mask, live_places)
        else:
            self._batch.batch_fill_next_token_bitmask(matchers, mask, places)
        kinds: tuple[list[int], list[int]] = ([], [])  # rows of (regex and choice, JSON)
        for i, (_, json_output) in enumerate(rows):
            kinds[json_output].append(i)
        if not kinds[False] and places is None:
            mask[: len(rows)] &= self._json_tokens
            return
        for tokens, chosen in ((self._text_tokens, kinds[False]), (self._json_tokens, kinds[True])):
            if chosen:
                mask[chosen if places is None else [places[i] for i in chosen]] &= tokens

    def consume(self, rows: Sequence[Row], tokens: Sequence[int]) -> np.ndarray:
        """Each row's matcher takes its token: [rows] uint8, TAKEN, STOPPED or REJECTED
        (structured_output_params) per row, in input order."""
        matchers = [m for m, _ in rows]
        tokens = [int(t) for t in tokens]
        while self._released:
            self._terminated.pop(self._released.pop(), None)
        taken = self._xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        ok = np.fromiter(taken, dtype=bool, count=len(rows))
        ids = np.asarray(tokens, dtype=np.int64)
        after = self._after_lead and any(id(m) in self._after_lead for m in matchers)
        if after or (len(ids) and self._ends_lead[ids[ok]].any()):
            return self._consumed_row_by_row(rows, tokens, ok)  # a surrogate lead in play
        # No row follows a token ending with 0xED and none takes one: no surrogate check.
        # Only a completed or terminated matcher may have stopped (_stopped).
        status = np.where(ok, TAKEN, REJECTED).astype(np.uint8)
        for i in np.flatnonzero(ok).tolist():
            matcher = matchers[i]
            if matcher.is_completed() or matcher.is_terminated():
                if self._stopped(matcher, rows[i][1]):
                    status[i] = STOPPED
        return status

    def _consumed_row_by_row(
        self, rows: Sequence[Row], tokens: Sequence[int], ok: np.ndarray
    ) -> np.ndarray:
        """``consume``'s statuses after the batch took the tokens (``ok``), a row at a time
        through the surrogate check."""
        status = np.full(len(rows), REJECTED, dtype=np.uint8)
        for i, ((matcher, json_output), taken) in enumerate(zip(rows, ok.tolist(), strict=True)):
            if taken and self._split_surrogate(id(matcher), tokens[i]):
                self._broken.add(id(matcher))
            elif taken:
                status[i] = STOPPED if self._stopped(matcher, json_output) else TAKEN
        return status

    def _split_surrogate(self, key: int, token: int) -> bool:
        """Whether ``token`` completes a surrogate half with the token before it (never
        valid UTF-8: xgrammar allows it in strings, its mask cannot keep it out)."""
        if key in self._after_lead:
            self._after_lead.discard(key)
            if self._continues[token]:
                return True
        if self._ends_lead[token]:
            self._after_lead.add(key)
        return False

    def advance(self, rows: Sequence[Row], tokens: Sequence[int]) -> np.ndarray:
        """Each row's matcher takes its draft token for now, to fill the masks after it
        (grammar_drafts.py): [rows] bool, whether it took it. Unlike ``consume`` it keeps no
        account (surrogates, stops) and takes no stop token; ``rollback`` undoes it."""
        ok = np.zeros(len(rows), dtype=bool)
        live = [
            i
            for i, (matcher, _) in enumerate(rows)
            if int(tokens[i]) not in self._eos and id(matcher) not in self._terminated
        ]
        if live:
            taken = self._xgr.BatchGrammarMatcher.batch_accept_token(
                [rows[i][0] for i in live], [int(tokens[i]) for i in live]
            )
            ok[live] = np.fromiter(taken, dtype=bool, count=len(live))
        return ok

    def rollback(self, rows: Sequence[Row], counts: Sequence[int]) -> None:
        """Each row's matcher gives back its last ``counts[i]`` tokens (``advance``'s)."""
        if len(rows):
            self._xgr.BatchGrammarMatcher.batch_rollback(
                [m for m, _ in rows], [int(c) for c in counts]
            )

    def release(self, rows: Sequence[Row]) -> None:
        """Finished requests' matchers: forgotten (they go with their last reference)."""
        for matcher, _ in rows:
            self._after_lead.discard(id(matcher))
            self._broken.discard(id(matcher))
            if id(matcher) in self._terminated:
                self._released.append(id(matcher))

    def error(self, row: Row) -> str:
        """Why ``row``'s last token was rejected."""
        if id(row[0]) in self._broken:
            return "it and the token before it write half of a UTF-16 surrogate, not UTF-8"
        return "xgrammar does not allow this token here"

    def _stopped(self, matcher: Any, json_output: bool) -> bool:
        """The output is complete: nothing but a stop token may follow."""
        if matcher.is_terminated():  # it took a stop token
            self._terminated[id(matcher)] = matcher
            return True
        if not matcher.is_completed():
            return False
        matcher.fill_next_token_bitmask(self._one, 0)
        self._one &= self._json_tokens if json_output else self._text_tokens
        # any allowed token (within the vocabulary) that is not a stop token?
        self._one &= self._not_stop
        return not self._one.any()

    def _compile(self, spec: str) -> Any:
        if self._compiler is None:
            self._load()
        compiler = self._compiler
        return _built(
            spec, compiler.compile_regex, compiler.compile_grammar, compiler.compile_json_schema
        )

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
        self._json_tokens, self._text_tokens = token_masks(
            info.decoded_vocab,
            self.vocab_size,
            self._eos,
            sorted(special_token_ids(self._tokenizer)),
        )
        ends_lead, self._continues = surrogate_edges(info.decoded_vocab, self.vocab_size)
        self._ends_lead = np.frombuffer(ends_lead, dtype=np.uint8).astype(bool)
        # [words] int32: every token of the vocabulary but the stop tokens (``_stopped``)
        stop_ids = [t for t in self._eos if 0 <= t < self.vocab_size]
        bits = np.zeros(self._one.shape[1] * 32, dtype=np.uint8)
        bits[: self.vocab_size] = 1
        bits[stop_ids] = 0
        self._not_stop = np.packbits(bits, bitorder="little").view(np.int32)
        # and the stop tokens alone (a terminated matcher's row: ``fill``)
        stops = np.zeros_like(bits)
        stops[stop_ids] = 1
        self._stop_tokens = np.packbits(stops, bitorder="little").view(np.int32)
        threads = self._threads or executor_threads()
        # Compiled grammars are kept in ``_compiled`` (the newest 64): xgrammar's own cache
        # has no bound by default and grew by each new schema (a job's per-row schemas).
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self._xgr = xgr


def _message(exc: Exception) -> str:
    """xgrammar's error without its log prefix ("[hh:mm:ss] file.cc:94: ")."""
    lines = str(exc).strip().splitlines()
    if not lines:
        return type(exc).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[0])
