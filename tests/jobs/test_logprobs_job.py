"""Completion ``logprobs`` through whole jobs: job.yaml's ``sampling.logprobs`` for every row
in JSONL and Parquet output (a column of the job's one Parquet schema), an OpenAI Batch
body's own in JSONL output and, for Parquet, only with the job's column; every choice's own
in OpenAI Batch output. All equal to what ``LLM.generate`` / ``LLM.chat`` give."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import duckdb
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from tests.jobs.job_helpers import (
    CHAT_URL,
    COMPLETIONS_URL,
    batch_job,
    batch_line,
    chat_rows,
    job_dict,
    read_jsonl_dir,
    write_jsonl,
)
from tests.jobs.logprob_entries import TOL, check_entry
from tokenmill import LLM, SamplingParams, run_job
from tokenmill.engine.outputs import CompletionOutput
from tokenmill.io.logprobs_column import LOGPROBS_FIELD
from tokenmill.io.output_schema import OutputSchema
from tokenmill.jobs.dry_run import dry_run
from tokenmill.jobs.spec import JobSpec, JobSpecError


def _check_entries(got: list[Any], want: CompletionOutput, llm: LLM, k: int) -> None:
    """A job's logprobs entries against the engine's own for that completion, token by
    token."""
    assert want.logprobs is not None
    assert len(got) == len(want.token_ids) == len(want.logprobs) > 0
    for entry, lp, token in zip(got, want.logprobs, want.token_ids, strict=True):
        check_entry(entry, lp, token, llm.tokenizer.decode, k)


def _read_as_one_dataset(shards: Path) -> list[dict[str, Any]]:
    """The Parquet shards read by pyarrow.dataset and duckdb, no options; both must agree."""
    files = sorted(shards.glob("*.parquet"))
    assert len(files) > 1, "the job should write several shards"
    schemas = [pq.read_schema(f) for f in files]
    assert all(s.equals(schemas[0], check_metadata=True) for s in schemas)
    by_arrow = sorted(ds.dataset(shards).to_table().to_pylist(), key=lambda r: r["id"])
    result = duckdb.connect().sql(f"SELECT * FROM '{shards}/*.parquet' ORDER BY id")
    by_duckdb = [dict(zip(result.columns, row, strict=True)) for row in result.fetchall()]
    assert by_arrow == by_duckdb
    return by_arrow


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_job_yaml_logprobs_equal_the_python_apis(
    tiny_model: Path, llm: LLM, tmp_path: Path, fmt: str
) -> None:
    rows = chat_rows(6)  # two shards of 4 and 2
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    sampling = {"logprobs": 2}
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out, sampling=sampling, output={"format": fmt})
    report = run_job(spec, show_progress=False)
    assert (report.status, report.rows_ok, report.rows_failed) == ("complete", 6, 0)
    if fmt == "parquet":
        written = _read_as_one_dataset(out / "shards")
        table = ds.dataset(out / "shards").to_table()
        assert table.schema.field("logprobs").equals(LOGPROBS_FIELD, check_metadata=True)
        assert table.schema.names[-2:] == ["logprobs", "topic"]
        manifest = json.loads((out / "test.manifest.json").read_text())
        assert OutputSchema.from_record(manifest["output_schema"]).has_logprobs  # resumes keep it
    else:
        written = read_jsonl_dir(out / "shards")
        assert all(list(r)[-2:] == ["logprobs", "topic"] for r in written)
    by_id = {r["id"]: r for r in written}
    want = llm.chat(
        [r["messages"] for r in rows], SamplingParams(max_tokens=8, temperature=0, **sampling)
    )
    for row, ref in zip(rows, want, strict=True):
        got = by_id[row["id"]]
        assert (got["text"], got["completion_tokens"]) == (ref.text, len(ref.token_ids))
        _check_entries(got["logprobs"], ref.outputs[0], llm, k=2)


def test_openai_batch_bodies_logprobs_in_jsonl_output(
    tiny_model: Path, llm: LLM, tmp_path: Path
) -> None:
    """Chat's logprobs: true + top_logprobs, completions' logprobs: k; a row that did not ask
    has no logprobs key."""
    messages = [{"role": "user", "content": "name three colours"}]
    prompt = "Once upon a time"
    lines = [
        batch_line("chat", CHAT_URL, {"messages": messages, "logprobs": True, "top_logprobs": 2}),
        batch_line("chat-0", CHAT_URL, {"messages": messages, "max_tokens": 3, "logprobs": True}),
        batch_line("comp", COMPLETIONS_URL, {"prompt": prompt, "max_tokens": 5, "logprobs": 2}),
        batch_line("plain", CHAT_URL, {"messages": messages, "logprobs": False}),
    ]
    spec = batch_job(tiny_model, lines, tmp_path, "jsonl")
    report = run_job(spec, show_progress=False)
    assert (report.rows_ok, report.rows_failed) == (4, 0)
    written = {r["id"]: r for r in read_jsonl_dir(tmp_path / "out" / "shards")}

    ref = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0, logprobs=2))[0]
    assert written["chat"]["text"] == ref.text
    _check_entries(written["chat"]["logprobs"], ref.outputs[0], llm, k=2)
    ref = llm.chat(messages, SamplingParams(max_tokens=3, temperature=0, logprobs=0))[0]
    _check_entries(written["chat-0"]["logprobs"], ref.outputs[0], llm, k=0)
    ref = llm.generate(prompt, SamplingParams(max_tokens=5, temperature=0, logprobs=2))[0]
    assert written["comp"]["text"] == ref.text
    _check_entries(written["comp"]["logprobs"], ref.outputs[0], llm, k=2)
    assert "logprobs" not in written["plain"]


def test_openai_batch_output_has_each_choices_own_logprobs(
    tiny_model: Path, llm: LLM, tmp_path: Path
) -> None:
    """sampling.logprobs reaches OpenAI Batch output too, in OpenAI's shapes: a chat choice's
    logprobs.content, and each of n sampled text completions its own."""
    messages = [{"role": "user", "content": "name three colours"}]
    prompt = "Once upon a time"
    comp = {"max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 2}
    lines = [
        batch_line("chat", CHAT_URL, {"messages": messages, "max_tokens": 4}),
        batch_line("comp", COMPLETIONS_URL, {"prompt": prompt, **comp}),
    ]
    spec = batch_job(tiny_model, lines, tmp_path, "openai-batch")
    spec["sampling"]["logprobs"] = 1
    assert run_job(spec, show_progress=False).rows_ok == 2
    bodies = {
        x["custom_id"]: x["response"]["body"] for x in read_jsonl_dir(tmp_path / "out" / "shards")
    }
    decode = llm.tokenizer.decode

    chat = ChatCompletion.model_validate(bodies["chat"])
    ref = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0, logprobs=1))[0]
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content
    content = chat.choices[0].logprobs.content
    assert ref.logprobs is not None and len(content) == len(ref.logprobs)
    for entry, lp in zip(content, ref.logprobs, strict=True):
        assert entry.token == decode([lp.token_id])
        assert entry.logprob == pytest.approx(lp.logprob, abs=TOL)
        assert [t.token for t in entry.top_logprobs] == [decode([t]) for t in lp.top]

    completion = Completion.model_validate(bodies["comp"])
    ref = llm.generate(prompt, SamplingParams(**comp, logprobs=1))[0]
    assert len(completion.choices) == len(ref.outputs) == 2
    for choice, want in zip(completion.choices, ref.outputs, strict=True):
        assert choice.text == want.text and choice.logprobs is not None and want.logprobs
        assert choice.logprobs.tokens == [decode([t]) for t in want.token_ids]
        assert choice.logprobs.token_logprobs == pytest.approx(
            [lp.logprob for lp in want.logprobs], abs=TOL
        )
        offsets = choice.logprobs.text_offset
        assert offsets is not None and len(offsets) == len(choice.logprobs.tokens)
        assert [choice.text[a:b] for a, b in zip(offsets, [*offsets[1:], None], strict=True)] == (
            choice.logprobs.tokens
        )


def test_a_rows_logprobs_need_the_jobs_parquet_column(
    tiny_model: Path, llm: LLM, tmp_path: Path
) -> None:
    """Parquet's schema is fixed before the first shard: a body asking for logprobs is a row
    error unless the job's sampling section asks too; then its own k applies."""
    messages = [{"role": "user", "content": "name three colours"}]
    prompt, own = "Once upon a time", {"max_tokens": 3, "logprobs": 3}
    lines = [
        batch_line("asks", COMPLETIONS_URL, {"prompt": prompt, **own}),
        batch_line(
            "chat-asks", CHAT_URL, {"messages": messages, "logprobs": True, "top_logprobs": 2}
        ),
        batch_line("plain", COMPLETIONS_URL, {"prompt": "Once"}),
    ]
    spec = batch_job(tiny_model, lines, tmp_path / "without", "parquet")
    assert run_job(spec, show_progress=False).rows_failed == 2
    errors = {e["id"]: e["error"] for e in read_jsonl_dir(tmp_path / "without" / "out" / "errors")}
    assert sorted(errors) == ["asks", "chat-asks"]
    for message in errors.values():
        assert "has no logprobs column; set sampling.logprobs in the job spec" in message
    assert "logprobs=3 asks for the completion's logprobs" in errors["asks"]
    assert dry_run(JobSpec.from_dict(spec)).bad_rows == 2

    spec = batch_job(tiny_model, lines, tmp_path / "with", "parquet")
    spec["sampling"].update(logprobs=1, prompt_logprobs=0)  # both columns, in their order
    assert run_job(spec, show_progress=False).rows_ok == 3
    table = ds.dataset(tmp_path / "with" / "out" / "shards").to_table()
    assert table.schema.names[-2:] == ["prompt_logprobs", "logprobs"]
    written = {r["id"]: r for r in table.to_pylist()}
    ref = llm.generate(prompt, SamplingParams(temperature=0, **own))[0]
    _check_entries(written["asks"]["logprobs"], ref.outputs[0], llm, k=3)
    ref = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0, logprobs=2))[0]
    _check_entries(written["chat-asks"]["logprobs"], ref.outputs[0], llm, k=2)
    ref = llm.generate("Once", SamplingParams(max_tokens=8, temperature=0, logprobs=1))[0]
    _check_entries(written["plain"]["logprobs"], ref.outputs[0], llm, k=1)


@pytest.mark.parametrize(
    ("column", "setting"),
    [("logprobs", "logprobs"), ("Logprobs", "logprobs"), ("PROMPT_logprobs", "prompt_logprobs")],
)
def test_a_passthrough_column_named_logprobs_is_refused(
    tiny_model: Path, tmp_path: Path, column: str, setting: str
) -> None:
    """Case too: duckdb renamed a passthrough "Logprobs" to "Logprobs_1", and gave the
    generated logprobs for "Logprobs"."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(1))
    clash = job_dict(tiny_model, src, tmp_path / "out", sampling={setting: 0})
    clash["input"]["passthrough_columns"] = [column]
    want = f"input.passthrough_columns: '{column}' would overwrite the output column '{setting}'"
    with pytest.raises(JobSpecError, match=want):
        run_job(clash, show_progress=False)


@pytest.mark.parametrize("column", ["logprobs", "Prompt_Logprobs"])
def test_openai_batch_input_refuses_a_passthrough_column_a_body_may_overwrite(
    tiny_model: Path, tmp_path: Path, column: str
) -> None:
    """A body asking for logprobs writes the column though the job's sampling does not: the
    row was computed and then failed ("clashes"), and the column meant two things."""
    line = batch_line("a", CHAT_URL, {"messages": [{"role": "user", "content": "hi"}]})
    spec = batch_job(tiny_model, [{**line, column: "mine"}], tmp_path, fmt="jsonl")
    spec["input"]["passthrough_columns"] = [column]
    want = f"'{column}' would overwrite the output column '{column.lower()}' \\(a body may"
    with pytest.raises(JobSpecError, match=want):
        run_job(spec, show_progress=False)


def test_openai_batch_output_refuses_passthrough_columns(tiny_model: Path, tmp_path: Path) -> None:
    """Its lines have no place for them: they were dropped without a word (exit 0)."""
    line = batch_line("a", CHAT_URL, {"messages": [{"role": "user", "content": "hi"}]})
    spec = batch_job(tiny_model, [{**line, "tenant": "t1"}], tmp_path)
    spec["input"]["passthrough_columns"] = ["tenant"]
    with pytest.raises(JobSpecError, match="OpenAI Batch output lines hold the custom_id"):
        run_job(spec, show_progress=False)


def test_sentencepiece_tokens_keep_their_space_and_offsets_point_into_the_text() -> None:
    """Decoded alone, '▁the' is 'the': the tokens did not join to the text and every
    text_offset after the first pointed at the wrong place."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tokenmill.engine.outputs import TokenLogprob
    from tokenmill.io.logprobs_column import openai_completion_logprobs
    from tokenmill.jobs.requests import _logprobs

    vocab = {"<unk>": 0, "▁Hello": 1, "▁a": 2, "▁the": 3}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    ids = [1, 2, 3, 3]
    text = tokenizer.decode(ids)
    assert text == "Hello a the the"
    entries = _logprobs(
        [TokenLogprob(t, -0.5, 1, {t: -0.5, 2: -1.0}) for t in ids], tokenizer, True
    )
    assert entries is not None
    assert [e["token"] for e in entries] == [" Hello", " a", " the", " the"]
    legacy = openai_completion_logprobs(entries, text)
    assert legacy["text_offset"] == [0, 5, 7, 11]
    pairs = list(zip(legacy["tokens"], legacy["text_offset"], strict=True))
    assert all(text[o : o + len(t)] == t for t, o in pairs[1:])  # the first lost its space


def test_legacy_logprobs_after_a_stop_string_and_for_alike_alternatives() -> None:
    """A stop string cut the text to a suffix of the joined tokens: the offsets still add
    up from 0 (they collapsed to 0 when that was taken for SentencePiece's dropped space).
    Alternatives decoding alike (two halves of one character) keep the likeliest's
    logprob under their one key (the least likely's overwrote it)."""
    from tokenmill.io.logprobs_column import openai_completion_logprobs

    def entry(token: str, top: list[tuple[str, float]]) -> dict:
        return {"token": token, "logprob": top[0][1], "rank": 1,
                "top_logprobs": [{"token": t, "logprob": v} for t, v in top]}  # fmt: skip

    entries = [entry("b", [("b", -0.1)]),
               entry("\ufffd", [("\ufffd", -0.02), ("\ufffd", -5.3)]),
               entry("b", [("b", -0.3)])]  # fmt: skip
    legacy = openai_completion_logprobs(entries, "b")  # stop: ["ab"]
    assert legacy["text_offset"] == [0, 1, 2]
    assert legacy["top_logprobs"][1] == {"\ufffd": -0.02}


def test_logprob_tokens_are_decoded_as_the_text_is(tiny_model: Path) -> None:
    """A special token is in the text only with skip_special_tokens=False: so in the
    logprob tokens (with it in, the offsets pointed past the text)."""
    from transformers import AutoTokenizer

    from tokenmill.engine.outputs import TokenLogprob
    from tokenmill.jobs.requests import _logprobs

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    special = tokenizer.convert_tokens_to_ids("<s>")
    plain = tokenizer.encode("b", add_special_tokens=False)[0]
    lps = [TokenLogprob(t, -0.5, 1, {t: -0.5}) for t in (special, plain)]
    for skip in (True, False):
        entries = _logprobs(lps, tokenizer, skip)
        assert entries is not None
        text = tokenizer.decode([special, plain], skip_special_tokens=skip)
        assert "".join(e["token"] for e in entries) == text


def test_token_bytes_join_to_the_text_where_characters_span_tokens(tiny_model: Path) -> None:
    """Byte-level tokens of one emoji each decode to "\\ufffd"; their bytes, joined, give the
    text back (OpenAI's ``bytes``); special tokens follow skip_special_tokens; a tokenizer of
    another kind gets None, not a guess."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from tokenmill.io.logprobs_column import openai_chat_logprobs, openai_completion_logprobs
    from tokenmill.jobs.token_bytes import token_bytes

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    text = "é🌍 ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    special = tokenizer.convert_tokens_to_ids("<s>")
    raw = token_bytes(tokenizer, [*ids, special], skip_special_tokens=True)
    assert b"".join(raw[t] for t in ids).decode() == text and raw[special] == b""
    assert token_bytes(tokenizer, [special], skip_special_tokens=False)[special] == b"<s>"
    entries = [{"token_id": t, "token": tokenizer.decode([t]), "logprob": -0.1, "rank": 1,
                "bytes": list(raw[t]), "top_logprobs": [{"token_id": t, "token": "x",
                "logprob": -0.1, "bytes": list(raw[t])}]} for t in ids]  # fmt: skip
    content = (
        ChatCompletion.model_validate(
            {
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "logprobs": openai_chat_logprobs(entries),
                        "message": {"role": "assistant", "content": text},
                    }
                ],
            }  # fmt: skip
        )
        .choices[0]
        .logprobs
    )
    assert content is not None and content.content is not None
    assert bytes(b for e in content.content for b in e.bytes or []).decode() == text
    # text_offset counts the whole characters before each token
    offsets = openai_completion_logprobs(entries, text)["text_offset"]
    assert [text[o] for o in offsets if o < len(text)][:2] == ["é", "é"]
    assert offsets[-1] == len(text) - 1

    vocab = {"<unk>": 0, "▁a": 1}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    other = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    assert token_bytes(other, [1], skip_special_tokens=True) == {1: None}


def test_text_offset_after_a_byte_the_next_token_shows_invalid() -> None:
    """An audit: a lead byte alone (held back as a character's beginning) that the next
    token's byte shows invalid is that token's "\ufffd", before the next one; the offsets
    after it were one short ([0, 0, 2, 3, 3] where the tokens start at 0 .. 4). A character
    split over tokens still starts every token of it where it starts."""
    from tokenmill.io.logprobs_column import openai_completion_logprobs

    def entries(parts: list[bytes]) -> list[dict]:
        return [{"token": p.decode(errors="replace"), "logprob": -1.0, "bytes": list(p),
                 "top_logprobs": []} for p in parts]  # fmt: skip

    invalid = [b"\xe2", b'"', b"H", b"\xe2", b'"']
    text = b"".join(invalid).decode(errors="replace")  # '\ufffd"H\ufffd"'
    offsets = openai_completion_logprobs(entries(invalid), text)["text_offset"]
    assert offsets == [0, 1, 2, 3, 4] and [text[o] for o in offsets] == list(text)
    split = [b"a", b"\xe2\x82", b"\xac", b"b"]  # 'a€b', the euro sign over two tokens
    assert openai_completion_logprobs(entries(split), "a€b")["text_offset"] == [0, 1, 1, 2]
