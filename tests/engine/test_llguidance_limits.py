"""What llguidance compiles without enforcing it is refused, naming the keyword
(llguidance_limits.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.structured_output_params import check_structured_output

pytest.importorskip("llguidance")

BIG = 10**20


def _integer(**bounds: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"n": {"type": ["integer", "null"], **bounds}},
        "required": ["n"],
    }


@pytest.mark.parametrize(
    ("bounds", "keyword"),
    [
        # llguidance saturated these to 9223372036854775807 and wrote it, ending "stop"
        ({"minimum": BIG, "maximum": BIG + 5}, "minimum"),
        # 2**53 + 1 rounds to 2**53 as a float: 9007199254740992 got through
        ({"minimum": 2**53 + 1}, "minimum"),
        ({"maximum": -(2**53) - 1}, "maximum"),
        # exclusive of 2**53 took 2**53 itself
        ({"exclusiveMinimum": 2**53}, "exclusiveMinimum"),
        ({"exclusiveMaximum": 1e20}, "exclusiveMaximum"),
    ],
)
def test_a_bound_past_2_53_is_refused_naming_it(bounds: dict[str, Any], keyword: str) -> None:
    with pytest.raises(ValueError, match="SamplingParams.structured_output") as info:
        SamplingParams(structured_output=_integer(**bounds))
    message = str(info.value)
    assert f"schema.properties.n.{keyword} is " in message
    assert "this JSON schema cannot be enforced" in message and "2**53" in message


def test_bounds_up_to_2_53_are_kept() -> None:
    schema = _integer(minimum=-(2**53), maximum=2**53, exclusiveMinimum=-(2**53) + 1)
    assert check_structured_output(schema) is not None
    # a property named like a bound is no bound
    named = {"type": "object", "properties": {"minimum": {"type": "integer"}}}
    assert check_structured_output(named) is not None


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "minProperties": 2},  # both libraries took {"b":2,"b":3}
        {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
        {"type": "object", "patternProperties": {"^x": {}}, "additionalProperties": False,
         "minProperties": 2},  # llguidance took {"x1":1,"x1":2}
        {"type": "object", "properties": {"a": {}}, "required": ["a"], "minProperties": 2},
    ],
)  # fmt: skip
def test_min_properties_a_repeated_key_would_meet_is_refused(schema: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"schema\.minProperties is 2, more than the [01] keys"):
        check_structured_output({"json_schema": schema})


def test_min_properties_the_required_keys_meet_is_kept() -> None:
    required = {"type": "object", "required": ["a", "b"], "minProperties": 2}
    closed = {"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a", "b"],
              "additionalProperties": False, "minProperties": 1}  # fmt: skip
    for schema in (required, closed, {"type": "object", "minProperties": 1}):
        assert check_structured_output({"json_schema": schema}) is not None
