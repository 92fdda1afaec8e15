"""``format`` "date", "date-time" and "time" constrain to days and times that exist, on both
grammar backends: the patterns they are compiled as against jsonschema's format checker,
the schemas rewritten (and those left alone), and each backend's matcher taking or refusing
a value as the checker does."""

from __future__ import annotations

import datetime
import json
import re

import pytest
from jsonschema import Draft202012Validator

from tests.tiny_models import save_tiny_tokenizer
from tokenmill.engine.date_format import (
    DATE_PATTERN,
    DATE_TIME_PATTERN,
    TIME_PATTERN,
    with_date_patterns,
)
from tokenmill.engine.grammar_llguidance import LlguidanceGrammars
from tokenmill.engine.grammar_xgrammar import XgrammarGrammars
from tokenmill.engine.structured_output_params import REJECTED, STOPPED


def _exists(text: str) -> bool:
    try:
        datetime.date.fromisoformat(text)  # (jsonschema's "date" check)
    except ValueError:
        return False
    return len(text) == 10


def test_the_pattern_takes_exactly_the_days_that_exist() -> None:
    pattern = re.compile(DATE_PATTERN)
    # every year's February 28-30, and every month and day 00-32 of years that differ
    texts = [f"{y:04d}-02-{d:02d}" for y in range(10_000) for d in (28, 29, 30)]
    for y in (0, 1, 4, 99, 100, 400, 1600, 1900, 2000, 2023, 2024, 2100, 9996, 9999):
        texts += [f"{y:04d}-{m:02d}-{d:02d}" for m in range(14) for d in range(33)]
    wrong = [t for t in texts if bool(pattern.fullmatch(t)) != _exists(t)]
    assert not wrong, wrong[:10]
    assert sum(map(_exists, texts)) > 10_000  # both kinds were tried


CHECKER = Draft202012Validator.FORMAT_CHECKER  # (a bare FormatChecker() has draft 3's "time")


def test_the_clock_patterns_take_exactly_what_jsonschema_takes() -> None:
    """date-time and time against jsonschema's own checks (rfc3339_validator), upper case
    (the case the patterns write): hours, minutes, seconds at and past their ends, the
    fraction, offsets, and a date-time's day."""
    assert CHECKER.conforms("1970-01-01T00:00:60Z", "date-time") is False  # (checked at all)
    clocks = [f"{h:02d}:{m:02d}:{s:02d}" for h in (0, 9, 19, 23, 24, 25, 30)
              for m in (0, 59, 60, 99) for s in (0, 59, 60, 61)]  # fmt: skip
    clocks += ["1:00:00", "00:0:00", "000:00:00"]
    ends = ["Z", "+00:00", "-23:59", "+24:00", "+05:60", "+5:30", "-0530", "", "z0", "+05:30Z"]
    times = [c + f + e for c in clocks for f in ("", ".5", ".123456789", ".") for e in ends]
    days = ["2024-02-29", "2023-02-29", "2024-04-31", "0000-01-01", "9999-12-31", "2024-1-01"]
    cases = [(t, TIME_PATTERN, "time") for t in times] + [
        (f"{d}T{t}", DATE_TIME_PATTERN, "date-time") for d in days for t in times[::7]
    ]  # fmt: skip
    wrong = [(text, fmt) for text, pattern, fmt in cases
             if bool(re.fullmatch(pattern, text)) != CHECKER.conforms(text, fmt)]  # fmt: skip
    assert not wrong, wrong[:10]
    assert 150 < sum(CHECKER.conforms(t, f) for t, _, f in cases) < len(cases) - 1_000  # both


def test_date_subschemas_are_rewritten_and_others_left_alone() -> None:
    plain = json.dumps({"type": "object", "properties": {"d": {"type": "string"}}})
    assert with_date_patterns(plain) == plain
    own = json.dumps({"type": "string", "format": "date", "pattern": "^2024-"})
    assert with_date_patterns(own) == own  # two patterns cannot be one
    named = json.dumps({"type": "object", "properties": {"date": {"const": "date"}},
                        "enum": [{"format": "date"}]})  # fmt: skip
    assert with_date_patterns(named) == named  # a name and values, not subschemas
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string", "format": "date"},
                       "b": {"type": "array", "items": {"format": "date", "type": "string"}},
                       "c": {"anyOf": [{"$ref": "#/$defs/d"}, {"type": "null"}]}},
        "$defs": {"d": {"type": "string", "format": "date", "description": "a day"}},
    }  # fmt: skip
    got = json.loads(with_date_patterns(json.dumps(schema)))
    for node in (got["properties"]["a"], got["properties"]["b"]["items"], got["$defs"]["d"]):
        assert node["pattern"] == DATE_PATTERN and "format" not in node
    assert got["$defs"]["d"]["description"] == "a day"
    clock = {"type": "array", "prefixItems": [{"type": "string", "format": "date-time"},
                                              {"type": "string", "format": "time"},
                                              {"type": "string", "format": "email"}]}  # fmt: skip
    got = json.loads(with_date_patterns(json.dumps(clock)))["prefixItems"]
    assert [node.get("pattern") for node in got] == [DATE_TIME_PATTERN, TIME_PATTERN, None]
    assert got[2]["format"] == "email"
    odd = json.dumps({"type": "string", "format": ["date"], "description": "time"})
    assert with_date_patterns(odd) == odd  # a format that is not a string is not one of them


DATES = ["2024-02-29", "2000-02-29", "2024-04-30", "2024-12-31", "0001-01-01", "2024-02-30",
         "2023-02-29", "1900-02-29", "2024-04-31", "2024-13-01", "0000-01-01"]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return save_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "t")


@pytest.mark.parametrize("backend", [LlguidanceGrammars, XgrammarGrammars])
def test_each_backend_writes_only_days_that_exist(tokenizer, backend) -> None:
    """xgrammar took 2024-04-31 and 2024-02-30, llguidance 2023-02-29 and 1900-02-29."""
    grammars = backend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    day_schema = {"type": "string", "format": "date"}
    spec = json.dumps({"type": "object", "properties": {"d": day_schema}, "required": ["d"],
                       "additionalProperties": False}, separators=(",", ":"))  # fmt: skip
    taken = {}
    for day in DATES:
        row = grammars.matcher(spec)
        tokens = tokenizer.encode(f'{{"d":"{day}"}}', add_special_tokens=False)
        status = [grammars.consume([row], [t])[0] for t in tokens]
        taken[day] = REJECTED not in status and status[-1] == STOPPED
    assert taken == {day: _exists(day) for day in DATES}


CLOCK_VALUES = [("date-time", "2024-02-29T23:59:59Z"), ("date-time", "2024-02-29T23:59:60Z"),
                ("date-time", "2023-02-29T12:00:00Z"), ("date-time", "2024-04-31T12:00:00Z"),
                ("date-time", "2024-01-01T24:00:00+01:00"),
                ("date-time", "2024-01-01T08:30:00.25-05:30"),
                ("time", "23:59:59.5Z"), ("time", "12:00:60Z"), ("time", "12:00:00+24:00"),
                ("time", "12:00:00"), ("time", "07:52:1315Z"), ("time", "07:52:13.15Z"),
                ("date-time", "2024-02-29T16:33:336-06:00")]  # fmt: skip


@pytest.mark.parametrize("backend", [LlguidanceGrammars, XgrammarGrammars])
def test_each_backend_writes_only_clock_values_that_exist(tokenizer, backend) -> None:
    """Both took a second :60; xgrammar 2024-04-31, llguidance 2023-02-29 in a date-time."""
    grammars = backend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    taken, expected = {}, {}
    for fmt, value in CLOCK_VALUES:
        spec = json.dumps({"type": "string", "format": fmt})
        row = grammars.matcher(spec)
        tokens = tokenizer.encode(json.dumps(value), add_special_tokens=False)
        status = [grammars.consume([row], [t])[0] for t in tokens]
        taken[value] = REJECTED not in status and status[-1] == STOPPED
        expected[value] = CHECKER.conforms(value, fmt)
    assert taken == expected
