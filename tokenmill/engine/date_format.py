"""``format: "date"`` in a JSON schema, compiled as a pattern of the calendar's real dates.

JSON Schema's "date" is RFC 3339's full-date, a day that exists: jsonschema's format
checker (``date.fromisoformat``) refuses 2024-02-30, 2023-02-29 and 0000-01-01. What the
grammar libraries enforce for it (measured, tests/engine/test_date_format.py):

    xgrammar 0.2.x    any day 01-31 of any month 01-12 (2024-04-31, 2024-02-30 got through)
    llguidance        the month's days, but February 29 of every year (2023-02-29)

So before either compiles a schema, each string subschema whose format is "date" (and that
has no pattern of its own: two patterns cannot be joined into one) gets, in place of the
format, the pattern below: years 0001-9999; a leap year divisible by 4, by 400 at a century.
The schema users give (a job's fingerprint, the validation of its outputs) is unchanged.

    YEAR  [1-9]ddd | 0[1-9]dd | 00[1-9]d | 000[1-9]
    LEAP  dd(0[48] | [2468][048] | [13579][26])        (04, 08, ... 96 of any century)
          (0[48] | [2468][048] | [13579][26])00        (400, 800, ... 9600; not 0000)
    DATE  YEAR-(31-day month)-01..31 | YEAR-(30-day month)-01..30 | YEAR-02-01..28
          | LEAP-02-29
"""

from __future__ import annotations

import json

from tokenmill.engine.xgrammar_limits import subschemas

__all__ = ["DATE_PATTERN", "with_date_patterns"]

_D = "[0-9]"
_YEAR = f"(?:[1-9]{_D}{{3}}|0[1-9]{_D}{{2}}|00[1-9]{_D}|000[1-9])"
_BY_FOUR = "(?:0[48]|[2468][048]|[13579][26])"
_LEAP = f"(?:{_D}{{2}}{_BY_FOUR}|{_BY_FOUR}00)"
_DAY_28 = f"(?:0[1-9]|1{_D}|2[0-8])"
_MONTH_DAY = (
    f"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]{_D}|3[01])"
    f"|(?:0[469]|11)-(?:0[1-9]|[12]{_D}|30)"
    f"|02-{_DAY_28})"
)
DATE_PATTERN = f"^(?:{_YEAR}-{_MONTH_DAY}|{_LEAP}-02-29)$"


def with_date_patterns(schema_text: str) -> str:
    """``schema_text`` with each ``format: "date"`` subschema (no ``pattern`` of its own)
    given ``DATE_PATTERN`` instead; the text itself when it has none."""
    if '"date"' not in schema_text:
        return schema_text
    schema = json.loads(schema_text)
    changed = False
    for _, node in subschemas(schema, "schema"):  # (each yielded before its keys are read)
        if node.get("format") == "date" and "pattern" not in node:
            del node["format"]
            node["pattern"] = DATE_PATTERN
            changed = True
    if not changed:
        return schema_text
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
