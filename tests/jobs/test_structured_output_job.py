"""Structured output through whole jobs: OpenAI Batch ``response_format`` and job.yaml's
``sampling.structured_output``; the output lines parse with the ``openai`` package's own types
and every JSON answer validates against its schema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.engine.test_structured_output import validate
from tests.jobs.job_helpers import chat_rows, job_dict, read_jsonl_dir, write_jsonl
from tokenmill import run_job
from tokenmill.jobs.cli import main as cli_main

CHAT = "/v1/chat/completions"
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no"]},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "confidence"],
    "additionalProperties": False,
}


def _line(cid: str, body: dict[str, Any], url: str = CHAT) -> dict[str, Any]:
    if url == CHAT:
        body = {"messages": [{"role": "user", "content": f"Is {cid} ok?"}], **body}
    else:
        body = {"prompt": f"Is {cid} ok? Answer:", **body}
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"max_tokens": 48, **body}}


def _json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": "verdict", "schema": schema, "strict": True},
    }


def test_openai_batch_response_format(tiny_model: Path, tmp_path: Path) -> None:
    openai_types = pytest.importorskip("openai.types")
    lines = [
        _line("schema-greedy", {"temperature": 0, "response_format": _json_schema(SCHEMA)}),
        _line(
            "schema-seeded", {"temperature": 1, "seed": 3, "response_format": _json_schema(SCHEMA)}
        ),
        _line("object", {"max_tokens": 6, "response_format": {"type": "json_object"}}),
        _line("text", {"response_format": {"type": "text"}, "max_tokens": 4}),
        _line("completion", {"response_format": _json_schema(SCHEMA)}, "/v1/completions"),
        _line("bad-schema", {"response_format": _json_schema({"type": "objectx"})}),
        _line("bad-format", {"response_format": {"type": "xml"}}),
        _line("bad-keys", {"response_format": {**_json_schema(SCHEMA), "schema": SCHEMA}}),
    ]
    src = write_jsonl(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out, output={"format": "openai-batch"})
    spec["input"] = {"path": str(src), "format": "auto"}
    report = run_job(spec, show_progress=False)
    assert report.status == "complete" and (report.rows_ok, report.rows_failed) == (5, 3)

    ok = {r["custom_id"]: r["response"]["body"] for r in read_jsonl_dir(out / "shards")}
    chat_ids = set(ok) - {"completion"}
    chats = {cid: openai_types.chat.ChatCompletion.model_validate(ok[cid]) for cid in chat_ids}
    for cid in ("schema-greedy", "schema-seeded"):
        choice = chats[cid].choices[0]
        assert choice.finish_reason == "stop"
        validate(choice.message.content, SCHEMA)
    assert chats["object"].choices[0].message.content.startswith("{")
    completion = openai_types.Completion.model_validate(ok["completion"])
    assert completion.choices[0].finish_reason == "stop"
    validate(completion.choices[0].text, SCHEMA)

    errors = {r["custom_id"]: r["error"]["message"] for r in read_jsonl_dir(out / "errors")}
    assert set(errors) == {"bad-schema", "bad-format", "bad-keys"}
    assert "body.response_format: " in errors["bad-schema"] and "objectx" in errors["bad-schema"]
    assert "body.response_format must be" in errors["bad-format"]
    assert "body.response_format of type 'json_schema' takes no schema" in errors["bad-keys"]
    assert all(message.startswith(f"{src}:") for message in errors.values())  # file:line


def test_job_yaml_structured_output_applies_to_every_row(tiny_model: Path, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(5))
    sampling = {"max_tokens": 48, "temperature": 0.7, "structured_output": {"json_schema": SCHEMA}}
    texts = {}
    for processes in (0, 2):  # engine.structured_output_processes: the same rows either way
        out = tmp_path / f"out{processes}"
        engine = {"structured_output_processes": processes}
        spec = job_dict(tiny_model, src, out, sampling=sampling, engine=engine)
        report = run_job(spec, show_progress=False)
        assert report.status == "complete" and report.rows_ok == 5
        rows = read_jsonl_dir(out / "shards")
        assert len(rows) == 5
        for row in rows:
            assert row["finish_reason"] == "stop"
            validate(row["text"], SCHEMA)
        texts[processes] = sorted(row["text"] for row in rows)
    assert texts[2] == texts[0]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"json_schema": {"type": "objectx"}}, "json_schema: cannot compile this JSON schema"),
        (
            {"schema": SCHEMA},
            "expected json_object or a mapping with one key: {json_schema: <JSON Schema>}, "
            "{regex: <pattern>} or {choice: [<string>, ...]}; got a mapping with keys ['schema']",
        ),
        ("{not json", "not JSON"),
        ({"regex": "(ab"}, "regex: cannot compile this regex '(ab': unclosed group"),
        ({"regex": ""}, "regex must be a non-empty regular expression"),
        ({"choice": []}, "choice must list at least one string; the list is empty"),
        ({"choice": "yes"}, "choice must be a list of strings"),
    ],
)
def test_a_bad_job_yaml_schema_exits_2_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: Any, message: str
) -> None:
    spec = job_dict(Path("unused-model"), tmp_path / "in.jsonl", tmp_path / "out")
    spec["sampling"]["structured_output"] = value
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    assert cli_main([str(job), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "sampling.structured_output:" in err and message in err, err
    assert not (tmp_path / "out").exists()


def test_the_schema_is_part_of_the_fingerprint(tiny_model: Path, tmp_path: Path) -> None:
    from tokenmill.jobs.spec import JobSpec

    base = job_dict(tiny_model, tmp_path / "in.jsonl", tmp_path / "out")
    first = JobSpec.from_dict({**base, "sampling": {"structured_output": {"json_schema": SCHEMA}}})
    other = json.loads(json.dumps(SCHEMA))
    other["properties"]["answer"]["enum"] = ["yes", "no", "maybe"]
    second = JobSpec.from_dict({**base, "sampling": {"structured_output": {"json_schema": other}}})
    assert first.to_dict()["sampling"] != second.to_dict()["sampling"]
    assert JobSpec.from_dict(first.to_dict()) == first  # the canonical text reads back
