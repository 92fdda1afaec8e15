"""OutputSchema: inferred passthrough types, values that fit or not, the manifest record."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pyarrow as pa
import pytest

from tokenmill.io.logprobs_column import LOGPROBS_FIELD
from tokenmill.io.output_schema import (
    FIXED_COLUMNS,
    OutputSchema,
    inferred_field,
    json_text_field,
)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([1, None, 2], pa.int64()),
        ([None, 1, 2.5], pa.float64()),
        (["a", None], pa.string()),
        ([True, False], pa.bool_()),
        ([["a"], ["b", "c"]], pa.list_(pa.string())),
        ([{"a": 1}, {"b": "x"}], pa.struct([("a", pa.int64()), ("b", pa.string())])),
    ],
)
def test_inferred_types(values: list[Any], expected: pa.DataType) -> None:
    assert inferred_field("c", values) == pa.field("c", expected)


@pytest.mark.parametrize(
    "values",
    [
        [None, None],  # nothing to infer from
        [1, "one"],  # no common type
        [[], []],  # list<null>: a later ["a"] could not be stored
        [{}],  # an empty struct: Parquet cannot store it
        [{"a": None}],  # struct<a: null>
        [10**30],  # beyond int64
        [{"a": 1, "A": 2}],  # duckdb reads meta.A as meta.a's value (renames A to A_1)
        [[{"x": {"k": 1, "K": 2}}]],  # so deeper down
        # Arrow infers double for these (True as 1.0), which a boolean does not fit: the
        # sampled rows holding one would be errors
        [1.5, True],
        [[1.5, False]],
        [{"a": 1.5}, {"a": True}],
    ],
)
def test_columns_without_a_usable_type_are_json_text(values: list[Any]) -> None:
    assert inferred_field("c", values) == json_text_field("c")
    assert OutputSchema.of([inferred_field("c", values)]).is_json_text("c")


@pytest.mark.parametrize(
    ("dtype", "fits", "misfits"),
    [
        (pa.int64(), [3, -(2**63), None], [2.5, True, "3", 2**63, [3]]),
        (pa.float64(), [2.5, 3, float("nan"), 2**53, 10**20], ["x", True, 2**60 + 1, 10**400]),
        (pa.list_(pa.float64()), [[10**20, 1.5]], [[2**60 + 1]]),
        (pa.struct([("x", pa.float64())]), [{"x": -(10**20)}], [{"x": 2**60 + 1}]),
        (pa.string(), ["a", ""], [1, b"a", ["a"]]),
        (pa.bool_(), [True], [1, "true"]),
        (pa.list_(pa.string()), [["a"], []], [[1], "a"]),
        (pa.struct([("a", pa.int64())]), [{"a": 1}, {}], [{"a": 1, "b": 2}, {"a": 1.5}]),
        (pa.int32(), [5], [2**40, 1.5]),
        (pa.binary(), [b"\x00"], ["text"]),
        # the usual open end: in year 10000 in Berlin, which Python's datetime cannot hold
        (
            pa.timestamp("us", "Europe/Berlin"),
            [dt.datetime(9999, 12, 31, 23, 59, 59, tzinfo=dt.timezone.utc)],
            [1],
        ),
    ],
)
def test_values_that_fit_a_column_and_those_that_do_not(
    dtype: pa.DataType, fits: list[Any], misfits: list[Any]
) -> None:
    schema = OutputSchema.of([pa.field("c", dtype)], "inferred from all 3 input rows")
    for value in fits:  # (integers past int64 in a double fit: Arrow refused to write them)
        assert schema.row_problem({"c": value}) is None, value
        schema.column("c", [value, None], ["r", "s"])
    for value in misfits:
        problem = schema.row_problem({"c": value})
        assert problem is not None, value
        assert problem.startswith(f"passthrough column 'c' holds {value!r}"[:40])
        assert str(dtype) in problem and "inferred from all 3 input rows" in problem
        with pytest.raises(ValueError, match="row 'r7': passthrough column 'c'"):
            schema.column("c", [None, value], ["r6", "r7"])


def test_integers_past_int64_are_written_as_the_doubles_they_are() -> None:
    schema = OutputSchema.of([pa.field("c", pa.float64()), pa.field("l", pa.list_(pa.float64()))])
    assert schema.column("c", [1.5, 10**20], ["r", "s"]).to_pylist() == [1.5, 1e20]
    assert schema.column("l", [[-(10**20)]], ["r"]).to_pylist() == [[-1e20]]


def test_json_text_holds_every_value_as_json() -> None:
    schema = OutputSchema.of([json_text_field("c")])
    values = [None, "a", 5, {"k": [1, None]}, b"\xff"]
    assert all(schema.row_problem({"c": v}) is None for v in values)
    cells = schema.column("c", values, ["r"] * 5).to_pylist()
    assert cells == [None, '"a"', "5", '{"k": [1, null]}', '"/w=="']
    # a NaN is JSON's null, so a null cell (it was the text "null", which IS NULL missed)
    nans = schema.column("c", [float("nan"), float("inf"), [float("nan")]], ["r"] * 3)
    assert nans.to_pylist() == [None, None, "[null]"]


def test_skipped_columns_are_not_looked_at() -> None:
    schema = OutputSchema.of([pa.field("c", pa.int64())])
    assert schema.row_problem({"c": "x"}, skip=frozenset({"c"})) is None


def test_a_passthrough_column_may_not_clash_or_repeat() -> None:
    with pytest.raises(ValueError, match="'text' clashes"):
        OutputSchema.of([pa.field("text", pa.string())])
    with pytest.raises(ValueError, match="'c' is named twice"):
        OutputSchema.of([pa.field("c", pa.string()), pa.field("c", pa.int64())])


def test_the_manifest_record_round_trips() -> None:
    schema = OutputSchema.of(
        [pa.field("n", pa.float64()), json_text_field("meta")], "inferred from all 9 input rows"
    )
    record = json.loads(json.dumps(schema.to_record()))
    assert record["passthrough"] == {"n": "double", "meta": "json text"}
    back = OutputSchema.from_record(record)
    assert back == schema and back.schema.names[: len(FIXED_COLUMNS)] == list(FIXED_COLUMNS)
    assert back.is_json_text("meta") and not back.is_json_text("n")
    for bad in (None, {}, {"arrow": "not base64 of a schema"}, {"arrow": 5}):
        with pytest.raises(ValueError, match="output_schema"):
            OutputSchema.from_record(bad)


def test_the_prompt_logprobs_column_sits_before_the_passthrough_columns() -> None:
    plain = OutputSchema.of([pa.field("n", pa.int64())], "inferred from all 2 input rows")
    schema = plain.with_prompt_logprobs()
    assert schema.schema.names == [*FIXED_COLUMNS, "prompt_logprobs", "n"]
    assert schema.has_prompt_logprobs and not plain.has_prompt_logprobs
    assert [f.name for f in schema.passthrough] == ["n"]
    assert schema.describe() == {"n": "int64"} and schema.row_problem({"n": 1}) is None
    assert schema.with_prompt_logprobs() is schema
    back = OutputSchema.from_record(json.loads(json.dumps(schema.to_record())))
    assert back == schema and back.has_prompt_logprobs


def test_a_passthrough_column_named_prompt_logprobs_is_not_the_column() -> None:
    named = OutputSchema.of([pa.field("prompt_logprobs", pa.string())])
    assert not named.has_prompt_logprobs
    assert [f.name for f in named.passthrough] == ["prompt_logprobs"]
    with pytest.raises(ValueError, match="input.passthrough_columns: 'prompt_logprobs' clashes"):
        named.with_prompt_logprobs()


def test_the_logprobs_column_sits_after_prompt_logprobs_before_the_passthrough() -> None:
    """Either order of asking gives the one layout; a resumed job reads it back from the
    manifest record with both columns told from passthrough columns."""
    plain = OutputSchema.of([pa.field("n", pa.int64())], "inferred from all 2 input rows")
    alone = plain.with_logprobs()
    assert alone.schema.names == [*FIXED_COLUMNS, "logprobs", "n"]
    assert alone.has_logprobs and not alone.has_prompt_logprobs and not plain.has_logprobs
    assert alone.with_logprobs() is alone
    both = alone.with_prompt_logprobs()
    assert both.schema.names == [*FIXED_COLUMNS, "prompt_logprobs", "logprobs", "n"]
    assert both == plain.with_prompt_logprobs().with_logprobs()
    assert both.schema.field("logprobs").equals(LOGPROBS_FIELD, check_metadata=True)
    for schema in (alone, both):
        assert [f.name for f in schema.passthrough] == ["n"]
        assert schema.describe() == {"n": "int64"} and schema.row_problem({"n": 1}) is None
        back = OutputSchema.from_record(json.loads(json.dumps(schema.to_record())))
        assert back == schema and back.schema.equals(schema.schema, check_metadata=True)
        assert (back.has_logprobs, back.has_prompt_logprobs) == (
            schema.has_logprobs,
            schema.has_prompt_logprobs,
        )


def test_a_passthrough_column_named_logprobs_is_not_the_column() -> None:
    # the column's own type, without its metadata: still a passthrough column
    named = OutputSchema.of([pa.field("logprobs", LOGPROBS_FIELD.type)])
    assert not named.has_logprobs
    assert [f.name for f in named.passthrough] == ["logprobs"]
    with pytest.raises(ValueError, match=r"'logprobs' clashes .*\(sampling\.logprobs is set\)"):
        named.with_logprobs()
    assert named.with_prompt_logprobs().has_prompt_logprobs  # the other column is no clash


def test_values_nested_too_deep_for_readers_are_json_text(tmp_path) -> None:
    """Lists nested 60 deep: pyarrow (26) writes the column but refuses to read the file
    back ("Parquet schema too deeply nested"), so the shard would be unreadable as a
    dataset: JSON text. A pyarrow that reads it back (25, Python 3.10's) keeps the lists."""
    import pyarrow.parquet as pq

    deep: Any = 1
    for _ in range(60):
        deep = [deep]
    field = inferred_field("deep", [deep])
    pq.write_table(pa.table({"deep": [deep]}), tmp_path / "deep.parquet")
    try:
        readable = pq.read_table(tmp_path / "deep.parquet").column("deep").to_pylist() == [deep]
    except (pa.ArrowException, OSError):
        readable = False
    if readable:
        assert pa.types.is_list(field.type)
    else:
        assert field.type == pa.string() and field.metadata  # JSON text
    shallow: Any = 1
    for _ in range(8):
        shallow = [shallow]
    assert pa.types.is_list(inferred_field("shallow", [shallow]).type)


def test_durations_are_one_iso_8601_text_whatever_their_unit() -> None:
    """pyarrow hands over datetime.timedelta for s/ms/us and pandas' Timedelta for ns: JSONL
    wrote '-1 day, 23:59:55' for one and 'P-1DT23H59M55S' for the other in one column."""
    import datetime

    import pyarrow as pa

    from tokenmill.io.output_schema import json_default

    for unit in ("s", "ms", "us", "ns"):
        values = pa.array([-5, 86400], pa.duration("s")).cast(pa.duration(unit)).to_pylist()
        assert [json_default(v) for v in values] == ["-PT5S", "PT86400S"], unit
    assert json_default(datetime.timedelta(microseconds=90_500_000)) == "PT90.5S"
