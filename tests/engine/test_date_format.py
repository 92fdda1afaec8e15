"""``format: "date"`` constrains to days that exist, on both grammar backends: the pattern
it is compiled as against Python's calendar, the schemas rewritten (and those left alone),
and each backend's matcher taking or refusing a date as jsonschema's format checker does."""

from __future__ import annotations

import datetime
import json
import re

import pytest

from tests.tiny_models import save_tiny_tokenizer
from tokenmill.engine.date_format import DATE_PATTERN, with_date_patterns
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
