"""Shard serialization: names, round trips, empty shards, passthrough, OpenAI Batch lines."""

from __future__ import annotations

import json
from dataclasses import replace

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from tokenmill.io.openai_batch_output import (
    CHAT_ENDPOINT,
    COMPLETIONS_ENDPOINT,
    error_line,
    result_line,
)
from tokenmill.io.output_schema import OutputSchema
from tokenmill.io.rows import Choice, ResultRow
from tokenmill.io.storage import OutputStore
from tokenmill.io.writers import (
    FIXED_COLUMNS,
    OUTPUT_FORMATS,
    encode_errors,
    encode_results,
    read_results,
    shard_index,
    shard_names,
)


def _rows() -> list[ResultRow]:
    # deliberately out of row order: writers sort by row_index
    return [
        ResultRow(2, "r2", error="prompt is 9000 tokens; max_model_len is 4096"),
        ResultRow(1, "r1", "héllo", "length", 3, 4, passthrough={"lang": "fr", "n": 2}),
        ResultRow(0, "r0", "hi", "stop", 5, 1, passthrough={"lang": "en", "n": 1}),
    ]


# A completion's logprobs: "Hi" then "!", each its step's most likely token.
_LOGPROBS = [
    {
        "token_id": 5,
        "token": "Hi",
        "logprob": -0.1,
        "rank": 1,
        "top_logprobs": [{"token_id": 5, "token": "Hi", "logprob": -0.1}],
    },
    {
        "token_id": 6,
        "token": "!",
        "logprob": -0.5,
        "rank": 1,
        "top_logprobs": [{"token_id": 6, "token": "!", "logprob": -0.5}],
    },
]


def _batch_rows(endpoint: str, logprobs: bool = False) -> list[ResultRow]:
    lp = _LOGPROBS
    return [
        ResultRow(
            0,
            "req-0",
            "Hi!",
            "stop",
            7,
            2,
            custom_id="req-0",
            endpoint=endpoint,
            model="tiny",
            logprobs=lp if logprobs else None,
        ),
        ResultRow(1, "req-1", custom_id="req-1", endpoint=endpoint, error="missing 'messages'"),
    ]


# Position 0 has no logprob; at position 1 the prompt token (7) is ranked 3rd, and at
# position 2 it (9) is the most likely, so it is also the first alternative.
_PROMPT_LOGPROBS = [
    None,
    {
        "token_id": 7,
        "token": "a",
        "logprob": -2.5,
        "rank": 3,
        "top_logprobs": [
            {"token_id": 9, "token": "b", "logprob": -0.5},
            {"token_id": 4, "token": "c", "logprob": -1.0},
        ],
    },
    {
        "token_id": 9,
        "token": "b",
        "logprob": -0.25,
        "rank": 1,
        "top_logprobs": [{"token_id": 9, "token": "b", "logprob": -0.25}],
    },
]
_VLLM_PROMPT_LOGPROBS = [
    None,
    {
        "7": {"logprob": -2.5, "rank": 3, "decoded_token": "a"},
        "9": {"logprob": -0.5, "rank": 1, "decoded_token": "b"},
        "4": {"logprob": -1.0, "rank": 2, "decoded_token": "c"},
    },
    {"9": {"logprob": -0.25, "rank": 1, "decoded_token": "b"}},
]


def test_shard_names() -> None:
    assert shard_names(0, "parquet") == ("shards/part-00000.parquet", "errors/part-00000.jsonl")
    assert shard_names(7, "jsonl") == ("shards/part-00007.jsonl", "errors/part-00007.jsonl")
    assert shard_names(12, "openai-batch") == ("shards/part-00012.jsonl", "errors/part-00012.jsonl")
    assert shard_names(123456, "jsonl")[0] == "shards/part-123456.jsonl"
    names = [shard_names(i, "parquet")[0] for i in (10, 9, 100, 99999)]
    assert sorted(names) == [shard_names(i, "parquet")[0] for i in (9, 10, 100, 99999)]
    assert [shard_index(n) for n in names] == [10, 9, 100, 99999]
    with pytest.raises(ValueError, match="output.format"):
        shard_names(0, "csv")
    with pytest.raises(ValueError, match="shard index"):
        shard_names(-1, "jsonl")


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_plain_round_trip(tmp_path, fmt: str) -> None:
    store = OutputStore(str(tmp_path))
    data_name, error_name = shard_names(0, fmt)
    store.write_atomic(data_name, encode_results(_rows(), fmt))
    store.write_atomic(error_name, encode_errors(_rows(), fmt))
    assert read_results(store, [data_name], fmt) == [
        {
            "id": "r0",
            "text": "hi",
            "finish_reason": "stop",
            "prompt_tokens": 5,
            "completion_tokens": 1,
            "lang": "en",
            "n": 1,
        },
        {
            "id": "r1",
            "text": "héllo",
            "finish_reason": "length",
            "prompt_tokens": 3,
            "completion_tokens": 4,
            "lang": "fr",
            "n": 2,
        },
    ]
    assert read_results(store, [error_name], fmt) == [
        {"id": "r2", "error": "prompt is 9000 tokens; max_model_len is 4096"}
    ]
    # error files are plain JSONL, one object per line, in every format
    lines = store.read_bytes(error_name).decode().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["r2"]


@pytest.mark.parametrize("fmt", OUTPUT_FORMATS)
def test_empty_shards_are_valid_files(tmp_path, fmt: str) -> None:
    store = OutputStore(str(tmp_path))
    data_name, error_name = shard_names(3, fmt)
    store.write_atomic(data_name, encode_results([], fmt))
    store.write_atomic(error_name, encode_errors([], fmt))
    assert read_results(store, [data_name, error_name], fmt) == []
    if fmt == "parquet":
        table = pq.read_table(tmp_path / data_name)
        assert table.num_rows == 0 and tuple(table.column_names) == FIXED_COLUMNS
    else:
        assert store.read_bytes(data_name) == b""
    assert store.read_bytes(error_name) == b""


def test_parquet_shards_of_one_schema_read_as_one_dataset(tmp_path) -> None:
    """With the job's schema, empty, all-error, passthrough-less and all-null shards have
    exactly the schema of full ones, so a directory of them is one dataset."""
    schema = OutputSchema.of([pa.field("lang", pa.string()), pa.field("n", pa.int64())])
    shards = [
        _rows(),
        [],
        [ResultRow(9, "r9", error="bad")],
        [ResultRow(5, "r5", "x", "stop", 1, 1)],
        [ResultRow(6, "r6", "y", "stop", 1, 1, passthrough={"n": None})],
    ]
    for i, rows in enumerate(shards):
        (tmp_path / f"part-{i}.parquet").write_bytes(encode_results(rows, "parquet", schema=schema))
    for i in range(len(shards)):
        assert pq.read_schema(tmp_path / f"part-{i}.parquet").equals(schema.schema)
    table = ds.dataset(tmp_path).to_table()
    assert sorted(table.column("id").to_pylist()) == ["r0", "r1", "r5", "r6"]
    assert table.schema.field("n").type == pa.int64()


def test_a_value_that_does_not_fit_the_schema_names_its_row_and_column() -> None:
    schema = OutputSchema.of([pa.field("n", pa.int64())])
    row = ResultRow(0, "r0", "t", "stop", 1, 1, passthrough={"n": 2.5})
    with pytest.raises(ValueError, match=r"row 'r0': passthrough column 'n' holds 2.5.*int64"):
        encode_results([row], "parquet", schema=schema)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_passthrough_with_mixed_types(tmp_path, fmt: str) -> None:
    rows = [
        ResultRow(
            0,
            "a",
            "t",
            "stop",
            1,
            1,
            passthrough={"x": 1, "meta": {"k": [1, 2]}, "raw": b"\x00\xff"},
        ),
        ResultRow(1, "b", "t", "stop", 1, 1, passthrough={"x": "one", "only_b": 2.5}),
        ResultRow(2, "c", "t", "stop", 1, 1, passthrough={"x": None}),
    ]
    store = OutputStore(str(tmp_path))
    name = shard_names(0, fmt)[0]
    store.write_atomic(name, encode_results(rows, fmt))
    got = read_results(store, [name], fmt)
    assert [r["id"] for r in got] == ["a", "b", "c"]
    if fmt == "jsonl":
        assert [r["x"] for r in got] == [1, "one", None]
        assert got[0]["meta"] == {"k": [1, 2]} and got[0]["raw"] == "AP8="
        assert "only_b" not in got[0] and got[1]["only_b"] == 2.5
    else:
        # no common Arrow type for 1 and "one": the column is JSON text
        assert [r["x"] for r in got] == ["1", '"one"', None]
        assert got[0]["meta"] == {"k": [1, 2]} and got[0]["raw"] == b"\x00\xff"
        assert [r["only_b"] for r in got] == [None, 2.5, None]
    assert list(got[0])[:5] == list(FIXED_COLUMNS)


def test_passthrough_clashing_with_fixed_column_is_an_error() -> None:
    row = ResultRow(0, "a", "t", "stop", 1, 1, passthrough={"text": "original"})
    with pytest.raises(ValueError, match="passthrough column 'text'"):
        encode_results([row], "jsonl")


@pytest.mark.parametrize("endpoint", [CHAT_ENDPOINT, COMPLETIONS_ENDPOINT])
def test_openai_batch_lines(tmp_path, endpoint: str) -> None:
    rows = _batch_rows(endpoint)
    data = encode_results(rows, "openai-batch", created=1700000000)
    errors = encode_errors(rows, "openai-batch")
    (line,) = [json.loads(x) for x in data.decode().splitlines()]
    assert set(line) == {"id", "custom_id", "response", "error"}
    assert line["id"].startswith("batch_req_") and line["custom_id"] == "req-0"
    assert line["error"] is None
    response = line["response"]
    assert response["status_code"] == 200 and response["request_id"].startswith("req_")
    body = response["body"]
    assert body["created"] == 1700000000 and body["model"] == "tiny"
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "stop"
    assert choice["logprobs"] is None
    if endpoint == CHAT_ENDPOINT:
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        assert choice["message"] == {"role": "assistant", "content": "Hi!"}
    else:
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        assert choice["text"] == "Hi!"

    (err,) = [json.loads(x) for x in errors.decode().splitlines()]
    assert err["custom_id"] == "req-1" and err["response"] is None
    assert err["id"].startswith("batch_req_") and err["id"] != line["id"]
    assert err["error"] == {"code": "invalid_request", "message": "missing 'messages'"}

    store = OutputStore(str(tmp_path))
    data_name, error_name = shard_names(0, "openai-batch")
    store.write_atomic(data_name, data)
    store.write_atomic(error_name, errors)
    assert read_results(store, [data_name, error_name], "openai-batch") == [line, err]


def test_openai_batch_logprobs() -> None:
    chat = json.loads(encode_results(_batch_rows(CHAT_ENDPOINT, logprobs=True), "openai-batch"))
    logprobs = chat["response"]["body"]["choices"][0]["logprobs"]
    assert [e["token"] for e in logprobs["content"]] == ["Hi", "!"]
    assert logprobs["content"][1] == {  # OpenAI's fields only: no token ids or ranks
        "token": "!",
        "logprob": -0.5,
        "top_logprobs": [{"token": "!", "logprob": -0.5}],
    }

    rows = _batch_rows(COMPLETIONS_ENDPOINT, logprobs=True)
    legacy = json.loads(encode_results(rows, "openai-batch"))["response"]["body"]
    assert legacy["choices"][0]["logprobs"] == {
        "tokens": ["Hi", "!"],
        "token_logprobs": [-0.1, -0.5],
        "top_logprobs": [{"Hi": -0.1}, {"!": -0.5}],
        "text_offset": [0, 2],  # where each token starts in the text, as vLLM writes it
    }
    # the sampled token is always there (OpenAI: up to logprobs + 1 entries), after the top
    from tokenmill.io.logprobs_column import openai_completion_logprobs

    sampled = {"token": "x", "logprob": -3.0, "top_logprobs": [{"token": "y", "logprob": -0.1}]}
    alone = {"token": "z", "logprob": -0.2, "top_logprobs": []}  # logprobs: 0 gave {}
    tops = openai_completion_logprobs([sampled, alone], "xz")["top_logprobs"]
    assert tops == [{"y": -0.1, "x": -3.0}, {"z": -0.2}]


def test_openai_batch_ids_are_one_per_line_and_stable() -> None:
    """Rows sharing an id (and a fallback id equal to another row's custom_id) still get
    ids of their own, from their place in the input; the same row always gets the same."""
    row = _batch_rows(CHAT_ENDPOINT)[0]
    same_id = ResultRow(5, row.row_id, "Yo", "stop", 1, 1, custom_id=row.custom_id,
                        endpoint=CHAT_ENDPOINT, model="tiny")  # fmt: skip
    lines = [result_line(r) for r in (row, same_id)]
    errors = [error_line(replace(r, error="bad")) for r in (row, same_id)]
    assert len({x["id"] for x in lines}) == len({x["id"] for x in errors}) == 2
    request_ids = {x["response"]["request_id"] for x in lines}
    body_ids = {x["response"]["body"]["id"] for x in lines}
    assert len(request_ids) == len(body_ids) == 2
    assert [result_line(r) for r in (row, same_id)] == lines  # deterministic


def test_openai_batch_needs_an_endpoint() -> None:
    row = ResultRow(0, "a", "t", "stop", 1, 1, custom_id="a")
    with pytest.raises(ValueError, match="row 'a'.*url"):
        encode_results([row], "openai-batch")


@pytest.mark.parametrize("fmt", OUTPUT_FORMATS)
def test_bytes_are_deterministic(fmt: str) -> None:
    """A rerun (rows finishing in another order) writes the very same bytes."""
    rows = _rows() if fmt != "openai-batch" else _batch_rows(CHAT_ENDPOINT, logprobs=True)
    first = encode_results(rows, fmt), encode_errors(rows, fmt)
    again = encode_results(rows[::-1], fmt), encode_errors(list(reversed(rows)), fmt)
    assert first == again


def test_read_results_names_a_missing_file(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="part-00000.jsonl"):
        read_results(OutputStore(str(tmp_path)), ["shards/part-00000.jsonl"], "jsonl")


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_prompt_logprobs_in_plain_output(tmp_path, fmt: str) -> None:
    """The entries are written as they are, after the fixed columns; Parquet reads them back
    equal, in the schema's column."""
    rows = [
        ResultRow(0, "r0", "hi", "stop", 3, 1, {"lang": "en"}, prompt_logprobs=_PROMPT_LOGPROBS),
        ResultRow(1, "r1", "yo", "stop", 1, 1, {"lang": "fr"}, prompt_logprobs=[None]),
    ]
    schema = OutputSchema.of([pa.field("lang", pa.string())]).with_prompt_logprobs()
    data_name, _ = shard_names(0, fmt)
    store = OutputStore(str(tmp_path))
    store.write_atomic(data_name, encode_results(rows, fmt, schema=schema))
    records = read_results(store, [data_name], fmt)
    assert [list(r) for r in records] == [[*FIXED_COLUMNS, "prompt_logprobs", "lang"]] * 2
    assert [r["prompt_logprobs"] for r in records] == [_PROMPT_LOGPROBS, [None]]
    if fmt == "parquet":
        assert pq.read_schema(tmp_path / data_name).equals(schema.schema, check_metadata=True)


def test_parquet_prompt_logprobs_need_the_column() -> None:
    row = ResultRow(0, "r0", "hi", "stop", 3, 1, prompt_logprobs=_PROMPT_LOGPROBS)
    with pytest.raises(ValueError, match="row 'r0' has prompt logprobs, but the job's Parquet"):
        encode_results([row], "parquet", schema=OutputSchema.of([]))
    # without a job schema, the shard's own has the column
    table = pq.read_table(pa.BufferReader(encode_results([row], "parquet")))
    assert table.column("prompt_logprobs").to_pylist() == [_PROMPT_LOGPROBS]
    # a schema with the column holds rows without prompt logprobs as nulls
    plain = ResultRow(1, "r1", "yo", "stop", 1, 1)
    schema = OutputSchema.of([]).with_prompt_logprobs()
    table = pq.read_table(pa.BufferReader(encode_results([plain], "parquet", schema=schema)))
    assert table.column("prompt_logprobs").to_pylist() == [None]


def test_openai_batch_prompt_logprobs_where_vllm_writes_them() -> None:
    """On every choice of a text_completion, on the body of a chat.completion; absent for
    rows that did not ask."""
    for endpoint in (COMPLETIONS_ENDPOINT, CHAT_ENDPOINT):
        row = replace(_batch_rows(endpoint)[0], prompt_logprobs=_PROMPT_LOGPROBS)
        two = replace(row, choices=(Choice("a", "stop", 1), Choice("b", "length", 1)))
        body = json.loads(encode_results([two], "openai-batch"))["response"]["body"]
        if endpoint == COMPLETIONS_ENDPOINT:
            assert "prompt_logprobs" not in body
            assert [c["prompt_logprobs"] for c in body["choices"]] == [_VLLM_PROMPT_LOGPROBS] * 2
        else:
            assert body["prompt_logprobs"] == _VLLM_PROMPT_LOGPROBS
            assert all("prompt_logprobs" not in c for c in body["choices"])
        plain = json.loads(encode_results(_batch_rows(endpoint)[:1], "openai-batch"))
        assert "prompt_logprobs" not in json.dumps(plain)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_logprobs_in_plain_output(tmp_path, fmt: str) -> None:
    """The entries are written as they are, after prompt_logprobs; Parquet reads them back
    equal, in the schema's column, and a row that did not ask holds null there."""
    rows = [
        ResultRow(0, "r0", "Hi!", "stop", 3, 2, {"lang": "en"}, logprobs=_LOGPROBS),
        ResultRow(
            1,
            "r1",
            "yo",
            "stop",
            1,
            1,
            {"lang": "fr"},
            logprobs=_LOGPROBS[:1],
            prompt_logprobs=[None],
        ),
        ResultRow(2, "r2", "", "length", 1, 0, {"lang": "de"}),
    ]
    schema = OutputSchema.of([pa.field("lang", pa.string())]).with_logprobs()
    schema = schema.with_prompt_logprobs()
    data_name, _ = shard_names(0, fmt)
    store = OutputStore(str(tmp_path))
    store.write_atomic(data_name, encode_results(rows, fmt, schema=schema))
    records = read_results(store, [data_name], fmt)
    assert [r.get("logprobs") for r in records] == [_LOGPROBS, _LOGPROBS[:1], None]
    if fmt == "parquet":
        names = [*FIXED_COLUMNS, "prompt_logprobs", "logprobs", "lang"]
        assert [list(r) for r in records] == [names] * 3
        assert pq.read_schema(tmp_path / data_name).equals(schema.schema, check_metadata=True)
    else:  # JSONL: the keys of what each row asked for, in the Parquet column order
        assert list(records[0]) == [*FIXED_COLUMNS, "logprobs", "lang"]
        assert list(records[1]) == [*FIXED_COLUMNS, "prompt_logprobs", "logprobs", "lang"]
        assert list(records[2]) == [*FIXED_COLUMNS, "lang"]


def test_parquet_logprobs_need_the_column() -> None:
    row = ResultRow(0, "r0", "Hi!", "stop", 3, 2, logprobs=_LOGPROBS)
    with pytest.raises(ValueError, match="row 'r0' has logprobs, but the job's Parquet schema "):
        encode_results([row], "parquet", schema=OutputSchema.of([]).with_prompt_logprobs())
    # without a job schema, the shard's own has the column
    table = pq.read_table(pa.BufferReader(encode_results([row], "parquet")))
    assert table.column_names[-1] == "logprobs"
    assert table.column("logprobs").to_pylist() == [_LOGPROBS]


def test_plain_logprobs_never_replace_a_passthrough_column() -> None:
    row = ResultRow(0, "r0", "Hi!", "stop", 3, 2, {"logprobs": "mine"}, logprobs=_LOGPROBS)
    with pytest.raises(ValueError, match="passthrough column 'logprobs' clashes"):
        encode_results([row], "jsonl")


def test_jsonl_lines_are_strict_json_whatever_the_floats() -> None:
    """NaN and infinities (from a Parquet input's doubles, or JSONL input's NaN literal)
    were written as the bare tokens NaN / Infinity, which strict parsers and polars refuse:
    they are null now, at any depth; finite floats are untouched."""
    nan, inf = float("nan"), float("inf")
    passthrough = {"score": nan, "hi": inf, "lo": -inf, "ok": 0.5, "deep": {"v": [1.0, nan]}}
    data = encode_results([ResultRow(0, "a", "t", "stop", 1, 1, passthrough=passthrough)], "jsonl")

    def refuse(token: str) -> None:
        raise AssertionError(f"not strict JSON: {token}")

    (line,) = [json.loads(x, parse_constant=refuse) for x in data.decode().splitlines()]
    assert [line[k] for k in ("score", "hi", "lo", "ok")] == [None, None, None, 0.5]
    assert line["deep"] == {"v": [1.0, None]}
