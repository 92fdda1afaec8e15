"""JSON Schema's ``format`` "date", "date-time" and "time", compiled as patterns of the
calendar's real days and the clock's real times.

JSON Schema's "date" is RFC 3339's full-date, a day that exists: jsonschema's format
checker (``date.fromisoformat``) refuses 2024-02-30, 2023-02-29 and 0000-01-01; its
"date-time" (``rfc3339_validator``, where installed) a full-date, "T", hours 00-23, minutes
and seconds 00-59 (no leap second), an optional fraction and "Z" or an offset; its "time"
the same without the date. What the grammar libraries enforce (measured,
tests/engine/test_date_format.py):

    xgrammar 0.2.x    any day 01-31 of any month 01-12 (2024-04-31, 2024-02-30 got through)
    llguidance        the month's days, but February 29 of every year (2023-02-29)
    both              a second :60 in a date-time or a time

So before either compiles a schema, each string subschema whose format is one of these
(and that has no pattern of its own: two patterns cannot be joined into one) gets, in place
of the format, the pattern below: years 0001-9999; a leap year divisible by 4, by 400 at a
century. Only the upper-case "T" and "Z" are written (the checker takes either case). The
schema users give (a job's fingerprint, the validation of its outputs) is unchanged.

    YEAR  [1-9]ddd | 0[1-9]dd | 00[1-9]d | 000[1-9]
    LEAP  dd(0[48] | [2468][048] | [13579][26])        (04, 08, ... 96 of any century)
          (0[48] | [2468][048] | [13579][26])00        (400, 800, ... 9600; not 0000)
    DATE  YEAR-(31-day month)-01..31 | YEAR-(30-day month)-01..30 | YEAR-02-01..28
          | LEAP-02-29
    TIME  00..23:00..59:00..59 [.d+] (Z | (+|-)00..23:00..59)
"""

from __future__ import annotations

from tokenmill.engine.xgrammar_limits import formats_as_patterns

__all__ = ["DATE_PATTERN", "DATE_TIME_PATTERN", "TIME_PATTERN", "with_date_patterns"]

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
_DATE = f"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP}-02-29)"
_HOUR_MINUTE = f"(?:[01]{_D}|2[0-3]):[0-5]{_D}"
_ZONE = f"(?:Z|[+-]{_HOUR_MINUTE})"
# The fraction is a branch of its own, not an optional group: xgrammar 0.2's JSON-schema
# patterns drop the first character of an optional group that ends in a repeated class
# ("(?:\\.[0-9]+)?" took 07:52:1315Z).
_TIME = f"{_HOUR_MINUTE}:[0-5]{_D}(?:{_ZONE}|\\.{_D}+{_ZONE})"
DATE_PATTERN = f"^{_DATE}$"
DATE_TIME_PATTERN = f"^{_DATE}T{_TIME}$"
TIME_PATTERN = f"^{_TIME}$"
_PATTERNS = {"date": DATE_PATTERN, "date-time": DATE_TIME_PATTERN, "time": TIME_PATTERN}


def with_date_patterns(schema_text: str) -> str:
    """``schema_text`` with each ``format`` "date", "date-time" or "time" subschema (no
    ``pattern`` of its own) given its pattern instead; the text itself when it has none."""
    if '"date' not in schema_text and '"time"' not in schema_text:
        return schema_text
    return formats_as_patterns(schema_text, _PATTERNS)
