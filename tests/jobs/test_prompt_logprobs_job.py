"""``prompt_logprobs`` through whole jobs: job.yaml's for every row in JSONL and Parquet
output (a column of the job's one Parquet schema), an OpenAI Batch body's own where vLLM's
server writes them, all equal to what ``LLM.generate`` / ``LLM.chat`` give; bad values are
spec errors or row errors naming the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
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
from tokenmill.engine.outputs import RequestOutput
from tokenmill.io.prompt_logprobs_column import PROMPT_LOGPROBS_FIELD
from tokenmill.jobs.dry_run import dry_run
from tokenmill.jobs.spec import JobSpec, JobSpecError


def _check_entries(got: list[Any], want: RequestOutput, llm: LLM, k: int) -> None:
    """A job's prompt_logprobs entries against the engine's own, position by position."""
    assert want.prompt_logprobs is not None
    assert len(got) == len(want.prompt_token_ids) == len(want.prompt_logprobs)
    assert got[0] is None and want.prompt_logprobs[0] is None
    positions = zip(got[1:], want.prompt_logprobs[1:], want.prompt_token_ids[1:], strict=True)
    for entry, lp, token in positions:
        assert lp is not None
        check_entry(entry, lp, token, llm.tokenizer.decode, k)


def _check_vllm_shape(got: list[Any], want: RequestOutput, llm: LLM) -> None:
    """OpenAI Batch prompt logprobs as vLLM's server writes them: per position {"<id>":
    {logprob, rank, decoded_token}}, the prompt token first, then the alternatives."""
    assert want.prompt_logprobs is not None and got[0] is None
    assert len(got) == len(want.prompt_token_ids)
    for position, lp in zip(got[1:], want.prompt_logprobs[1:], strict=True):
        assert lp is not None
        assert next(iter(position)) == str(lp.token_id)  # the prompt token first
        assert set(position) == {str(t) for t in lp}  # and its alternatives (a mapping too)
        for token_id, logprob in lp.items():
            entry = position[str(token_id)]
            assert entry["rank"] == logprob.rank
            assert entry["decoded_token"] == llm.tokenizer.decode([token_id])
            assert entry["logprob"] == pytest.approx(logprob.logprob, abs=TOL)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_job_yaml_prompt_logprobs_equal_the_python_apis(
    tiny_model: Path, llm: LLM, tmp_path: Path, fmt: str
) -> None:
    rows = chat_rows(3)
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    sampling = {"prompt_logprobs": 2}
    spec = job_dict(tiny_model, src, tmp_path / "out", sampling=sampling, output={"format": fmt})
    report = run_job(spec, show_progress=False)
    assert (report.status, report.rows_ok, report.rows_failed) == ("complete", 3, 0)
    shards = tmp_path / "out" / "shards"
    if fmt == "parquet":
        table = ds.dataset(shards).to_table()
        assert table.schema.field("prompt_logprobs").equals(PROMPT_LOGPROBS_FIELD, True)
        assert table.schema.names[-2:] == ["prompt_logprobs", "topic"]
        written = table.to_pylist()
    else:
        written = read_jsonl_dir(shards)
    by_id = {r["id"]: r for r in written}
    want = llm.chat(
        [r["messages"] for r in rows], SamplingParams(max_tokens=8, temperature=0, **sampling)
    )
    for row, out in zip(rows, want, strict=True):
        got = by_id[row["id"]]
        assert (got["text"], got["prompt_tokens"]) == (out.text, len(out.prompt_token_ids))
        _check_entries(got["prompt_logprobs"], out, llm, k=2)


def test_openai_batch_prompt_logprobs_where_vllm_writes_them(
    tiny_model: Path, llm: LLM, tmp_path: Path
) -> None:
    messages = [{"role": "user", "content": "name three colours"}]
    prompt = "Once upon a time"
    comp = {"max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 2, "prompt_logprobs": 1}
    lines = [
        batch_line("comp", COMPLETIONS_URL, {"prompt": prompt, **comp}),
        batch_line("chat", CHAT_URL, {"messages": messages, "max_tokens": 4, "prompt_logprobs": 0}),
        batch_line("plain", CHAT_URL, {"messages": messages, "max_tokens": 4}),
        batch_line("negative", CHAT_URL, {"messages": messages, "prompt_logprobs": -1}),
        batch_line("too-many", COMPLETIONS_URL, {"prompt": "x", "prompt_logprobs": 21}),
    ]
    spec = batch_job(tiny_model, lines, tmp_path, "openai-batch")
    report = run_job(spec, show_progress=False)
    assert (report.rows_ok, report.rows_failed) == (3, 2)
    out = tmp_path / "out"
    bodies = {x["custom_id"]: x["response"]["body"] for x in read_jsonl_dir(out / "shards")}

    completion = Completion.model_validate(bodies["comp"])
    ref = llm.generate(prompt, SamplingParams(**comp))[0]
    assert [c.text for c in completion.choices] == [c.text for c in ref.outputs]
    for choice in completion.choices:  # vLLM repeats the prompt's on every choice
        _check_vllm_shape((choice.model_extra or {})["prompt_logprobs"], ref, llm)

    chat = ChatCompletion.model_validate(bodies["chat"])
    ref = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0))[0]
    assert chat.choices[0].message.content == ref.text
    assert chat.usage is not None and chat.usage.prompt_tokens == len(ref.prompt_token_ids)
    _check_vllm_shape((chat.model_extra or {})["prompt_logprobs"], ref, llm)
    assert "prompt_logprobs" not in bodies["plain"]

    errors = {x["custom_id"]: x["error"]["message"] for x in read_jsonl_dir(out / "errors")}
    assert "body.prompt_logprobs must be an integer in [0, 20], got -1" in errors["negative"]
    assert "body.prompt_logprobs must be an integer in [0, 20], got 21" in errors["too-many"]
    assert dry_run(JobSpec.from_dict(spec)).bad_rows == 2


def test_a_rows_prompt_logprobs_need_the_jobs_parquet_column(
    tiny_model: Path, llm: LLM, tmp_path: Path
) -> None:
    """Parquet's schema is fixed before the first shard: a body asking for prompt logprobs
    is a row error unless the job's sampling section asks too; then its own k applies."""
    prompt, own = "Once upon a time", {"max_tokens": 3, "prompt_logprobs": 3}
    lines = [
        batch_line("asks", COMPLETIONS_URL, {"prompt": prompt, **own}),
        batch_line("plain", COMPLETIONS_URL, {"prompt": "Once"}),
    ]
    spec = batch_job(tiny_model, lines, tmp_path / "without", "parquet")
    assert run_job(spec, show_progress=False).rows_failed == 1
    (error,) = read_jsonl_dir(tmp_path / "without" / "out" / "errors")
    assert error["id"] == "asks"
    assert "has no prompt_logprobs column; set sampling.prompt_logprobs" in error["error"]
    assert dry_run(JobSpec.from_dict(spec)).bad_rows == 1

    spec = batch_job(tiny_model, lines, tmp_path / "with", "parquet")
    spec["sampling"]["prompt_logprobs"] = 1
    assert run_job(spec, show_progress=False).rows_ok == 2
    table = ds.dataset(tmp_path / "with" / "out" / "shards").to_table()
    written = {r["id"]: r for r in table.to_pylist()}
    ref = llm.generate(prompt, SamplingParams(temperature=0, **own))
    _check_entries(written["asks"]["prompt_logprobs"], ref[0], llm, k=3)
    ref = llm.generate("Once", SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=1))
    _check_entries(written["plain"]["prompt_logprobs"], ref[0], llm, k=1)


def test_bad_prompt_logprobs_settings_are_spec_errors(tiny_model: Path, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(1))
    with pytest.raises(JobSpecError, match=r"sampling\.prompt_logprobs: must be greater than"):
        run_job(job_dict(tiny_model, src, tmp_path / "a", sampling={"prompt_logprobs": -1}))
    clash = job_dict(tiny_model, src, tmp_path / "b", sampling={"prompt_logprobs": 0})
    clash["input"]["passthrough_columns"] = ["prompt_logprobs"]
    with pytest.raises(JobSpecError, match="input.passthrough_columns: 'prompt_logprobs'"):
        run_job(clash, show_progress=False)
