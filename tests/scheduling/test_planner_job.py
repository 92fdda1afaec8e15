"""The planner in whole jobs on the tiny model (OpenAI Batch in and out): length order runs
the long rows first, dedup spares the engine the repeated rows' tokens, and neither changes
any row's output line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.jobs.job_helpers import job_dict, read_jsonl_dir, write_jsonl
from tokenmill import run_job
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.jobs.report import JobReport

CHAT = "/v1/chat/completions"
LONG, SHORT = 16, 2


def _line(cid: str, question: int, max_tokens: int) -> dict[str, Any]:
    # every prompt the same length: question numbers of two digits
    body = {"messages": [{"role": "user", "content": f"question number {question:02d}"}]}
    return {
        "custom_id": cid,
        "method": "POST",
        "url": CHAT,
        "body": body | {"max_tokens": max_tokens},
    }


def _batch() -> list[dict[str, Any]]:
    """20 lines: 14 different requests (7 long, 7 short) and 6 repeats (3 of a long one, 3
    of a short one), spread through the file. The repeats mirror the mix of lengths, so they
    hold 30% of the tokens as they are 30% of the rows."""
    lines = [_line(f"q{i}", i, LONG if i % 2 else SHORT) for i in range(14)]
    repeats = [(3, 1), (7, 3), (10, 5), (13, 0), (16, 2), (19, 4)]  # (position, of question)
    for n, (at, q) in enumerate(repeats):
        lines.insert(at, _line(f"again{n}", q, LONG if q % 2 else SHORT))
    return lines


def _run(tiny_model: Path, src: Path, out: Path, planner: dict[str, Any]) -> JobReport:
    spec = job_dict(
        tiny_model,
        src,
        out,
        output={"format": "openai-batch", "rows_per_shard": 6},
        sampling={"ignore_eos": True},  # each row makes exactly its max_tokens
        engine={"max_num_seqs": 4},
        planner=planner,
    )
    spec["input"] = {"path": str(src), "format": "openai-batch"}
    report = run_job(spec, show_progress=False)
    assert report.status == "complete" and report.rows_ok == 20 and report.rows_failed == 0
    return report


def _lines(out: Path) -> dict[str, dict[str, Any]]:
    lines = read_jsonl_dir(out / "shards")
    by_cid = {line["custom_id"]: line for line in lines}
    assert len(by_cid) == len(lines) == 20  # each request once
    assert len({line["id"] for line in lines}) == 20  # each line its own id
    return by_cid


def _answers(out: Path) -> dict[str, tuple[str, str, dict]]:
    return {
        cid: (
            line["response"]["body"]["choices"][0]["message"]["content"],
            line["response"]["body"]["choices"][0]["finish_reason"],
            line["response"]["body"]["usage"],
        )
        for cid, line in _lines(out).items()
    }


@pytest.fixture(scope="module")
def reference(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The batch run in input order without dedup: the outputs to match."""
    folder = tmp_path_factory.mktemp("planner-reference")
    src = write_jsonl(folder / "batch.jsonl", _batch())
    report = _run(tiny_model, src, folder / "out", {"order": "input", "dedup": False})
    assert report.rows_deduplicated == 0
    return {"src": src, "report": report, "answers": _answers(folder / "out")}


def test_length_order_runs_long_rows_first_with_the_same_outputs(
    tiny_model: Path, tmp_path: Path, reference: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    added: list[int] = []
    add = LLMEngine.add_request

    def recording(self: LLMEngine, request_id: str, *args: Any, **kwargs: Any) -> Any:
        added.append(int(request_id))
        return add(self, request_id, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "add_request", recording)
    _run(tiny_model, reference["src"], tmp_path / "out", {"order": "length", "dedup": False})
    lengths = [line["body"]["max_tokens"] for line in _batch()]
    assert [lengths[i] for i in added[:10]] == [LONG] * 10  # all 10 long rows first
    assert added[:10] == sorted(added[:10])  # equal work keeps input order
    assert _answers(tmp_path / "out") == reference["answers"]


def test_dedup_spares_30_percent_of_the_tokens_and_changes_no_line(
    tiny_model: Path, tmp_path: Path, reference: dict[str, Any]
) -> None:
    out = tmp_path / "out"
    report = _run(tiny_model, reference["src"], out, {})  # the defaults: length order, dedup
    before: JobReport = reference["report"]
    engine_before = before.prompt_tokens + before.completion_tokens
    engine_after = report.prompt_tokens + report.completion_tokens
    assert engine_after == pytest.approx(0.7 * engine_before)
    assert report.rows_deduplicated == 6
    assert report.deduplicated_tokens == engine_before - engine_after
    assert _answers(out) == reference["answers"]  # every repeat has its own line, same answer
    saved = json.loads((out / "report.json").read_text())
    assert (saved["rows_deduplicated"], saved["deduplicated_tokens"]) == (
        6,
        engine_before - engine_after,
    )
    assert "dedup       6 rows copied from identical rows" in report.summary()


def test_rows_sampled_under_the_job_seed_are_independent_draws_and_never_copies(
    tiny_model: Path, tmp_path: Path
) -> None:
    """One job-wide seed gave every row the same noise: alike rows drew the same tokens, and
    repeated prompts were copies. Now each row's seed mixes in its index: a repeat is its
    own draw (not deduplicated), and a rerun draws every row again the same. Bodies that
    bring the same seed of their own are still reproducible duplicates."""
    src = write_jsonl(tmp_path / "batch.jsonl", _batch())

    def sampled(out: Path, body_seed: int | None = None) -> tuple[JobReport, dict]:
        spec = job_dict(
            tiny_model,
            src,
            out,
            output={"format": "openai-batch"},
            sampling={"ignore_eos": True, "temperature": 1.0, "seed": 0},
        )
        spec["input"] = {"path": str(src), "format": "openai-batch"}
        if body_seed is not None:
            lines = [line | {"body": line["body"] | {"seed": body_seed}} for line in _batch()]
            spec["input"]["path"] = str(write_jsonl(out.parent / f"{out.name}.jsonl", lines))
        report = run_job(spec, show_progress=False)
        assert report.rows_ok == 20
        return report, _answers(out)

    report, answers = sampled(tmp_path / "a")
    assert report.rows_deduplicated == 0
    twins = [("again0", "q1"), ("again1", "q3"), ("again2", "q5")]  # the long repeats
    assert all(answers[a][0] != answers[b][0] for a, b in twins)
    assert sampled(tmp_path / "b")[1] == answers  # a rerun repeats every row

    report, answers = sampled(tmp_path / "c", body_seed=5)
    assert report.rows_deduplicated == 6
    assert all(answers[a][0] == answers[b][0] for a, b in twins)


def test_a_copied_error_is_not_counted_as_deduplicated(tiny_model: Path, tmp_path: Path) -> None:
    """Twins of a row the engine refuses (too long for the context) get a copy of its
    error, which saved no work: counted, the Ray executor (which keys rows before checking
    them) and the local one reported different rows_deduplicated for one input."""
    long = {"messages": [{"role": "user", "content": "word " * 30}], "max_tokens": 2}
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": CHAT, "body": long} for i in range(3)]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    spec = job_dict(tiny_model, src, tmp_path / "out", engine={"max_model_len": 64})
    spec["input"] = {"path": str(src), "format": "openai-batch"}
    report = run_job(spec, show_progress=False)
    assert (report.rows_ok, report.rows_failed) == (0, 3)
    assert (report.rows_deduplicated, report.deduplicated_tokens) == (0, 0)


def test_the_tokens_a_best_of_copy_spares_count_every_sample(
    tiny_model: Path, tmp_path: Path
) -> None:
    """An audit: a copy of a best_of 4 row counted its prompt and its one returned
    completion as spared (10 tokens), where the engine was spared 4 samples (25)."""
    body = {"prompt": "hello there", "max_tokens": 5, "best_of": 4, "temperature": 0.8,
            "seed": 1}  # fmt: skip
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}
        for i in range(2)
    ]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    reports = []
    for name, dedup in (("off", False), ("on", True)):
        spec = job_dict(tiny_model, src, tmp_path / name, sampling={"ignore_eos": True},
                        planner={"dedup": dedup})  # fmt: skip
        spec["input"] = {"path": str(src), "format": "openai-batch"}
        reports.append(run_job(spec, show_progress=False))
    off, on = reports
    spared = (off.prompt_tokens + off.completion_tokens) - (on.prompt_tokens + on.completion_tokens)
    assert on.rows_deduplicated == 1 and spared > 0
    assert on.deduplicated_tokens == spared


def test_a_failed_runs_report_counts_the_copies_it_committed(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An audit: a run that failed after committing its shards reported rows_deduplicated 0
    beside rows_ok that held the copies."""
    from tokenmill.jobs import runner

    def fails(*args: object) -> None:
        raise RuntimeError("the end-of-run check failed")

    monkeypatch.setattr(runner, "_check_commits_stand", fails)
    src = write_jsonl(tmp_path / "batch.jsonl", _batch())
    with pytest.raises(RuntimeError, match="end-of-run check"):
        _run(tiny_model, src, tmp_path / "out", {})
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["status"] == "failed" and saved["rows_deduplicated"] == 6
