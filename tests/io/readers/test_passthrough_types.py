"""Passthrough types decided from the input, and rows whose values do not fit them."""

from __future__ import annotations

import datetime
import json
from decimal import Decimal

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.io.readers.reader_files import write_jsonl, write_parquet
from tests.s3_server import s3_endpoint  # noqa: F401
from tokenmill.io.readers import InputConfig, iter_input_rows, passthrough_schema, passthrough_types


def _cfg(path, *columns: str) -> InputConfig:
    return InputConfig(path=str(path), passthrough_columns=columns)


def test_jsonl_types_come_from_a_sample_not_the_first_rows(tmp_path) -> None:
    rows = [{"id": f"r{i}", "prompt": "p", "score": None if i < 5 else i / 2} for i in range(9)]
    f = write_jsonl(tmp_path / "in.jsonl", rows)
    schema = passthrough_schema(_cfg(f, "score", "absent"))
    assert schema.describe() == {"score": "double", "absent": "json text"}
    assert schema.origin == "inferred from all 9 input rows"


def test_bad_rows_are_left_out_of_the_sample(tmp_path) -> None:
    f = write_jsonl(
        tmp_path / "in.jsonl",
        ["{broken", {"id": "a", "n": "x"}, {"id": "b", "prompt": "p", "n": 1}],
    )
    assert passthrough_schema(_cfg(f, "n")).describe() == {"n": "int64"}


def test_a_later_value_that_does_not_fit_is_its_rows_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(passthrough_types, "SAMPLE_ROWS", 3)
    values = [1, 2, None, 4, "five", 6.5, 7]
    rows = [{"id": f"r{i}", "prompt": "p", "n": v} for i, v in enumerate(values)]
    f = write_jsonl(tmp_path / "in.jsonl", rows)
    cfg = _cfg(f, "n")
    schema = passthrough_schema(cfg)
    assert schema.describe() == {"n": "int64"}
    assert schema.origin == "inferred from the first 3 input rows"
    got = list(iter_input_rows(cfg, schema))
    assert [r.row_id for r in got if r.error is None] == ["r0", "r1", "r2", "r3", "r6"]
    bad = {r.row_id: r for r in got if r.error is not None}
    assert set(bad) == {"r4", "r5"}
    assert bad["r4"].source == f"{f}:5"
    assert bad["r4"].error.startswith("passthrough column 'n' holds 'five', which does not fit")
    assert "int64 (inferred from the first 3 input rows)" in bad["r5"].error
    assert "6.5" in bad["r5"].error
    assert bad["r4"].passthrough == {"n": "five"}  # echoed to the error file as it was
    # without a schema (JSONL output) every value goes through as it is
    assert all(r.error is None for r in iter_input_rows(cfg))


def test_parquet_types_come_from_every_files_schema(tmp_path, caplog) -> None:
    write_parquet(tmp_path / "a.parquet", {"prompt": ["p"], "x": pa.array([None], pa.null())})
    write_parquet(
        tmp_path / "b.parquet", {"prompt": ["p"], "x": [1.5], "y": pa.array([1], pa.int32())}
    )
    write_parquet(tmp_path / "c.parquet", {"prompt": ["p"], "y": pa.array([2], pa.int64())})
    table = pa.table({"prompt": ["p"], "cat": pa.array(["u"]).dictionary_encode()})
    pq.write_table(table, tmp_path / "d.parquet")
    cfg = InputConfig(
        path=str(tmp_path), id_column=None, passthrough_columns=("x", "y", "cat", "z")
    )
    schema = passthrough_schema(cfg)
    assert schema.describe() == {"x": "double", "y": "int64", "cat": "string", "z": "json text"}
    assert schema.origin == "the input's Parquet type, combined over its files"
    rows = list(iter_input_rows(cfg, schema))
    assert [r.error for r in rows] == [None] * 4
    assert [r.passthrough["y"] for r in rows] == [None, 1, 2, None]
    # z is in no file: a misspelling, or a hive-style folder key, warned about once
    warned = [r.getMessage() for r in caplog.records if "passthrough_columns" in r.getMessage()]
    assert warned == [
        "input.passthrough_columns 'z': in none of the 4 input files, so null in every output "
        "row (a misspelling? hive-style folder keys such as date=... are not read as columns)"
    ]


def test_parquet_files_whose_types_do_not_combine_are_refused(tmp_path) -> None:
    a = write_parquet(tmp_path / "a.parquet", {"prompt": ["p"], "x": [1]})
    b = write_parquet(tmp_path / "b.parquet", {"prompt": ["p"], "x": ["one"]})
    with pytest.raises(ValueError, match="input.passthrough_columns: column 'x'") as caught:
        passthrough_schema(_cfg(tmp_path, "x"))
    assert str(a) in str(caught.value) and str(b) in str(caught.value)


def test_no_passthrough_columns_reads_nothing(tmp_path) -> None:
    schema = passthrough_schema(_cfg(tmp_path / "missing.jsonl"))
    assert schema.passthrough == []


def test_arrows_own_extension_types_pass_through(tmp_path) -> None:
    """bool8 made every row an error (its booleans checked against int8 storage);
    fixed_shape_tensor failed the job with exit 1 (NotImplementedError)."""
    import numpy as np

    tensor = pa.FixedShapeTensorArray.from_numpy_ndarray(
        np.arange(8, dtype="float32").reshape(2, 2, 2)
    )
    flags = pa.array([1, 0], pa.int8()).cast(pa.bool8())
    table = pa.table({"id": ["a", "b"], "prompt": ["p", "q"], "flag": flags, "t": tensor})
    pq.write_table(table, tmp_path / "in.parquet")
    cfg = _cfg(tmp_path / "in.parquet", "flag", "t")
    out = passthrough_schema(cfg)
    described = out.describe()
    assert described["flag"] == "bool" and described["t"].startswith("fixed_size_list<")
    rows = list(iter_input_rows(cfg, out))
    assert [r.error for r in rows] == [None, None]
    assert [r.passthrough["flag"] for r in rows] == [True, False]
    written = out.column("t", [r.passthrough["t"] for r in rows], ["a", "b"])
    assert written.to_pylist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize(
    ("a", "b", "why"),
    [(pa.array([b"\x00"], pa.binary()), pa.array(["x"]), "string values would be written"),
     (pa.array([2**63 + 1], pa.uint64()), pa.array([-1], pa.int64()), "uint64 values past"),
     (pa.array([Decimal("0.10")], pa.decimal128(10, 2)), pa.array([0.5]), "decimal128.10, 2. val")],
)  # fmt: skip
def test_types_arrow_combines_with_loss_are_refused_up_front(tmp_path, a, b, why) -> None:
    """Arrow combines them (binary; int64; double), and every row whose value did not fit
    was refused one by one: exit 2 up front instead, as for types that do not combine."""
    for name, column in (("a", a), ("b", b)):
        pq.write_table(
            pa.table({"id": [name], "prompt": ["p"], "c": column}), tmp_path / f"{name}.parquet"
        )
    with pytest.raises(ValueError, match=f"do not combine into one type \\({why}"):
        passthrough_schema(_cfg(tmp_path / "*.parquet", "c"))


def test_string_views_combine_with_strings_and_int64_with_double_says_so(tmp_path, caplog) -> None:
    """string_view beside string stopped the job (exit 2, "do not combine"); int64 beside
    double became double without a word, and a row past 2**53 failed as "not the input's
    Parquet type"."""
    pq.write_table(pa.table({"id": ["a"], "prompt": ["p"], "s": pa.array(["x"], pa.string_view()),
                             "n": [2**53 + 1]}), tmp_path / "a.parquet")  # fmt: skip
    pq.write_table(
        pa.table({"id": ["b"], "prompt": ["p"], "s": ["y"], "n": [0.5]}), tmp_path / "b.parquet"
    )
    cfg = _cfg(tmp_path / "*.parquet", "s", "n")
    schema = passthrough_schema(cfg)
    assert schema.describe() == {"s": "string", "n": "double"}
    rows = {r.row_id: r for r in iter_input_rows(cfg, schema)}
    assert rows["b"].error is None and rows["b"].passthrough == {"s": "y", "n": 0.5}
    assert rows["a"].error is not None and "combined over its files" in rows["a"].error
    warned = [r.getMessage() for r in caplog.records if "'n' is int64" in r.getMessage()]
    assert len(warned) == 1 and "a.parquet" in warned[0] and "past 2**53" in warned[0]


def test_an_empty_part_file_gives_a_type_only_where_no_file_with_rows_does(tmp_path) -> None:
    """A zero-row Spark part file holding the column as string stopped a job whose rows hold
    it as int64 (exit 2: the two do not combine)."""
    pq.write_table(
        pa.table({"id": pa.array([], pa.string()), "prompt": pa.array([], pa.string()),
                  "n": pa.array([], pa.string()), "only": pa.array([], pa.float32())}),
        tmp_path / "part-0.parquet",
    )  # fmt: skip
    pq.write_table(pa.table({"id": ["a"], "prompt": ["p"], "n": [7]}), tmp_path / "part-1.parquet")
    schema = passthrough_schema(_cfg(tmp_path / "*.parquet", "n", "only"))
    assert schema.describe() == {"n": "int64", "only": "float"}


def test_a_type_parquet_cannot_store_is_json_text_and_said_so(tmp_path, caplog) -> None:
    """list<uuid> became a JSON text column without a word."""
    import uuid

    ids = pa.array([uuid.UUID(int=1).bytes], pa.binary(16)).cast(pa.uuid())
    uuids = pa.ListArray.from_arrays(pa.array([0, 1], pa.int32()), ids)
    pq.write_table(pa.table({"id": ["a"], "prompt": ["p"], "u": uuids}), tmp_path / "in.parquet")
    schema = passthrough_schema(_cfg(tmp_path / "in.parquet", "u"))
    assert schema.describe() == {"u": "json text"}
    assert any("'u': its type list<" in r.getMessage() for r in caplog.records)


def test_dictionaries_inside_lists_structs_and_maps_are_their_values(tmp_path) -> None:
    """polars writes list<categorical> as list<dictionary<string>>: beside another file's
    list<string> the job stopped ("do not combine into one type")."""
    tags = pa.array([["a", "b"]], pa.list_(pa.string()))
    coded = tags.cast(pa.list_(pa.dictionary(pa.int32(), pa.string())))
    meta = pa.array([{"k": "x"}]).cast(pa.struct([("k", pa.dictionary(pa.int8(), pa.string()))]))
    pq.write_table(
        pa.table({"id": ["a"], "prompt": ["p"], "t": tags, "m": meta}), tmp_path / "a.parquet"
    )
    pq.write_table(
        pa.table({"id": ["b"], "prompt": ["p"], "t": coded, "m": meta}), tmp_path / "b.parquet"
    )
    schema = passthrough_schema(_cfg(tmp_path, "t", "m"))
    assert schema.describe() == {"t": "list<element: string>", "m": "struct<k: string>"}
    rows = list(iter_input_rows(_cfg(tmp_path, "t", "m"), schema))
    assert [r.passthrough for r in rows] == [{"t": ["a", "b"], "m": {"k": "x"}}] * 2
    assert all(r.error is None for r in rows)


def test_a_sample_of_wide_values_is_bounded_in_bytes(tmp_path, monkeypatch):
    """A 400-row input of a 5 MB column each was held whole while its types were inferred
    (an audit): long texts are kept as empty ones of their type, and the sample ends once
    what it keeps holds SAMPLE_BYTES."""
    monkeypatch.setattr(passthrough_types, "SAMPLE_BYTES", 4096, raising=False)
    held: list[int] = []
    inferred = passthrough_types.inferred_field

    def measuring(name, values):
        held.append(sum(len(v) for v in values if isinstance(v, str)))
        return inferred(name, values)

    monkeypatch.setattr(passthrough_types, "inferred_field", measuring)
    rows = [
        {"id": i, "prompt": "p", "big": "x" * 100_000, "tags": ["t" * 10] * 20} for i in range(50)
    ]
    f = write_jsonl(tmp_path / "in.jsonl", rows)
    schema = passthrough_schema(_cfg(f, "big", "tags"))
    assert schema.schema.field("big").type == pa.string()
    assert schema.schema.field("tags").type == pa.list_(pa.string())
    assert held[0] == 0  # the 100 KB texts: none kept
    assert schema.origin.startswith("inferred from the first ")  # 4 KB: some of the 50 rows


def _two_files(folder, a: pa.Array, b: pa.Array) -> InputConfig:
    """Column ``c`` as ``a`` in folder/a.parquet and as ``b`` in folder/b.parquet."""
    folder.mkdir(exist_ok=True)
    for name, column in (("a", a), ("b", b)):
        ids = [f"{name}{i}" for i in range(len(column))]
        table = pa.table({"id": ids, "prompt": ["p"] * len(column), "c": column})
        pq.write_table(table, folder / f"{name}.parquet")
    return _cfg(folder / "*.parquet", "c")


def test_integers_beside_decimals_widen_to_a_decimal_that_holds_every_integer(tmp_path) -> None:
    """Arrow counts an int64 as 18 digits: int64 beside decimal128(10, 2) was decimal128(20, 2),
    and each int64 row past 10**18 was its row's error after the run had read it."""
    big = [2**62, -(2**63)]
    structs = pa.array([{"n": 2**62}], pa.struct([("n", pa.int64())]))
    cfg = _two_files(
        tmp_path,
        pa.array(big + [None], pa.int64()),
        pa.array([Decimal("1.25"), None, None], pa.decimal128(10, 2)),
    )
    schema = passthrough_schema(cfg)
    assert schema.describe() == {"c": "decimal128(21, 2)"}
    rows = {r.row_id: r for r in iter_input_rows(cfg, schema)}
    assert [rows[i].error for i in ("a0", "a1", "b0")] == [None, None, None]
    written = schema.column(
        "c", [rows["a0"].passthrough["c"], rows["a1"].passthrough["c"]], ["a0", "a1"]
    )
    assert written.to_pylist() == [Decimal(2**62), Decimal(-(2**63))]
    nested = _two_files(
        tmp_path / "nested",
        structs,
        pa.array([{"n": Decimal("0.5")}], pa.struct([("n", pa.decimal128(3, 1))])),
    )
    assert passthrough_schema(nested).describe() == {"c": "struct<n: decimal128(20, 1)>"}


def test_decimals_that_no_decimal128_holds_are_refused_up_front(tmp_path) -> None:
    """int64 beside decimal128(38, 30) became decimal256(48, 30), which duckdb reads as
    double: every value rounded to 16 digits, silently."""
    cfg = _two_files(
        tmp_path, pa.array([1], pa.int64()), pa.array([Decimal("1.5")], pa.decimal128(38, 30))
    )
    with pytest.raises(ValueError, match=r"'c' is int64 in .*a\.parquet but decimal128\(38, 30\)"):
        passthrough_schema(cfg)


def test_coarser_times_that_ns_does_not_hold_are_refused_up_front(tmp_path) -> None:
    """pandas' timestamp[ns] beside pyarrow's (duckdb's, Spark's) timestamp[us] combined into
    ns, which holds only 1677-2262: each 9999-12-31 "no end" row was its row's error, exit 0."""
    import pandas as pd

    end = datetime.datetime(9999, 12, 31)
    ns = pd.DataFrame({"id": ["a"], "prompt": ["p"], "end": pd.to_datetime(["2024-01-01"])})
    ns["end"] = ns["end"].astype("datetime64[ns]")
    ns.to_parquet(tmp_path / "a.parquet")
    us = pa.table({"id": ["b"], "prompt": ["p"], "end": pa.array([end], pa.timestamp("us"))})
    pq.write_table(us, tmp_path / "b.parquet")
    with pytest.raises(ValueError) as caught:
        passthrough_schema(_cfg(tmp_path / "*.parquet", "end"))
    said = str(caught.value)
    assert f"'end' is timestamp[us] in {tmp_path / 'b.parquet'} but timestamp[ns] in " in said
    assert "holds 9999-12-31 00:00:00.000000 there" in said
    assert "cast the column to timestamp[us] in " + str(tmp_path / "a.parquet") in said


def test_coarser_times_are_ns_where_the_footers_statistics_say_they_fit(tmp_path) -> None:
    """In struct, list and map too; a row group of nulls only has no min/max, and fits."""
    when = datetime.datetime(2024, 5, 6, 7, 8, 9)
    at = pa.struct([("t", pa.timestamp("ns"))])
    cfg = _two_files(
        tmp_path,
        pa.array([{"t": when}, {"t": None}], pa.struct([("t", pa.timestamp("ms"))])),
        pa.array([{"t": when}, {"t": when}], at),
    )
    schema = passthrough_schema(cfg)
    assert schema.describe() == {"c": "struct<t: timestamp[ns]>"}
    assert [r.error for r in iter_input_rows(cfg, schema)] == [None] * 4
    lists = _two_files(
        tmp_path / "lists",
        pa.array([[datetime.timedelta(days=1)]], pa.list_(pa.duration("s"))),
        pa.array([[datetime.timedelta(0)]], pa.list_(pa.duration("ns"))),
    )
    assert passthrough_schema(lists).describe() == {"c": "list<element: duration[ns]>"}


@pytest.mark.parametrize(
    ("coarse", "fine", "statistics", "said"),
    [(pa.array([{1: datetime.datetime(3000, 1, 1)}], pa.map_(pa.int64(), pa.timestamp("ms"))),
      pa.array([{1: datetime.datetime(2000, 1, 1)}], pa.map_(pa.int64(), pa.timestamp("ns"))),
      True, "holds 3000-01-01 00:00:00.000 there"),
     (pa.array([datetime.timedelta(days=400 * 366)], pa.duration("s")),
      pa.array([datetime.timedelta(0)], pa.duration("ns")), True, "holds 12648960000 s there"),
     (pa.array([datetime.datetime(2024, 1, 1)], pa.timestamp("us")),
      pa.array([datetime.datetime(2024, 1, 1)], pa.timestamp("ns")), False,
      "has no min/max statistics for it")],
)  # fmt: skip
def test_coarser_times_past_ns_or_without_statistics_are_refused(
    tmp_path, coarse, fine, statistics, said
) -> None:
    for name, column in (("a", coarse), ("b", fine)):
        table = pa.table({"id": [name], "prompt": ["p"], "c": column})
        pq.write_table(table, tmp_path / f"{name}.parquet", write_statistics=statistics)
    with pytest.raises(ValueError, match=f"{tmp_path / 'a.parquet'} {said}"):
        passthrough_schema(_cfg(tmp_path / "*.parquet", "c"))


def test_every_jsonl_file_is_sampled_from_its_start(tmp_path, monkeypatch) -> None:
    """A first file of SAMPLE_ROWS integers filled the sample: a later file's 2.5 was never
    seen, and each of its rows was an error while the job exited 0."""
    monkeypatch.setattr(passthrough_types, "SAMPLE_ROWS", 4)
    write_jsonl(tmp_path / "a.jsonl", [{"id": f"a{i}", "prompt": "p", "v": i} for i in range(5)])
    write_jsonl(tmp_path / "b.jsonl", [{"id": f"b{i}", "prompt": "p", "v": 2.5} for i in range(3)])
    cfg = _cfg(tmp_path, "v")
    schema = passthrough_schema(cfg)
    assert schema.describe() == {"v": "double"}
    assert schema.origin == "inferred from 4 input rows, the first of each of 2 input files"
    assert [r.error for r in iter_input_rows(cfg, schema)] == [None] * 8


def test_the_sample_of_many_files_stays_bounded(tmp_path, monkeypatch) -> None:
    """SAMPLE_ROWS shared among the files (3 files of 10 rows: 2 rows each), a row of each
    at least (10 files: one each, the last one's type seen too)."""
    monkeypatch.setattr(passthrough_types, "SAMPLE_ROWS", 6)
    (tmp_path / "three").mkdir()
    for f in range(3):
        rows = [{"id": f"{f}-{i}", "prompt": "p", "v": i} for i in range(10)]
        write_jsonl(tmp_path / "three" / f"{f}.jsonl", rows)
    assert passthrough_schema(_cfg(tmp_path / "three", "v")).origin == (
        "inferred from 6 input rows, the first of each of 3 input files"
    )
    (tmp_path / "ten").mkdir()
    for f in range(10):
        value = 0.5 if f == 9 else 1  # in the last file only
        rows = [{"id": f"{f}-{i}", "prompt": "p", "v": value} for i in range(10)]
        write_jsonl(tmp_path / "ten" / f"{f:02d}.jsonl", rows)
    schema = passthrough_schema(_cfg(tmp_path / "ten", "v"))
    assert schema.describe() == {"v": "double"}
    assert schema.origin == "inferred from 10 input rows, the first of each of 10 input files"


def test_a_remote_inputs_sample_is_files_spread_over_its_list(s3_endpoint, monkeypatch) -> None:  # noqa: F811
    """Sampled one after another, each remote file a request or more: a remote input of more
    than REMOTE_SAMPLED_FILES files is sampled at that many, its first and last among them
    (the last one's 0.5 is seen); a local one at every file."""
    monkeypatch.setattr(passthrough_types, "REMOTE_SAMPLED_FILES", 4)
    _, options = s3_endpoint
    fs = fsspec.filesystem("s3", **options)
    fs.mkdir("data")
    for f in range(7):
        value = 0.5 if f == 6 else 1  # in the last file only
        body = "".join(
            json.dumps({"id": f"{f}-{i}", "prompt": "p", "v": value}) + "\n" for i in range(3)
        )
        fs.pipe_file(f"data/in/{f}.jsonl", body.encode())
    opened: list[str] = []
    sample_file = passthrough_types._sample_file

    def counted(cfg, *args):
        opened.extend(cfg.files)
        return sample_file(cfg, *args)

    monkeypatch.setattr(passthrough_types, "_sample_file", counted)
    cfg = InputConfig(path="s3://data/in/", storage_options=options, passthrough_columns=("v",))
    schema = passthrough_schema(cfg)
    assert schema.describe() == {"v": "double"}
    assert [u.rsplit("/", 1)[1] for u in opened] == ["0.jsonl", "2.jsonl", "4.jsonl", "6.jsonl"]
    assert schema.origin == "inferred from 12 input rows, the first of each of 4 of 7 input files"
    assert [r.error for r in iter_input_rows(cfg, schema)] == [None] * 21
