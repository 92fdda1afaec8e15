"""What llguidance (1.9) compiles without enforcing it, refused before a request runs.

Found by checking its outputs against the schema (jsonschema):

- Number bounds past 2**53. llguidance reads ``minimum``, ``maximum``,
  ``exclusiveMinimum`` and ``exclusiveMaximum`` as 64-bit floats and builds its integer
  ranges from them as 64-bit integers: ``{"type": "integer", "minimum": 10**20, "maximum":
  10**20 + 5}`` wrote 9223372036854775807 (the bounds saturated) and ended "stop";
  ``minimum: 9007199254740993`` let 9007199254740992 through (the float rounds down), and
  ``exclusiveMinimum: 9007199254740992`` took 9007199254740992 itself. A float holds every
  integer up to 2**53 exactly, so a bound of at most that magnitude (an exclusive one
  below it) means what it says; a larger one is refused, naming it. Float bounds that large
  on a ``number`` failed to compile anyway ("Failed to generate regex for float range").

- ``minProperties`` past the keys ``required`` names, on an object that takes keys it does
  not list (``additionalProperties`` not false, or ``patternProperties``): neither library
  keeps such a key from repeating, and JSON's last value wins, so ``{"type": "object",
  "minProperties": 2}`` took ``{"b":2,"b":3}``, one property (xgrammar too). The keys
  ``required`` names appear once each, so a bound they meet (or 1) is enforced; another is
  refused, naming it.

Every constraint is checked this way whatever the backend (the reader checks constraints
as llguidance reads them), so xgrammar rows are refused these bounds too.
"""

from __future__ import annotations

import json
from typing import Any

from tokenmill.engine.xgrammar_limits import subschemas

__all__ = ["EXACT_BOUND", "check_llguidance_schema"]

EXACT_BOUND = 2**53  # the largest magnitude below which every integer is a float
_INCLUSIVE = ("minimum", "maximum")
_EXCLUSIVE = ("exclusiveMinimum", "exclusiveMaximum")


def check_llguidance_schema(schema_text: str) -> None:
    """Raise ValueError naming the first subschema keyword llguidance would not enforce."""
    if "imum" not in schema_text and "minProperties" not in schema_text:  # nothing to walk
        return
    for where, node in subschemas(json.loads(schema_text), "schema"):
        _check_min_properties(where, node)
        for key in (*_INCLUSIVE, *_EXCLUSIVE):
            bound = node.get(key)
            if _is_number(bound) and _past_exact(bound, exclusive=key in _EXCLUSIVE):
                raise ValueError(
                    f"{where}.{key} is {bound}, past what a bound read as a float keeps "
                    f"exactly (magnitude at most 2**53 = {EXACT_BOUND}, an exclusive bound "
                    "below it): it would let numbers outside the bound through; use a smaller "
                    "bound, or a string with a pattern for larger numbers"
                )


def _check_min_properties(where: str, node: dict[str, Any]) -> None:
    """Raise ValueError when ``node``'s minProperties counts keys that may repeat."""
    least, required = node.get("minProperties"), node.get("required")
    closed = node.get("additionalProperties") is False and "patternProperties" not in node
    if not _is_number(least) or closed:  # (closed: only listed keys, each at most once)
        return
    names = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
    if least > max(len(names), 1):  # (a repeated key is still one: 1 holds)
        raise ValueError(
            f"{where}.minProperties is {least}, more than the {len(names)} keys 'required' "
            'names: a key the schema does not list may repeat ({"b":2,"b":3} is one '
            "property), so objects with fewer properties would get through; name that many "
            "keys in 'required'"
        )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _past_exact(bound: float, exclusive: bool) -> bool:
    return abs(bound) >= EXACT_BOUND if exclusive else abs(bound) > EXACT_BOUND
