"""OpenAI Batch files in and out through a whole job."""

from __future__ import annotations

import json
from pathlib import Path

from tests.jobs.job_helpers import job_dict, read_jsonl_dir, write_jsonl
from tokenmill import run_job


def _line(cid: str, url: str, body: dict) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def test_openai_batch_in_and_out(tiny_model: Path, tmp_path: Path) -> None:
    chat = "/v1/chat/completions"
    lines = [
        _line(
            "chat-1",
            chat,
            {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
        ),
        _line(
            "chat-2",
            chat,
            {
                "messages": [{"role": "user", "content": "yo"}],
                "max_completion_tokens": 3,
                "logprobs": True,
                "top_logprobs": 2,
            },
        ),
        _line(
            "comp-1", "/v1/completions", {"prompt": "Once upon", "max_tokens": 4, "temperature": 0}
        ),
        _line(
            "bad-temp", chat, {"messages": [{"role": "user", "content": "a"}], "temperature": "hot"}
        ),
        _line("bad-topp", chat, {"messages": [{"role": "user", "content": "a"}], "top_p": 1.5}),
        _line("bad-max", chat, {"messages": [{"role": "user", "content": "a"}], "max_tokens": -1}),
        _line("bad-url", "/v1/embeddings", {"input": "a"}),
        {"custom_id": "bad-method", "method": "GET", "url": chat, "body": {}},
    ]
    src = write_jsonl(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out, output={"format": "openai-batch"})
    spec["input"] = {"path": str(src), "format": "auto"}
    report = run_job(spec, show_progress=False)
    assert report.status == "complete" and (report.rows_ok, report.rows_failed) == (3, 5)

    ok = {r["custom_id"]: r for r in read_jsonl_dir(out / "shards")}
    assert set(ok) == {"chat-1", "chat-2", "comp-1"}
    for line in ok.values():
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        choice = body["choices"][0]
        assert choice["finish_reason"] in ("stop", "length")
    assert ok["chat-1"]["response"]["body"]["usage"]["completion_tokens"] <= 5
    assert ok["chat-2"]["response"]["body"]["usage"]["completion_tokens"] <= 3
    content = ok["chat-2"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert content and all(len(c["top_logprobs"]) == 2 for c in content)
    assert ok["comp-1"]["response"]["body"]["object"] == "text_completion"
    assert "text" in ok["comp-1"]["response"]["body"]["choices"][0]

    errors = {r["custom_id"]: r for r in read_jsonl_dir(out / "errors")}
    assert set(errors) == {"bad-temp", "bad-topp", "bad-max", "bad-url", "bad-method"}
    assert all(e["response"] is None and e["error"]["message"] for e in errors.values())
    assert "temperature" in errors["bad-temp"]["error"]["message"]
    assert "top_p" in errors["bad-topp"]["error"]["message"]
    assert json.loads((out / "report.json").read_text())["rows_failed"] == 5


def test_duplicate_custom_ids_get_unique_stable_line_ids(tiny_model: Path, tmp_path: Path) -> None:
    """Every output and error line has its own id (OpenAI's rule), also for a repeated
    custom_id and for a custom_id spelled like another line's file:line fallback id; a rerun
    with --fresh writes the same bytes."""
    chat = "/v1/chat/completions"

    def line(cid: str) -> dict:
        body = {"messages": [{"role": "user", "content": f"hi {cid}"}], "max_tokens": 4}
        return _line(cid, chat, body)

    # line 4 repeats "a": a row error whose id falls back to "batch.jsonl:4", line 2's id
    cids = ["a", "batch.jsonl:4", "b", "a", "c", "b"]
    src = write_jsonl(tmp_path / "batch.jsonl", [line(c) for c in cids])
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out, output={"format": "openai-batch"})
    spec["input"] = {"path": str(src), "format": "auto"}
    report = run_job(spec, show_progress=False)
    assert (report.rows_ok, report.rows_failed) == (4, 2)

    lines = read_jsonl_dir(out / "shards") + read_jsonl_dir(out / "errors")
    ids = [x["id"] for x in lines]
    assert len(ids) == 6 and len(set(ids)) == 6
    ok = [x for x in lines if x["error"] is None]
    assert sorted(x["custom_id"] for x in ok) == ["a", "b", "batch.jsonl:4", "c"]
    assert len({x["response"]["request_id"] for x in ok}) == 4
    assert len({x["response"]["body"]["id"] for x in ok}) == 4
    errors = [x for x in lines if x["error"] is not None]
    assert all("duplicate id" in x["error"]["message"] for x in errors)
    _validate_with_openai_types(ok)

    files = {p: p.read_bytes() for p in sorted(out.glob("*/*.jsonl"))}
    again = run_job(spec, fresh=True, show_progress=False)
    assert again.rows_this_run == 6
    assert {p: p.read_bytes() for p in sorted(out.glob("*/*.jsonl"))} == files


def _validate_with_openai_types(lines: list[dict]) -> None:
    """Parse each body with the ``openai`` package's own types, where it is installed."""
    try:
        from openai.types.chat import ChatCompletion
    except ImportError:
        return
    for x in lines:
        ChatCompletion.model_validate(x["response"]["body"])
