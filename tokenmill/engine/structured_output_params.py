"""What a structured-output constraint is: its kinds, canonical text, checks and grammar.

A request's ``SamplingParams.structured_output`` holds one canonical string, whatever form
the user gave. A string keeps the value hashable (the engine caches one compiled matcher per
distinct value), cheap to ship to Ray workers, and stable in a job's fingerprint:

    kind          the user gives                                 canonical text
    json schema   a dict, a JSON string, StructuredOutputsParams(json=...)   '{"type":...}'
    json_object   "json_object", StructuredOutputsParams(json_object=True)   'json_object'
    regex         "regex:<pattern>", StructuredOutputsParams(regex=...)      'regex:<pattern>'
    choice        "choice:<JSON list>", StructuredOutputsParams(choice=[...])
                                                             'choice:["yes","no"]'

JSON schema text always starts with ``{``, so the ``regex:`` and ``choice:`` prefixes never
collide with it. Job files and per-row input columns (and SamplingParams too) also take a
one-key mapping (``{json_schema: ...}``, ``{regex: ...}``, ``{choice: [...]}``), read by
``structured_output_setting``: none of the three is a JSON Schema keyword, so no schema is
mistaken for one. llguidance (``pip install llguidance``) compiles the text into
a grammar (``grammar_text``); it is imported only when a constraint is given.

A regex uses the Rust ``regex`` crate's syntax (Python's ``re`` syntax less look-around and
backreferences) and must match the whole output; a choice is one of the listed strings
exactly. Both end the row ("stop") as soon as nothing but EOS can follow.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from tokenmill.engine.date_format import with_date_patterns
from tokenmill.engine.llguidance_limits import check_llguidance_schema

__all__ = [
    "CHOICE_PREFIX",
    "DROPPED",
    "JSON_OBJECT",
    "REGEX_PREFIX",
    "REJECTED",
    "STOPPED",
    "TAKEN",
    "GuidedDecodingParams",
    "StructuredOutputsParams",
    "check_structured_output",
    "describe",
    "grammar_error",
    "grammar_text",
    "load_llguidance",
    "params_of_fields",
    "require_tokenizer",
    "structured_output_setting",
]

JSON_OBJECT = "json_object"  # any JSON object (OpenAI's response_format json_object)
REGEX_PREFIX = "regex:"
CHOICE_PREFIX = "choice:"
# What a grammar backend's ``consume`` says of each row's token (uint8, one per row):
TAKEN = 0  # accepted; the output goes on
STOPPED = 1  # accepted, and the output is complete: nothing but EOS may follow
REJECTED = 2  # not allowed here: the matcher is in its error state (``error`` says why)
# not allowed where its mask was left open (grammar_drafts.py): not taken, the matcher as it
# was; the engine drops the token and computes the position again under a mask
DROPPED = 3
SETTING_KEYS = ("json_schema", "regex", "choice")  # the one-key mapping form's keys
# StructuredOutputsParams' fields (vLLM's too): a dict of only these is not a schema
_PARAMS_FIELDS = frozenset(
    ("json", "regex", "choice", "json_object", "grammar", "structural_tag", "backend",
     "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
)  # fmt: skip
_ANY_OBJECT_SCHEMA = '{"type":"object"}'
_COMPILE_DEFAULTS = {"whitespace_flexible": False}
_PARAM = "SamplingParams.structured_output"
_EXPECTED_SETTING = (
    "expected json_object or a mapping with one key: {json_schema: <JSON Schema>}, "
    "{regex: <pattern>} or {choice: [<string>, ...]}"
)


def load_llguidance() -> Any:
    """The llguidance module. Raises ImportError saying how to install it."""
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401  (the bitmask helpers)
    except ImportError as exc:
        raise ImportError(
            "structured output (SamplingParams.structured_output, sampling.structured_output "
            "in job.yaml, a per-row structured_output column, response_format in OpenAI "
            "Batch bodies) needs the llguidance package: pip install llguidance"
        ) from exc
    return llguidance


def require_tokenizer(tokenizer: Any) -> None:
    """Raise ValueError when the engine has no tokenizer to build a grammar backend on."""
    if tokenizer is None:
        raise ValueError(
            f"{_PARAM} needs the model's tokenizer; this engine has none (load_format='random')"
        )


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's ``StructuredOutputsParams`` / ``GuidedDecodingParams`` shape: set exactly one.

    ``json``: a JSON schema (a dict or a JSON string); ``regex``: a pattern the whole output
    must match; ``choice``: the strings the output must be one of; ``json_object``: any JSON
    object. ``SamplingParams(structured_output=...)`` takes it and keeps its canonical text
    (``canonical``). Raises ValueError when none or several are set.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    json_object: bool = False
    grammar: str | None = None  # vLLM's; refused: no grammar language is taken here

    def __post_init__(self) -> None:
        if self.grammar is not None:
            raise ValueError(
                "StructuredOutputsParams(grammar=...) is not supported: tokenmill takes a JSON "
                "schema (json=), a regex (regex=), a list of choices (choice=) or any JSON "
                "object (json_object=True)"
            )
        given = [
            name
            for name, value in (("json", self.json), ("regex", self.regex), ("choice", self.choice))
            if value is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputsParams takes exactly one of json, regex, choice, json_object; "
                f"got {', '.join(given) if given else 'none'}"
            )
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))

    def canonical(self, name: str = _PARAM) -> str:
        """The canonical text (see the module docstring); ValueError naming ``name``."""
        if self.json_object:
            return JSON_OBJECT
        if self.regex is not None:
            return _check_regex(self.regex, f"{name}.regex")
        if self.choice is not None:
            return _check_choice(self.choice, f"{name}.choice")
        return _check_schema(self.json, name)


GuidedDecodingParams = StructuredOutputsParams  # vLLM's name before 0.10.2


def params_of_fields(value: Any) -> Any:
    """``value`` built into StructuredOutputsParams where it is a mapping of only the
    class's own fields (``{"json": schema}``, as Ray Data LLM rows carry it: a column
    cannot hold the object); anything else as it is. A mapping naming vLLM's other fields
    (``backend``) stays a mapping, which ``check_structured_output`` refuses by name."""
    own = {f.name for f in fields(StructuredOutputsParams)}
    if isinstance(value, dict) and value and set(value) <= own:
        return StructuredOutputsParams(**value)
    return value


def check_structured_output(value: Any, name: str = _PARAM) -> str | None:
    """Validate a ``structured_output`` value; return its canonical text (or None).

    Takes None, a JSON schema (a dict, or its JSON text), ``"json_object"``,
    ``"regex:<pattern>"``, ``"choice:<JSON list of strings>"``, a
    ``StructuredOutputsParams``, or a job file's one-key mapping (``{"regex": ...}``; see
    ``structured_output_setting``). Raises ValueError naming ``name`` when the value is none of
    these or llguidance cannot compile it (a bad regex, an empty choice list, an unusable
    schema), and ImportError when llguidance is not installed.
    """
    if value is None:
        return None
    if isinstance(value, StructuredOutputsParams):
        return value.canonical(name)
    if isinstance(value, dict) and len(value) == 1 and next(iter(value)) in SETTING_KEYS:
        return structured_output_setting(value, name)  # no JSON Schema is just that key
    if isinstance(value, dict) and value and set(map(str, value)) <= _PARAMS_FIELDS:
        # {"json": schema} read as a schema would constrain nothing (its one key unknown)
        raise ValueError(
            f"{name}: a mapping with keys {_short(sorted(map(str, value)))} is "
            "StructuredOutputsParams' fields, not a JSON schema; pass "
            "StructuredOutputsParams(json=<schema>) (or regex=, choice=, json_object=True), "
            "or the schema itself"
        )
    if isinstance(value, str):
        if value.startswith(REGEX_PREFIX):
            return _check_regex(value[len(REGEX_PREFIX) :], name)
        if value.startswith(CHOICE_PREFIX):
            return _check_choice_text(value[len(CHOICE_PREFIX) :], name)
    if isinstance(value, (str, dict)):
        return _check_schema(value, name)
    raise ValueError(
        f"{name} must be a JSON schema (a dict or a JSON string), {JSON_OBJECT!r}, "
        f"'regex:<pattern>', 'choice:<JSON list>' or a StructuredOutputsParams, "
        f"got {type(value).__name__}"
    )


def structured_output_setting(value: Any, name: str = "") -> str | None:
    """A constraint as job files and per-row input columns give it; its canonical text.

    Takes None, a one-key mapping ``{json_schema: <schema or its JSON>}``, ``{regex: <pattern>}``
    or ``{choice: [<string>, ...]}``, that mapping as JSON text (a Parquet string column), or
    any string ``check_structured_output`` takes (``json_object``, the canonical text).
    Raises ValueError saying what is expected, naming the mapping's key (``regex: ...``),
    after ``name`` when given (the caller may name the place itself).
    """
    where = f"{name}: " if name else ""
    if value is None:
        return None
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = None  # check_structured_output says what is wrong with it
        if isinstance(parsed, dict) and len(parsed) == 1 and next(iter(parsed)) in SETTING_KEYS:
            value = parsed
    if isinstance(value, dict):
        keys = sorted(map(str, value))
        if len(keys) != 1 or keys[0] not in SETTING_KEYS:
            raise ValueError(f"{where}{_EXPECTED_SETTING}; got a mapping with keys {_short(keys)}")
        key, inner = keys[0], next(iter(value.values()))
        if key == "json_schema":
            if not isinstance(inner, (dict, str)):
                raise ValueError(
                    f"{where}json_schema must be a JSON Schema (a mapping), got {_short(inner)}"
                )
            return _check_schema(inner, f"{where}json_schema")
        if key == "regex":
            return _check_regex(inner, f"{where}regex")
        return _check_choice(inner, f"{where}choice")
    if not isinstance(value, str):
        raise ValueError(f"{where}{_EXPECTED_SETTING}; got {_short(value)}")
    return check_structured_output(value, f"{where}structured_output")


def describe(canonical: str) -> str:
    """A short name for error messages: "JSON schema", "regex", "choice list"."""
    if canonical.startswith(REGEX_PREFIX):
        return "regex"
    if canonical.startswith(CHOICE_PREFIX):
        return "choice list"
    return "JSON schema"


@functools.lru_cache(maxsize=512)
def grammar_text(canonical: str) -> str:
    """llguidance's grammar for a canonical ``structured_output`` value.

    A choice becomes a Lark rule ``start: "a" | "b"`` (string literals with JSON escapes);
    a regex, llguidance's whole-output regex grammar.
    """
    llg = load_llguidance()
    if canonical.startswith(REGEX_PREFIX):
        return llg.LLMatcher.grammar_from_regex(canonical[len(REGEX_PREFIX) :])
    if canonical.startswith(CHOICE_PREFIX):
        choices = json.loads(canonical[len(CHOICE_PREFIX) :])
        rule = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        return llg.LLMatcher.grammar_from_lark(f"start: {rule}")
    schema = _ANY_OBJECT_SCHEMA if canonical == JSON_OBJECT else with_date_patterns(canonical)
    return llg.LLMatcher.grammar_from_json_schema(schema, defaults=_COMPILE_DEFAULTS)


def grammar_error(message: str) -> str:
    """llguidance's error, shortened to what a user can act on (its "error: ..." line when it
    has one, e.g. "unclosed group"; else the first line), at most 300 characters."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    found = next((line for line in lines if line.startswith("error:")), None)
    if found is not None:
        return found[len("error:") :].strip()[:300]
    return (lines[0] if lines else message)[:300]


def _check_schema(value: Any, name: str) -> str:
    if isinstance(value, str):
        return _check_text(value, name)
    if not isinstance(value, dict):
        raise ValueError(
            f"{name} must be a JSON schema (a dict or a JSON string), got {type(value).__name__}"
        )
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: the schema is not JSON-serializable ({exc})") from None
    return _check_text(text, name)


def _check_regex(pattern: Any, name: str) -> str:
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(
            f"{name} must be a non-empty regular expression (a string), got {_short(pattern)}"
        )
    return _validated(REGEX_PREFIX + pattern, name)


def _check_choice(choices: Any, name: str) -> str:
    if isinstance(choices, str) or not isinstance(choices, Sequence):
        raise ValueError(f"{name} must be a list of strings, got {_short(choices)}")
    if not choices:
        raise ValueError(f"{name} must list at least one string; the list is empty")
    bad = next((c for c in choices if not isinstance(c, str)), None)
    if bad is not None:
        raise ValueError(f"{name} must hold strings only, got {_short(bad)} in it")
    return _validated(
        CHOICE_PREFIX + json.dumps(list(choices), separators=(",", ":"), ensure_ascii=False),
        name,
    )


def _check_choice_text(text: str, name: str) -> str:
    try:
        choices = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f'{name}: after \'choice:\' comes a JSON list of strings, e.g. choice:["yes","no"] '
            f"(not JSON: {exc.msg} at position {exc.pos})"
        ) from None
    if not isinstance(choices, list):
        raise ValueError(f"{name}: after 'choice:' comes a JSON list of strings, got {text[:80]}")
    return _check_choice(choices, name)


@functools.lru_cache(maxsize=512)
def _check_text(text: str, name: str) -> str:
    """Canonical text of a JSON-string value, its grammar compiled and validated (cached:
    a batch job's rows usually share one schema)."""
    if text == JSON_OBJECT:
        return _validated(text, name)
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{name} must be {JSON_OBJECT!r}, 'regex:<pattern>', 'choice:<JSON list>' or a "
            f"JSON schema; this string is none of them (not JSON: {exc.msg} at position "
            f"{exc.pos})"
        ) from None
    if not isinstance(schema, dict):
        raise ValueError(
            f'{name} must be a JSON schema object ({{"type": ...}}), got JSON '
            f"{type(schema).__name__}"
        )
    try:
        canonical = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError as exc:  # NaN or Infinity, which JSON itself does not have
        raise ValueError(f"{name}: the schema is not valid JSON ({exc})") from None
    try:  # what llguidance compiles but would not enforce
        check_llguidance_schema(canonical)
    except ValueError as exc:  # (checked whatever the backend: the message names neither)
        raise ValueError(f"{name}: this JSON schema cannot be enforced: {exc}") from None
    return _validated(canonical, name)


@functools.lru_cache(maxsize=512)
def _validated(canonical: str, name: str) -> str:
    """``canonical`` once llguidance accepts its grammar (tokenizer-independent checks);
    ValueError naming ``name`` and the kind otherwise."""
    llg = load_llguidance()
    try:
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar_text(canonical))
    except ValueError as exc:
        is_error, messages = True, [str(exc)]
    if is_error:
        what = describe(canonical)
        if canonical.startswith(REGEX_PREFIX):
            what += f" {_short(canonical[len(REGEX_PREFIX) :])}"
        # (every backend's constraints are checked here, as llguidance reads them: the
        # message names no library, as the user may have chosen xgrammar)
        raise ValueError(f"{name}: cannot compile this {what}: {grammar_error(messages[0])}")
    return canonical


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
