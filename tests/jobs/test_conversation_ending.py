"""``model.add_generation_prompt`` / ``model.continue_final_message`` in a job: every
conversation of the job ends as ``LLM.chat`` ends it with the same arguments (the reply begun
in the data continued), in a run and in a dry run; a row with nothing to continue is that
row's error; an OpenAI Batch body's own ending wins for its row; both true is refused
naming the keys; a change refuses a resume; the defaults leave the fingerprint as it was."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.jobs.job_helpers import (
    CHAT_URL,
    TINY_ENGINE,
    batch_job,
    batch_line,
    job_dict,
    read_jsonl_dir,
    write_jsonl,
)
from tokenmill import LLM, SamplingParams, run_job
from tokenmill.jobs.dry_run import dry_run
from tokenmill.jobs.fingerprint import fingerprint, job_settings
from tokenmill.jobs.manifest import FingerprintMismatchError
from tokenmill.jobs.spec import JobSpec, JobSpecError

CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


def _begun(i: int) -> list[dict[str, str]]:
    """A conversation whose reply the data began: the model goes on from '{'."""
    return [
        {"role": "user", "content": f"give item {i} as JSON"},
        {"role": "assistant", "content": '{"item": '},
    ]


def _spec(model: Path, tmp_path: Path, **model_keys: Any) -> dict[str, Any]:
    rows = [{"id": f"r{i}", "messages": _begun(i)} for i in range(4)]
    rows.append({"id": "asked", "messages": [{"role": "user", "content": "no reply begun"}]})
    spec = job_dict(model, write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out")
    spec["input"]["passthrough_columns"] = []
    spec["model"].update(model_keys)
    return spec


def test_a_job_continues_every_reply_begun_and_a_row_without_one_is_its_error(
    tiny_model: Path, tmp_path: Path
) -> None:
    spec = _spec(tiny_model, tmp_path, **CONTINUE)
    estimate = dry_run(JobSpec.from_dict(spec))
    report = run_job(spec, show_progress=False)
    assert (report.rows_ok, report.rows_failed) == (4, 1)
    got = {r["id"]: r for r in read_jsonl_dir(tmp_path / "out" / "shards")}

    llm = LLM(str(tiny_model), **TINY_ENGINE)
    convs = [_begun(i) for i in range(4)]
    want = llm.chat(convs, SamplingParams(max_tokens=8, temperature=0.0), **CONTINUE)
    for i, out in enumerate(want):
        assert out.prompt.endswith('{"item": ')  # the reply is continued, not a new turn
        assert got[f"r{i}"]["prompt_tokens"] == len(out.prompt_token_ids)
        assert got[f"r{i}"]["text"] == out.outputs[0].text
        assert len(out.prompt_token_ids) != len(llm.encode_chat(convs[i]))
    errors = [json.loads(line) for p in (tmp_path / "out" / "errors").iterdir()
              for line in p.read_text().splitlines()]  # fmt: skip
    assert [e["id"] for e in errors] == ["asked"]
    assert errors[0]["error"].startswith(
        f"{tmp_path / 'in.jsonl'}:5: continue_final_message is set, but the conversation"
    )
    assert "ends with a user message" in errors[0]["error"]

    # The dry run finds the same bad row and counts the same prompts.
    assert (estimate.rows, estimate.bad_rows) == (5, 1)
    assert estimate.prompt_tokens == sum(len(o.prompt_token_ids) for o in want)


def test_an_openai_batch_bodys_own_ending_wins_over_the_jobs(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A body that says neither takes the job's; one that says either is read as vLLM
    reads it (the other at vLLM's default)."""
    lines = [
        batch_line("job", CHAT_URL, {"messages": _begun(0)}),
        batch_line("own", CHAT_URL, {"messages": _begun(0), "add_generation_prompt": True}),
    ]
    spec = batch_job(tiny_model, lines, tmp_path, fmt="jsonl")
    spec["model"].update(CONTINUE)
    report = run_job(spec, show_progress=False)
    assert (report.rows_ok, report.rows_failed) == (2, 0)
    got = {r["id"]: r for r in read_jsonl_dir(tmp_path / "out" / "shards")}
    llm = LLM(str(tiny_model), **TINY_ENGINE)
    assert got["job"]["prompt_tokens"] == len(llm.encode_chat(_begun(0), **CONTINUE))
    assert got["own"]["prompt_tokens"] == len(llm.encode_chat(_begun(0)))


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            {"continue_final_message": True},
            "model.continue_final_message: true with model.add_generation_prompt true too",
        ),
        ({"add_generation_prompt": "no"}, "model.add_generation_prompt: expected true or false"),
        ({"continue_final_message": 1}, "model.continue_final_message: expected true or false"),
    ],
)
def test_bad_endings_are_refused_naming_the_keys(
    tiny_model: Path, tmp_path: Path, keys: dict[str, Any], message: str
) -> None:
    with pytest.raises(JobSpecError) as info:
        JobSpec.from_dict(_spec(tiny_model, tmp_path, **keys))
    assert message in str(info.value)


def test_another_ending_refuses_a_resume(tiny_model: Path, tmp_path: Path) -> None:
    spec = _spec(tiny_model, tmp_path, **CONTINUE)
    run_job(spec, show_progress=False)
    spec["model"]["continue_final_message"] = False
    with pytest.raises(FingerprintMismatchError) as info:
        run_job(spec, show_progress=False)
    assert "model.continue_final_message: true -> false" in str(info.value)
    spec["model"]["add_generation_prompt"] = True
    with pytest.raises(FingerprintMismatchError) as info:
        run_job(spec, show_progress=False)
    assert "model.add_generation_prompt: false -> true" in str(info.value)


def test_the_defaults_leave_the_fingerprint_as_it_was(tiny_model: Path, tmp_path: Path) -> None:
    """Jobs begun before the keys existed resume: at their defaults they are not hashed."""
    unset = JobSpec.from_dict(_spec(tiny_model, tmp_path))
    given = JobSpec.from_dict(
        _spec(tiny_model, tmp_path, add_generation_prompt=True, continue_final_message=False)
    )
    settings = [job_settings(s, tiny_model, None, "input") for s in (unset, given)]
    assert settings[0] == settings[1]
    assert not {"add_generation_prompt", "continue_final_message"} & settings[0].keys()
    changed = job_settings(JobSpec.from_dict(_spec(tiny_model, tmp_path, **CONTINUE)),
                           tiny_model, None, "input")  # fmt: skip
    assert (changed["add_generation_prompt"], changed["continue_final_message"]) == (False, True)
    assert fingerprint(changed) != fingerprint(settings[0])
