"""A job with ``engine.speculative``: the same shards as without it, and its draft counts in
report.json and in the end-of-job summary."""

from __future__ import annotations

import json
from pathlib import Path

from tests.jobs.job_helpers import chat_rows, job_dict, read_jsonl_dir, write_jsonl
from tokenmill import run_job


def test_ngram_job_writes_the_same_rows_and_reports_drafts(
    tiny_model: Path, tmp_path: Path
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(24))
    runs = {}
    for method in ("off", "ngram"):
        out = tmp_path / method
        engine = {"max_num_seqs": 8, "speculative": {"method": method, "max_tokens": 4}}
        spec = job_dict(tiny_model, src, out, engine=engine, sampling={"max_tokens": 24})
        report = run_job(spec, show_progress=False)
        assert report.status == "complete" and report.rows_ok == 24
        runs[method] = (report, out)
    rows = {m: read_jsonl_dir(out / "shards") for m, (_, out) in runs.items()}
    assert rows["ngram"] == rows["off"]
    off, ngram = runs["off"][0], runs["ngram"][0]
    assert off.speculative is None and "speculative" not in off.summary()
    saved = json.loads((runs["ngram"][1] / "report.json").read_text())["speculative"]
    assert saved == ngram.speculative and saved["method"] == "ngram"
    assert saved["draft_tokens"] > 0 and 0 <= saved["accepted_tokens"] <= saved["draft_tokens"]
    assert f"speculative ngram: {saved['accepted_tokens']} of {saved['draft_tokens']}" in (
        ngram.summary()
    )
