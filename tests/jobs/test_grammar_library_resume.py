"""engine.structured_output_backend (the grammar library) counts in the job fingerprint only
where a row may carry a constraint: the job's sampling.structured_output, a constraint
column, or OpenAI Batch bodies (which may each hold a response_format). A job without one
resumes under either library, and one begun when every job hashed it still resumes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.jobs.job_helpers import CHAT_URL, batch_job, batch_line, chat_rows, job_dict, write_jsonl
from tokenmill import run_job
from tokenmill.jobs.fingerprint import UNHASHED, fingerprint
from tokenmill.jobs.manifest import FingerprintMismatchError
from tokenmill.jobs.preflight import input_config
from tokenmill.jobs.runner import settings_of
from tokenmill.jobs.spec import JobSpec

XGRAMMAR = {"structured_output_backend": "xgrammar"}
CHANGED = 'engine.structured_output_backend: "llguidance" -> "xgrammar"'


def _manifest_of(out: Path) -> dict[str, Any]:
    return json.loads((out / "test.manifest.json").read_text())


def test_a_job_without_constraints_resumes_under_another_grammar_library(
    tiny_model: Path, tmp_path: Path
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    out = tmp_path / "out"
    run_job(job_dict(tiny_model, src, out), show_progress=False)
    report = run_job(job_dict(tiny_model, src, out, engine=XGRAMMAR), show_progress=False)
    assert report.status == "complete" and report.rows_this_run == 0
    # Refused for another setting, the library it left out is not named as changed.
    changed = job_dict(tiny_model, src, out, engine=XGRAMMAR, sampling={"max_tokens": 9})
    with pytest.raises(FingerprintMismatchError) as info:
        run_job(changed, show_progress=False)
    assert "sampling.max_tokens: 8 -> 9" in str(info.value)
    assert "structured_output_backend" not in str(info.value)


@pytest.mark.parametrize("where", ["sampling", "column", "openai-batch"])
def test_a_job_whose_rows_may_be_constrained_refuses_another_grammar_library(
    tiny_model: Path, tmp_path: Path, where: str
) -> None:
    """(An OpenAI Batch input counts without a response_format in any body: the spec does
    not say whether its bodies hold one.)"""
    if where == "openai-batch":
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        spec = batch_job(tiny_model, [batch_line("a", CHAT_URL, body)], tmp_path)
    else:
        rows = [{**row, "rule": "json_object"} for row in chat_rows(3)]
        spec = job_dict(tiny_model, write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out")
        if where == "sampling":
            spec["sampling"]["structured_output"] = "json_object"
        else:
            spec["input"]["structured_output_column"] = "rule"
    assert run_job(spec, show_progress=False).status == "complete"
    spec["engine"].update(XGRAMMAR)
    with pytest.raises(FingerprintMismatchError) as info:
        run_job(spec, show_progress=False)
    message = str(info.value)
    assert CHANGED in message and "Rerun with --fresh" in message


def test_a_job_begun_when_every_job_hashed_the_grammar_library_still_resumes(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Its manifest is written as versions before this one wrote it: the library in the
    hashed engine section, no ``constraints`` key."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(6))
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out, engine=XGRAMMAR)
    run_job(spec, show_progress=False)
    parsed = JobSpec.from_dict(spec)
    settings, _ = settings_of(parsed, input_config(parsed))
    assert "engine" not in settings  # it counts no more
    old = {k: v for k, v in settings.items() if k != "constraints"} | {"engine": XGRAMMAR}
    manifest = _manifest_of(out)
    del manifest["settings"]["constraints"]
    del manifest["shards"]["1"]  # progress left to make
    manifest |= {"fingerprint": fingerprint(old), "complete": False}
    manifest["settings"]["engine"] = XGRAMMAR
    assert set(UNHASHED) & set(old) <= set(manifest["settings"])
    (out / "test.manifest.json").write_text(json.dumps(manifest))

    report = run_job(spec, show_progress=False)
    assert report.status == "complete" and report.rows_this_run == 2
    resumed = _manifest_of(out)  # this version's fingerprint from now on
    assert resumed["fingerprint"] == fingerprint(settings)
    assert "engine" not in resumed["settings"]
