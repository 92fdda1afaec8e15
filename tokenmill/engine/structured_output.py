"""Structured output: a per-request grammar (a JSON schema) that masks the tokens it forbids.

The grammar engine is llguidance (``pip install llguidance``): it compiles a JSON schema
against the model's tokenizer into a token-level matcher that fills a next-token bitmask
and consumes sampled tokens. It is imported only when a request has a schema, so the engine
runs without it otherwise.

    SamplingParams(structured_output=schema | "json_object")
        ─► check_structured_output: canonical JSON text, grammar compiled once (cached)
    LLMEngine.add_request ─► StructuredOutputs.add: a matcher for the request
    ModelRunner.launch ─► SamplingMetadata: the rows with a grammar ─► bitmask(requests)
        [G, ceil(V / 32)] int32 on the host, one upload ─► Sampler: -inf where a bit is 0
        (after penalties, before temperature / top-k / top-p / greedy argmax)
    LLMEngine._process ─► advance: each matcher consumes its request's new tokens; a matcher
        that has stopped (the JSON is complete) ends its request, finish_reason "stop"
    finished / aborted ─► drop

The mask is filled while the device runs the step's forward pass (``launch`` enqueues the
model first, then builds the sampling metadata).

How it meets the rest of the engine:

- **Async scheduling.** Step n+1 is normally scheduled before step n's tokens reach the host,
  but a constrained row's mask for step n+1 depends on its token from step n. The engine runs
  synchronously (finish the step in flight, then schedule; process each step at once) while
  any request with a grammar is in it, exactly as it does for a drafted step; with none, it
  goes back to overlapping. ``bitmask`` raises if a row's tokens are not all consumed.
- **Preemption.** Preemption recomputes: the request keeps its output tokens and re-runs
  prompt + output. A grammar counts the tokens it has consumed and only ever feeds the ones
  past that count, so a recomputed request never advances its matcher twice.
- **Speculative decoding.** Rows with a grammar take no drafts (``core/drafts.py``), like
  rows that ask for logprobs: every step samples one token for them.

JSON is generated compactly (llguidance's ``whitespace_flexible`` off): no free whitespace
between tokens, so a small model cannot wander off into endless blank lines. A schema may
override it through llguidance's ``x-guidance`` key.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from tokenmill.engine.core.batch_slots import BatchSlots
    from tokenmill.engine.core.request import Request

__all__ = [
    "JSON_OBJECT",
    "StructuredOutputs",
    "check_structured_output",
    "load_llguidance",
]

log = logging.getLogger(__name__)

JSON_OBJECT = "json_object"  # any JSON object (OpenAI's response_format json_object)
_ANY_OBJECT_SCHEMA = '{"type":"object"}'
_COMPILE_DEFAULTS = {"whitespace_flexible": False}
_PARAM = "SamplingParams.structured_output"


def load_llguidance() -> Any:
    """The llguidance module. Raises ImportError saying how to install it."""
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401  (the bitmask helpers)
    except ImportError as exc:
        raise ImportError(
            "structured output (SamplingParams.structured_output, sampling.structured_output "
            "in job.yaml, response_format in OpenAI Batch bodies) needs the llguidance "
            "package: pip install llguidance"
        ) from exc
    return llguidance


def check_structured_output(value: Any, name: str = _PARAM) -> str | None:
    """Validate a ``structured_output`` value; return its canonical form.

    Takes None, ``"json_object"`` (any JSON object), or a JSON schema as a dict or a JSON
    string. Returns None, ``"json_object"``, or the schema as compact JSON text (property
    order kept: it is the order the fields are generated in). Raises ValueError naming the
    parameter (``name``) when the value is not a JSON-schema object or llguidance cannot
    compile it, and ImportError when llguidance is not installed.
    """
    if value is None:
        return None
    if isinstance(value, str):
        return _check_text(value, name)
    if not isinstance(value, dict):
        raise ValueError(
            f"{name} must be a JSON schema (a dict or a JSON string) or {JSON_OBJECT!r}, "
            f"got {type(value).__name__}"
        )
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: the schema is not JSON-serializable ({exc})") from None
    return _check_text(text, name)


@functools.lru_cache(maxsize=512)
def _check_text(text: str, name: str) -> str:
    """Canonical text of a JSON-string value, its grammar compiled and validated (cached:
    a batch job's rows usually share one schema)."""
    if text == JSON_OBJECT:
        canonical = text
    else:
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{name} must be {JSON_OBJECT!r} or a JSON schema; this string is neither "
                f"(not JSON: {exc.msg} at position {exc.pos})"
            ) from None
        if not isinstance(schema, dict):
            raise ValueError(
                f'{name} must be a JSON schema object ({{"type": ...}}), got JSON '
                f"{type(schema).__name__}"
            )
        try:
            canonical = json.dumps(
                schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False
            )
        except ValueError as exc:  # NaN or Infinity, which JSON itself does not have
            raise ValueError(f"{name}: the schema is not valid JSON ({exc})") from None
    llg = load_llguidance()
    try:
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(_grammar(canonical))
    except ValueError as exc:
        is_error, messages = True, [str(exc)]
    if is_error:
        raise ValueError(f"{name}: llguidance cannot use this JSON schema: {messages[0]}")
    return canonical


@functools.lru_cache(maxsize=512)
def _grammar(canonical: str) -> str:
    """llguidance's grammar text for a canonical ``structured_output`` value."""
    llg = load_llguidance()
    schema = _ANY_OBJECT_SCHEMA if canonical == JSON_OBJECT else canonical
    return llg.LLMatcher.grammar_from_json_schema(schema, defaults=_COMPILE_DEFAULTS)


@dataclass
class _Grammar:
    """One request's matcher and how many of its output tokens the matcher has consumed."""

    request: Request
    matcher: Any  # llguidance.LLMatcher
    num_fed: int = 0


class StructuredOutputs:
    """The engine's grammars, one per running or waiting request that has one.

    llguidance's tokenizer is built from the model's (fast HF) tokenizer on the first
    request with a grammar (about half a second); ``vocab_size`` is the model's logits width.
    Its length (``len``) is the number of requests with a grammar.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._llg: Any = None
        self._ll_tokenizer: Any = None
        self._executor: Any = None
        self._fresh: dict[str, Any] = {}  # canonical value -> a matcher in its start state
        self._grammars: dict[str, _Grammar] = {}

    def __len__(self) -> int:
        return len(self._grammars)

    def add(self, request: Request) -> None:
        """Give ``request`` (whose SamplingParams has ``structured_output``) its matcher.

        Raises ValueError when the model has no tokenizer or llguidance rejects the grammar
        for this tokenizer, ImportError without llguidance; nothing is added then.
        """
        spec = request.sampling_params.structured_output
        if spec is None:
            raise ValueError(f"request {request.request_id} has no structured_output")
        fresh = self._fresh.get(spec)
        if fresh is None:
            fresh = self._compile(spec)
            if len(self._fresh) >= 64:  # a job rarely has more schemas; keep the newest
                self._fresh.pop(next(iter(self._fresh)))
            self._fresh[spec] = fresh
        self._grammars[request.request_id] = _Grammar(request, fresh.deep_copy())

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget the grammars of finished or aborted requests (unknown ids are ignored)."""
        for rid in request_ids:
            self._grammars.pop(rid, None)

    def bitmask(self, requests: Sequence[Request]) -> np.ndarray:
        """[G, ceil(vocab_size / 32)] int32: bit t of row i (little-endian within each int32)
        is set when token t may follow ``requests[i]``'s output so far.

        Raises RuntimeError when a request has no grammar or output tokens its matcher has
        not consumed (a step scheduled before the previous one's tokens were applied).
        """
        words = -(-self.vocab_size // 32)
        mask = np.empty((len(requests), words), dtype=np.int32)
        pairs = []
        for i, req in enumerate(requests):
            grammar = self._grammars.get(req.request_id)
            if grammar is None:
                raise RuntimeError(f"request {req.request_id} has no grammar")
            # With async scheduling this step's own token counts as pending; one more is
            # a token from an earlier step the host has not applied yet.
            if req.num_pending_tokens > 1 or grammar.num_fed != req.num_output_tokens:
                raise RuntimeError(
                    f"request {req.request_id}: its grammar is behind its output; a step with "
                    "a constrained row must be scheduled after the previous step's tokens land"
                )
            pairs.append((grammar.matcher, i))
        self._llg.numpy.fill_next_token_bitmask_par(self._executor, pairs, mask)
        return mask

    def advance(self, table: BatchSlots | None) -> list[str]:
        """Feed each unfinished request's new output tokens to its matcher.

        Returns the ids of the requests whose matcher has now stopped (the output is
        complete: nothing but EOS may follow), or that failed (a token it rejected; logged):
        the caller finishes them. ``table`` is the scheduler's batch slots, where an
        attached request's tokens live (None: no request holds a slot).
        """
        single: list[tuple[Any, int]] = []  # (matcher, token): a step's usual one token
        fed: list[tuple[str, _Grammar]] = []
        for rid, grammar in self._grammars.items():
            req = grammar.request
            if req.finished:
                continue  # dropped when the engine hands it on
            n = req.num_tokens
            start = req.num_prompt_tokens + grammar.num_fed
            if n <= start:
                continue
            if req.slot >= 0 and table is not None:
                new = table.token_ids[req.slot, start:n].tolist()
            else:
                new = req.all_token_ids[start:n]
            grammar.num_fed += len(new)
            fed.append((rid, grammar))
            if len(new) == 1:
                single.append((grammar.matcher, new[0]))
            else:  # a request that caught up on several tokens
                grammar.matcher.consume_tokens(new)
        if single:  # on llguidance's threads, in parallel
            self._executor.consume_token_par(single)
        done: list[str] = []
        for rid, grammar in fed:
            # A rejected token leaves the matcher in its error state (and stopped).
            if grammar.matcher.is_error():
                log.warning(
                    "request %s: its grammar rejected a sampled token (%s); ending it",
                    rid,
                    grammar.matcher.get_error()[:500],
                )
                done.append(rid)
            elif grammar.matcher.is_stopped():
                done.append(rid)
        return done

    def _compile(self, spec: str) -> Any:
        """A fresh matcher for ``spec`` on this model's tokenizer (ValueError if it fails)."""
        if self._ll_tokenizer is None:
            self._load_tokenizer()
        llg = self._llg
        grammar = _grammar(spec)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(
            grammar, self._ll_tokenizer
        )
        matcher = None if is_error else llg.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if matcher is None or matcher.is_error():
            error = messages[0] if is_error else matcher.get_error()
            raise ValueError(f"{_PARAM}: llguidance cannot use this JSON schema: {error[:500]}")
        return matcher

    def _load_tokenizer(self) -> None:
        if self._tokenizer is None:
            raise ValueError(
                f"{_PARAM} needs the model's tokenizer; this engine has none (load_format='random')"
            )
        llg = load_llguidance()
        from llguidance.hf import from_tokenizer

        try:
            self._ll_tokenizer = from_tokenizer(
                self._tokenizer, n_vocab=self.vocab_size, eos_token=self._eos or None
            )
        except (ValueError, TypeError, RuntimeError) as exc:
            raise ValueError(
                f"{_PARAM}: llguidance cannot read the model's tokenizer "
                f"({type(exc).__name__}: {exc}); it needs a fast (tokenizer.json) tokenizer"
            ) from None
        self._executor = llg.LLExecutor()
        self._llg = llg
