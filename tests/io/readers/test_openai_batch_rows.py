"""OpenAI Batch input: chat and completions lines, sampling mapping, every invalid kind."""

from __future__ import annotations

import pytest

from tests.io.readers.reader_files import batch_line, chat_body, read, summary, write_jsonl

COMPLETIONS = "/v1/completions"


def test_chat_line(tmp_path):
    body = chat_body(
        max_completion_tokens=32,
        temperature=0.5,
        top_p=0.9,
        stop="END",
        seed=7,
        presence_penalty=0.1,
        frequency_penalty=-0.2,
        logprobs=True,
        top_logprobs=4,
        user="u",
        stream=False,
        metadata={"k": "v"},
        store=False,
        n=1,
    )
    f = write_jsonl(tmp_path / "batch.jsonl", [batch_line("req-1", body)])
    (row,) = read(f)
    assert row.error is None
    assert (row.row_id, row.custom_id, row.endpoint) == ("req-1", "req-1", "/v1/chat/completions")
    assert row.messages == [{"role": "user", "content": "hi"}] and row.prompt is None
    assert row.sampling == {
        "max_tokens": 32,
        "temperature": 0.5,
        "top_p": 0.9,
        "stop": ["END"],
        "seed": 7,
        "presence_penalty": 0.1,
        "frequency_penalty": -0.2,
        "logprobs": 4,
    }


def test_completions_line(tmp_path):
    body = {"model": "m", "prompt": "Once", "max_tokens": 8, "logprobs": 2, "stop": ["a", "b"]}
    f = write_jsonl(tmp_path / "batch.jsonl", [batch_line("c1", body, COMPLETIONS)])
    (row,) = read(f)
    assert (row.prompt, row.messages, row.endpoint) == ("Once", None, COMPLETIONS)
    assert row.sampling == {"max_tokens": 8, "logprobs": 2, "stop": ["a", "b"]}


def test_n_and_logit_bias(tmp_path):
    """n > 1 and a logit_bias reach SamplingParams (token ids as ints); n=1 asks for nothing,
    and an empty bias for none (overriding the job's)."""
    lines = [
        batch_line("a", chat_body(n=3, logit_bias={"50256": -100, "7": 2.5})),
        batch_line("b", {"prompt": "p", "n": 2, "logit_bias": {"1": 100}}, COMPLETIONS),
        batch_line("c", chat_body(n=1, logit_bias={})),
    ]
    rows = read(write_jsonl(tmp_path / "b.jsonl", lines))
    assert rows[0].sampling == {"n": 3, "logit_bias": {50256: -100.0, 7: 2.5}}
    assert rows[1].sampling == {"n": 2, "logit_bias": {1: 100.0}}
    assert rows[2].sampling == {"logit_bias": None}


def test_explicit_empty_values_override_the_jobs(tmp_path):
    """stop [], response_format text, logit_bias {} and logprobs false left the job's own
    stop strings, constraint, bias and logprobs in force."""
    body = chat_body(stop=[], response_format={"type": "text"}, logit_bias={}, logprobs=False)
    (row,) = read(write_jsonl(tmp_path / "b.jsonl", [batch_line("a", body)]))
    assert row.sampling == {
        "stop": [], "structured_output": None, "logit_bias": None, "logprobs": None
    }  # fmt: skip


def test_null_keys_of_response_format_read_as_absent(tmp_path):
    """A response_format key set to null reads as absent, as a body's own null fields do:
    serializers of OpenAI's union type (pydantic, pyarrow) write the other kinds' keys as
    null (each was a row error, "takes no json_schema")."""
    schema = {"type": "object"}
    lines = [
        batch_line("a", chat_body(response_format={"type": "text", "json_schema": None})),
        batch_line("b", chat_body(response_format={"type": "json_object", "json_schema": None})),
        batch_line(
            "c",
            chat_body(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": schema, "strict": None, "x": None},
                }
            ),
        ),
    ]
    rows = read(write_jsonl(tmp_path / "b.jsonl", lines))
    assert [r.error for r in rows] == [None] * 3
    assert [r.sampling["structured_output"] for r in rows] == [None, "json_object", schema]


def test_harmless_fields_clients_send_are_accepted(tmp_path):
    lines = [
        batch_line("a", chat_body(service_tier="auto", modalities=["text"])),
        batch_line("b", {"prompt": "p", "echo": False}, COMPLETIONS),
        batch_line("c", {"prompt": ["one prompt"]}, COMPLETIONS),
        # OpenAI's successors of user, and the tool settings' defaults with no tools (each
        # was a row error)
        batch_line("d", chat_body(safety_identifier="u1", prompt_cache_key="k")),
        batch_line("e", chat_body(tool_choice="none", parallel_tool_calls=True)),
        batch_line("f", chat_body(tool_choice="auto")),
    ]
    rows = read(write_jsonl(tmp_path / "b.jsonl", lines))
    assert [r.error for r in rows][:5] == [None] * 5 and rows[2].prompt == "one prompt"
    assert "body.tool_choice='auto' is not supported" in rows[5].error


def test_best_of_and_prompt_logprobs(tmp_path):
    """best_of (completions; kept when it equals n, as it overrides the job's) and
    prompt_logprobs (both endpoints) reach SamplingParams; a chat body's best_of: 1 is the
    no-op OpenAI's default is, and is ignored."""
    lines = [
        batch_line("a", {"prompt": "p", "n": 2, "best_of": 5, "prompt_logprobs": 3}, COMPLETIONS),
        batch_line("b", {"prompt": "p", "best_of": 1.0}, COMPLETIONS),
        batch_line("c", chat_body(prompt_logprobs=0, best_of=1)),
    ]
    rows = read(write_jsonl(tmp_path / "b.jsonl", lines))
    assert rows[0].sampling == {"n": 2, "best_of": 5, "prompt_logprobs": 3}
    assert rows[1].sampling == {"best_of": 1}
    assert rows[2].sampling == {"prompt_logprobs": 0}


def test_whole_floats_count_as_integers_in_every_integer_field(tmp_path):
    """A whole float (``5.0``) is its integer in every integer field, as JSON Schema's
    "integer" and OpenAI's and vLLM's servers take it: pandas writes every number of a
    column holding a null as a float. max_tokens, seed, top_logprobs, logprobs and
    prompt_logprobs refused 5.0 while n and best_of took it."""
    chat = chat_body(
        max_tokens=5.0, seed=3.0, n=2.0, logprobs=True, top_logprobs=2.0, prompt_logprobs=1.0
    )
    completion = {"prompt": "p", "max_completion_tokens": 5.0, "logprobs": 2.0, "best_of": 3.0}
    lines = [
        batch_line("a", chat),
        batch_line(
            "b", {**completion, "max_completion_tokens": None, "max_tokens": 7.0}, COMPLETIONS
        ),
        batch_line("c", chat_body(max_tokens=5.0, max_completion_tokens=5, best_of=1.0)),
    ]
    rows = read(write_jsonl(tmp_path / "b.jsonl", lines))
    assert [r.error for r in rows] == [None] * 3
    assert rows[0].sampling == {
        "max_tokens": 5, "seed": 3, "n": 2, "logprobs": 2, "prompt_logprobs": 1
    }  # fmt: skip
    assert rows[1].sampling == {"max_tokens": 7, "logprobs": 2, "best_of": 3}
    assert rows[2].sampling == {"max_tokens": 5}
    assert all(type(v) is int for r in rows for v in r.sampling.values())


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "seed", "n",
                                   "top_logprobs", "prompt_logprobs"])  # fmt: skip
@pytest.mark.parametrize(
    ("value", "message"),
    [
        (2.5, "must be an integer"),
        (True, "must be an integer"),
        (1e20, "got the float 1e+20: past 2**53 a float may not be the integer written"),
    ],
)
def test_a_fraction_a_bool_or_an_inexact_float_is_a_bad_row(tmp_path, field, value, message):
    body = chat_body(**{field: value}, **({"logprobs": True} if field == "top_logprobs" else {}))
    (row,) = read(write_jsonl(tmp_path / "b.jsonl", [batch_line("bad", body)]))
    assert row.error is not None and f"body.{field} " in row.error, row.error
    assert message in row.error and "bad" in row.row_id, row.error
    if value is not True:
        assert repr(value) in row.error, row.error  # the value as given, not as converted


def test_chat_logprobs_without_top_logprobs_is_zero_and_false_is_none(tmp_path):
    lines = [batch_line("a", chat_body(logprobs=True)), batch_line("b", chat_body(logprobs=False))]
    rows = read(write_jsonl(tmp_path / "b.jsonl", lines))
    assert rows[0].sampling == {"logprobs": 0} and rows[1].sampling == {"logprobs": None}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_tokens", 0, "body.max_tokens must be an integer >= 1, got 0"),
        ("max_tokens", -3, "body.max_tokens"),
        ("max_tokens", 2.5, "body.max_tokens"),
        ("max_tokens", 2**63, "body.max_tokens must be at most 2**31 - 1, got 9223"),  # crashed
        ("max_completion_tokens", 0, "body.max_completion_tokens"),
        ("temperature", -0.1, "body.temperature must be a number >= 0"),
        ("temperature", "hot", "body.temperature"),
        ("temperature", True, "body.temperature"),
        ("top_p", 0, "body.top_p must be in (0, 1]"),
        ("top_p", 1.5, "body.top_p"),
        ("presence_penalty", 2.5, "body.presence_penalty must be in [-2, 2]"),
        ("frequency_penalty", -3, "body.frequency_penalty"),
        ("seed", 1.5, "body.seed must be an integer"),
        ("seed", "7", "body.seed"),
        ("seed", 2**64, "body.seed must be an integer in [-9223372036854775808, 9223"),  # as 0
        ("stop", ["ok", 3], "body.stop"),
        ("stop", "", "body.stop"),
        ("logprobs", 3, "body.logprobs must be true or false"),
        ("top_logprobs", 21, "body.top_logprobs must be an integer in [0, 20], got 21"),
        ("top_logprobs", 2, "needs body.logprobs: true"),
        ("n", 0, "body.n must be an integer in [1, 128], got 0"),
        ("n", 129, "body.n must be an integer in [1, 128], got 129"),
        ("n", True, "body.n"),
        ("tools", [{"type": "function"}], "body.tools="),
        ("response_format", {"type": "xml"}, "body.response_format must be"),
        ("best_of", 3, "body.best_of=3 is not supported for /v1/chat/completions (only "),
        ("prompt_logprobs", -1, "body.prompt_logprobs must be an integer in [0, 20], got -1"),
        ("prompt_logprobs", 21, "body.prompt_logprobs must be an integer in [0, 20], got 21"),
        ("prompt_logprobs", True, "body.prompt_logprobs"),
        ("logit_bias", {"50256": -101}, "body.logit_bias: the bias of token '50256' must be"),
        ("logit_bias", {"a1": 1}, "body.logit_bias: key 'a1' is not a token id"),
        ("logit_bias", [1, 2], "body.logit_bias: expected a mapping of token id to bias"),
        ("stream", True, "body.stream must be false"),
        ("temprature", 1, "body.temprature is not supported"),
        ("prompt", "x", "body.prompt is not supported"),
    ],
)
def test_invalid_chat_parameter_is_a_bad_row(tmp_path, field, value, message):
    lines = [
        batch_line("good-1", chat_body()),
        batch_line("bad", chat_body(**{field: value})),
        batch_line("good-2", chat_body()),
    ]
    rows = read(write_jsonl(tmp_path / "b.jsonl", lines))
    assert summary(rows) == [(0, "good-1", True), (1, "bad", False), (2, "good-2", True)]
    assert message in rows[1].error, rows[1].error
    assert rows[1].source == f"{tmp_path / 'b.jsonl'}:2"
    assert not rows[1].error.startswith(str(tmp_path))  # the location is added once, later
    assert (rows[1].custom_id, rows[1].endpoint) == ("bad", "/v1/chat/completions")


@pytest.mark.parametrize("prompt", [[15, 0, 7], [[15, 0, 7]]])
def test_completions_prompt_as_token_ids(tmp_path, prompt):
    f = write_jsonl(tmp_path / "b.jsonl", [batch_line("ids", {"prompt": prompt}, COMPLETIONS)])
    (row,) = read(f)
    assert row.error is None
    assert (row.prompt_token_ids, row.prompt, row.messages) == ((15, 0, 7), None, None)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt": ["a", "b"]}, "only one prompt per line is supported"),
        ({"prompt": [[1, 2], [3]]}, "only one prompt per line is supported"),
        ({"prompt": [1, -2]}, "a list of token ids (integers from 0 to 2147483647), got [1, -2]"),
        ({"prompt": [2**63]}, "a list of token ids (integers from 0 to 2147483647)"),
        ({"prompt": [1, True]}, "token ids (integers from 0 to 2147483647), got [1, True]"),
        ({"prompt": [1.0]}, "token ids (integers from 0 to 2147483647), got [1.0]"),
        ({"prompt": []}, "missing prompt"),
        ({"prompt": [[]]}, "missing prompt"),
        ({"prompt": "x", "modalities": ["text", "audio"]}, "body.modalities"),
        ({"prompt": ""}, "missing prompt"),
        ({}, "missing prompt"),
        ({"prompt": "x", "logprobs": 21}, "body.logprobs must be an integer in [0, 20]"),
        ({"prompt": "x", "logprobs": True}, "body.logprobs"),
        ({"prompt": "x", "best_of": 0}, "body.best_of must be an integer in [1, 128], got 0"),
        ({"prompt": "x", "best_of": 129}, "body.best_of must be an integer in [1, 128], got 129"),
        ({"prompt": "x", "best_of": True}, "body.best_of must be an integer in [1, 128], got True"),
        ({"prompt": "x", "n": 3, "best_of": 2}, "body.best_of=2 is less than body.n=3"),
        ({"prompt": "x", "prompt_logprobs": -1}, "body.prompt_logprobs must be an integer in"),
        ({"prompt": "x", "max_tokens": 4, "echo": True}, "body.echo=True is not supported"),
        ({"prompt": "x", "top_logprobs": 2}, "body.top_logprobs is not supported"),
    ],
)
def test_invalid_completions_line_is_a_bad_row(tmp_path, body, message):
    lines = [
        batch_line("good", {"prompt": "ok"}, COMPLETIONS),
        batch_line("bad", body, COMPLETIONS),
    ]
    rows = read(write_jsonl(tmp_path / "b.jsonl", lines))
    assert summary(rows) == [(0, "good", True), (1, "bad", False)]
    assert message in rows[1].error, rows[1].error


@pytest.mark.parametrize(
    ("line", "row_id", "message"),
    [
        ({"method": "POST", "url": "/v1/completions", "body": {}}, "b.jsonl:2", "custom_id"),
        ({**batch_line("x", chat_body()), "custom_id": 5}, "b.jsonl:2", "custom_id"),
        ({**batch_line("x", chat_body()), "method": "GET"}, "x", 'method must be "POST"'),
        ({**batch_line("x", chat_body()), "url": "/v1/embeddings"}, "x", "is not supported"),
        ({**batch_line("x", chat_body()), "body": "text"}, "x", "body must be an object"),
        (batch_line("x", {"messages": []}), "x", "body.messages must be a non-empty list"),
        (batch_line("x", chat_body(max_tokens=3, max_completion_tokens=4)), "x", "disagree"),
        (batch_line("first", chat_body()), "b.jsonl:2", "duplicate id 'first'"),
        ("[1, 2]", "b.jsonl:2", "expected a JSON object"),
    ],
)
def test_invalid_envelope_is_a_bad_row(tmp_path, line, row_id, message):
    lines = [batch_line("first", chat_body()), line, batch_line("last", chat_body())]
    rows = read(write_jsonl(tmp_path / "b.jsonl", lines), format="openai-batch")
    assert summary(rows) == [(0, "first", True), (1, row_id, False), (2, "last", True)]
    assert message in rows[1].error, rows[1].error


def test_duplicate_custom_id_across_files(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [batch_line("r", chat_body())])
    write_jsonl(tmp_path / "b.jsonl", [batch_line("r", chat_body()), batch_line("s", chat_body())])
    rows = read(tmp_path)
    assert summary(rows) == [(0, "r", True), (1, "b.jsonl:1", False), (2, "s", True)]
