"""What xgrammar (0.2.9) lets through that a constraint forbids, and how the xgrammar
backend keeps it out.

Found by checking its outputs against the schema (jsonschema) and against llguidance's:

- Tokens. A JSON string with ``maxLength`` compiles to ``[^"\\\\\\r\\n]{0,n}``, so a raw tab
  or NUL gets in (compact JSON holds control characters only escaped); special tokens
  (``<|im_start|>``) are allowed inside strings, and the text then loses them; a token
  holding half of a UTF-16 surrogate pair encoded as UTF-8 (``ED A0``-``ED BF``: never valid
  UTF-8) gets into strings. ``token_masks`` gives the masks every row's is ANDed with.
- Schemas. Some keywords compile but are not enforced (``allOf`` wrote ``null``,
  ``multipleOf: 0.5`` wrote 1.125764, ``required`` without ``properties`` wrote ``{}``,
  ``format`` or ``pattern`` with ``maxLength`` wrote longer strings (a ``pattern`` with
  ``minLength`` shorter ones), ``format`` or ``pattern`` without a ``type`` was no
  constraint at all), others are not verified.
  ``check_schema`` refuses a schema holding one, naming it, so a row is an error at once
  instead of an output that does not follow its schema; llguidance (the default backend)
  runs them. A property whose schema is ``false`` (the key forbidden) failed to compile
  ("Schema 'false' cannot accept any value"): on an object whose ``additionalProperties``
  is false the key is left out of ``properties``, which forbids it the same; elsewhere it is
  refused, naming its path (``xgrammar_false_properties``).
- Regexes. POSIX classes (``[[:digit:]]``), escapes of letters it does not know (``\\A``,
  ``\\z``), class set operations and nested classes are read as something else: refused;
  its ``.`` takes a newline, which the documented syntax's does not: written ``[^\\n]``
  (``xgrammar_regex``). In a JSON schema's ``pattern`` an optional group whose end repeats
  lost its first character (``^a(?:-[0-9]+)?$`` took "a12"): every ``(...)?`` is written
  ``(...){0,1}``, which it reads right. Schema patterns go through the same checks
  (``xgrammar_schema_patterns``).
- Formats. ``format: ipv4`` took octets with leading zeros ("48.050.181.041", which
  jsonschema's checker and RFC 2673's dotted quad refuse: read as octal by some parsers) and
  ``format: hostname`` a 64-character label (RFC 1123 allows 63): each such subschema without
  a pattern of its own gets the format's pattern instead (``xgrammar_format_patterns``), as
  date_format.py does for dates on both libraries. Its ``ipv6`` took a leading zero in an
  embedded IPv4 part ("::ffff:192.168.01.1"): given RFC 3986's pattern the same way.

A surrogate split across two tokens (``...ED`` then ``A0...``) cannot be masked ahead;
``surrogate_edges`` lets the backend reject the second token (the request ends "error").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

# Keywords xgrammar compiles without enforcing them, or not verified to be enforced.
UNENFORCED = frozenset(
    {
        "allOf", "multipleOf", "uniqueItems", "not", "if", "then", "else", "contains",
        "minContains", "maxContains", "dependentRequired", "dependentSchemas",
        "unevaluatedProperties", "unevaluatedItems", "propertyNames",
    }
)  # fmt: skip
_LENGTHS = frozenset({"minLength", "maxLength"})


def token_masks(
    vocab: Sequence[bytes], vocab_size: int, stop_ids: Sequence[int], special_ids: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """([words] int32 for JSON rows, [words] int32 for regex and choice rows): bit t set
    unless token t is special (stop tokens excepted) or holds a surrogate half, and for JSON
    rows a byte below 0x20. Ids past the tokenizer's vocabulary stay set (no grammar allows
    them anyway)."""
    text = np.ones(-(-vocab_size // 32) * 32, dtype=np.uint8)
    json_ok = text.copy()
    for token, raw in enumerate(vocab[:vocab_size]):
        if _holds_surrogate(raw):
            text[token] = json_ok[token] = 0
        elif min(raw, default=32) < 32:
            json_ok[token] = 0
    special = [t for t in special_ids if t < vocab_size]
    text[special] = json_ok[special] = 0
    stops = [t for t in stop_ids if t < len(text)]
    text[stops] = json_ok[stops] = 1
    pack = lambda bits: np.packbits(bits, bitorder="little").view(np.int32)  # noqa: E731
    return pack(json_ok), pack(text)


def surrogate_edges(vocab: Sequence[bytes], vocab_size: int) -> tuple[bytes, bytes]:
    """(byte t is 1 when token t ends with 0xED, byte t is 1 when token t starts with a byte
    in A0-BF): the two halves of a surrogate written across two tokens."""
    ends = bytearray(vocab_size)
    starts = bytearray(vocab_size)
    for token, raw in enumerate(vocab[:vocab_size]):
        ends[token] = raw.endswith(b"\xed")
        starts[token] = bool(raw) and 0xA0 <= raw[0] <= 0xBF
    return bytes(ends), bytes(starts)


def _holds_surrogate(raw: bytes) -> bool:
    at = raw.find(b"\xed")
    while at != -1 and at + 1 < len(raw):
        if 0xA0 <= raw[at + 1] <= 0xBF:
            return True
        at = raw.find(b"\xed", at + 1)
    return False


def check_schema(schema_text: str) -> None:
    """Raise ValueError naming the first keyword of the schema xgrammar would not enforce."""
    for where, node in subschemas(json.loads(schema_text), "schema"):
        found = sorted(UNENFORCED & set(node))
        if found:
            raise ValueError(f"{where} uses {found[0]!r}, which xgrammar does not enforce")
        untyped = [k for k in ("format", "pattern") if k in node and "type" not in node]
        if untyped:  # ({"items": {"pattern": "^a$"}} wrote ["b"])
            raise ValueError(f"{where} has {untyped[0]!r} without 'type', which xgrammar ignores")
        if "format" in node and _LENGTHS & set(node):
            raise ValueError(
                f"{where} has 'format' with a length bound, which xgrammar does not enforce"
            )
        if "pattern" in node and _LENGTHS & set(node):  # ("^a+$" with maxLength 3 wrote "aaaa")
            raise ValueError(
                f"{where} has 'pattern' with a length bound, which xgrammar does not enforce "
                "(write the bound into the pattern: ^a{1,3}$ for ^a+$ with maxLength 3)"
            )
        required, properties = node.get("required"), node.get("properties")
        if isinstance(required, list) and required:
            missing = [
                r for r in required if not isinstance(properties, dict) or r not in properties
            ]
            if missing:
                raise ValueError(
                    f"{where} requires {missing[0]!r} without listing it in 'properties', "
                    "which xgrammar does not enforce"
                )


def xgrammar_false_properties(schema_text: str) -> str:
    """``schema_text`` with each property whose schema is ``false`` left out of its
    object's ``properties`` where ``additionalProperties`` is false (and no
    ``patternProperties`` could take the key back): the key is forbidden either way, and
    xgrammar compiles no ``false``. Raises ValueError naming the property's path where the
    object takes keys it does not list (leaving it out would let it in) or ``required``
    names it (no object matches)."""
    if "false" not in schema_text:
        return schema_text

    def rewrite(where: str, node: dict[str, Any]) -> bool:
        properties = node.get("properties")
        if not isinstance(properties, dict):
            return False
        banned = [name for name, sub in properties.items() if sub is False]
        for name in banned:
            path = f"{where}.properties.{name}"
            required = node.get("required")
            if isinstance(required, list) and name in required:
                raise ValueError(
                    f"{path} is false (the key is forbidden) but {where}.required names "
                    f"{name!r}: no object can match; drop one of them"
                )
            if node.get("additionalProperties") is not False or "patternProperties" in node:
                raise ValueError(
                    f"{path} is false (the key is forbidden), which xgrammar keeps out only "
                    f"of an object taking no other keys: set {where}.additionalProperties "
                    "to false (without patternProperties; the key is then left out), or use "
                    "structured_output_backend llguidance"
                )
        if not banned:
            return False
        node["properties"] = {k: v for k, v in properties.items() if k not in banned}
        return True

    return edit_subschemas(schema_text, rewrite)


# Escapes of a letter xgrammar knows; any other letter it matches as itself (\\A as "A").
_ESCAPED_LETTERS = frozenset("dDwWsSntrfvxu")


def xgrammar_regex(pattern: str) -> str:
    """``pattern`` (the documented regex syntax, Rust's) as xgrammar must read it to mean
    the same: a ``.`` outside a class is ``[^\\n]`` (xgrammar's ``.`` takes a newline too).
    Raises ValueError for what xgrammar reads as something else: POSIX classes, escapes of
    a letter it does not know (``\\A``, ``\\z``: matched as the letter), class set
    operations (``&&``, ``--``, ``~~``) and classes inside classes (read as literals)."""
    if "[[:" in pattern or "[^[:" in pattern:
        raise ValueError("the regex uses a POSIX class ([[:digit:]]), which xgrammar misreads")
    out: list[str] = []
    i, n, in_class = 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            e = pattern[i + 1]
            if e.isascii() and e.isalpha() and e not in _ESCAPED_LETTERS:
                raise ValueError(
                    f"the regex uses \\{e}, which xgrammar does not support (it matches some "
                    "such escapes as the plain letter)"
                )
            out.append(pattern[i : i + 2])
            i += 2
            continue
        if in_class:
            if pattern.startswith(("&&", "--", "~~"), i):
                raise ValueError(
                    f"the regex uses {pattern[i : i + 2]!r} in a class (a set operation), "
                    "which xgrammar reads as literal characters"
                )
            if c == "[":
                raise ValueError(
                    "the regex has a class inside a class, which xgrammar reads as literal "
                    "characters"
                )
            in_class = c != "]"
            out.append(c)
            i += 1
            continue
        if c == ")" and pattern.startswith("?", i + 1):  # (lazy or not: one full match)
            out.append("){0,1}")
            i += 3 if pattern.startswith("??", i + 1) else 2
            continue
        if c == "[":  # a leading ^ and a leading ] belong to the class
            end = i + 1 + (pattern.startswith("^", i + 1))
            end += pattern.startswith("]", end)
            out.append(pattern[i:end])
            i, in_class = end, True
            continue
        out.append("[^\\n]" if c == "." else c)
        i += 1
    return "".join(out)


_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9][0-9]|[0-9])"  # 0-255, no leading zero
# A label: 1-63 letters, digits and hyphens, a letter or digit at each end. No optional
# group: xgrammar misread some (see Regexes above).
_LABEL = "(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]{0,61}[A-Za-z0-9])"
_IPV4 = f"(?:{_OCTET}\\.){{3}}{_OCTET}"
IPV4_PATTERN = f"^{_IPV4}$"
HOSTNAME_PATTERN = f"^{_LABEL}(?:\\.{_LABEL})*$"


def _ipv6_pattern() -> str:
    """RFC 3986's IPv6address, its dotted quad without leading zeros (as IPV4_PATTERN):
    eight 16-bit groups, or fewer around one "::", the last two of them as a dotted quad or
    not. An optional part is written {0,1} (xgrammar misread some "?"s)."""
    h16 = "[0-9A-Fa-f]{1,4}"
    ls32 = f"(?:{h16}:{h16}|{_IPV4})"  # the last 32 bits
    # after "::": 5 groups and ls32, 4 and ls32, ... ls32, one group, nothing
    tails = [f"(?:{h16}:){{{n}}}{ls32}" for n in (5, 4, 3, 2)] + [f"{h16}:{ls32}", ls32, h16, ""]
    forms = [f"(?:{h16}:){{6}}{ls32}", f"::{tails[0]}"]
    # before "::", at most k + 1 groups where k + 2 groups follow it (8 - 1 in all)
    forms += [f"(?:(?:{h16}:){{0,{k}}}{h16}){{0,1}}::{tail}" for k, tail in enumerate(tails[1:])]
    return "^(?:" + "|".join(forms) + ")$"


IPV6_PATTERN = _ipv6_pattern()
_FORMAT_PATTERNS = {"ipv4": IPV4_PATTERN, "ipv6": IPV6_PATTERN, "hostname": HOSTNAME_PATTERN}


def xgrammar_format_patterns(schema_text: str) -> str:
    """``schema_text`` with each ``format`` xgrammar lets too much through (ipv4, ipv6,
    hostname) given its pattern instead, where the subschema has no ``pattern`` of its own
    (two patterns cannot be one); the text itself when it has none."""
    if not any(f'"{fmt}"' in schema_text for fmt in _FORMAT_PATTERNS):
        return schema_text
    return formats_as_patterns(schema_text, _FORMAT_PATTERNS)


def formats_as_patterns(schema_text: str, patterns: Mapping[str, str]) -> str:
    """``schema_text`` with each subschema whose ``format`` is a key of ``patterns`` given
    that pattern instead, unless it has a ``pattern`` of its own (two cannot be one)."""

    def rewrite(where: str, node: dict[str, Any]) -> bool:
        fmt = node.get("format")
        pattern = patterns.get(fmt) if isinstance(fmt, str) else None
        if pattern is None or "pattern" in node:
            return False
        del node["format"]
        node["pattern"] = pattern
        return True

    return edit_subschemas(schema_text, rewrite)


def xgrammar_schema_patterns(schema_text: str) -> str:
    """``schema_text`` with each subschema's ``pattern`` as xgrammar must read it
    (``xgrammar_regex``); the text itself when it has none. Raises ValueError naming the
    subschema whose pattern xgrammar would misread."""
    if '"pattern"' not in schema_text:
        return schema_text

    def rewrite(where: str, node: dict[str, Any]) -> bool:
        pattern = node.get("pattern")
        if not isinstance(pattern, str):
            return False
        try:
            rewritten = xgrammar_regex(pattern)
        except ValueError as exc:
            raise ValueError(f"{where}.pattern: {exc}") from None
        node["pattern"] = rewritten
        return rewritten != pattern

    return edit_subschemas(schema_text, rewrite)


def edit_subschemas(schema_text: str, edit: Callable[[str, dict[str, Any]], bool]) -> str:
    """``schema_text`` after ``edit(where, node)`` on each of its subschemas (``subschemas``:
    each before its keys are read), compact; the text itself where no edit said it changed
    its node."""
    schema = json.loads(schema_text)
    changed = False
    for where, node in subschemas(schema, "schema"):
        changed |= edit(where, node)
    if not changed:
        return schema_text
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def subschemas(node: Any, where: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every subschema of ``node`` (itself included), with its JSON path."""
    if isinstance(node, list):
        for i, value in enumerate(node):
            yield from subschemas(value, f"{where}[{i}]")
    if not isinstance(node, dict):
        return
    yield where, node
    for key, value in node.items():
        if key in _NAMED and isinstance(value, dict):  # name -> subschema
            for name, sub in value.items():
                yield from subschemas(sub, f"{where}.{key}.{name}")
        elif key not in _VALUES:
            yield from subschemas(value, f"{where}.{key}")


_NAMED = ("properties", "patternProperties", "$defs", "definitions")
_VALUES = ("const", "enum", "default", "examples", "required")  # values, not schemas
