"""The dry run's "how long and how much": shared prefixes, duplicates, output tokens and the
time estimate from the measured throughput table, on data with known duplicates and shared
prefixes; the table's figures against BENCHMARKS.md."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest

from tests.jobs.job_helpers import chat_rows, job_dict, write_jsonl
from tokenmill.engine.model_config import ModelConfig
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.jobs.distinct_counter import DistinctCounter
from tokenmill.jobs.dry_run import dry_run
from tokenmill.jobs.prompt_stats import PromptStats
from tokenmill.jobs.spec import JobSpec
from tokenmill.jobs.throughput_table import estimate_time, load_table, model_params

BENCHMARKS = Path(__file__).resolve().parents[2] / "BENCHMARKS.md"
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


def test_distinct_counter_is_exact_then_estimates_within_its_stated_error() -> None:
    rng = random.Random(0)
    keys = [rng.getrandbits(64) for _ in range(50_000)]
    exact = DistinctCounter(max_exact=100_000)
    repeats = [exact.add(k) for k in keys + keys[:1000]]
    assert exact.exact and exact.distinct() == 50_000 and exact.relative_error == 0
    assert sum(repeats) == 1000  # the second time round each key is recognised

    sketch = DistinctCounter(max_exact=1000)  # the set fills up: the sketch takes over
    for k in keys + keys[:20_000]:
        sketch.add(k)
    assert not sketch.exact and sketch.relative_error == pytest.approx(1.04 / 128)
    # within 4 standard errors (0.81% each at 2^14 registers)
    assert abs(sketch.distinct() - 50_000) < 4 * sketch.relative_error * 50_000
    with pytest.raises(ValueError, match="precision"):
        DistinctCounter(precision=30)


def test_prompt_stats_on_known_prefixes_and_duplicates() -> None:
    stats = PromptStats(block_size=4)
    a = list(range(1, 10))  # 9 tokens: 2 full blocks, 1 token left over
    stats.add(a, GREEDY, max_len=100)  # first: nothing shared
    stats.add(a[:4] + [50, 51, 52, 53], GREEDY, max_len=100)  # shares a's first block
    stats.add(a, GREEDY, max_len=100)  # a duplicate: both full blocks shared
    stats.add(a, SamplingParams(max_tokens=10, temperature=0.0, seed=7), max_len=100)
    stats.add([50, 51, 52, 53] + a[4:8], GREEDY, max_len=14)  # same 2nd block, other parent
    assert stats.prompt_tokens == 9 + 8 + 9 + 9 + 8
    assert stats.shared_prefix_tokens == 0 + 4 + 8 + 8 + 0  # blocks chain: no mid-prompt match
    assert stats.shared_prefix_share == pytest.approx(20 / 43)
    assert stats.duplicates == (1, 0)  # other sampling settings: not a duplicate
    # max_tokens, or the context left (14 - 8 = 6) when smaller
    assert stats.max_output_tokens == 4 * 10 + 6 and not stats.all_ignore_eos
    assert stats.longest_prompt == 9 and not stats.prefix_capped
    # Sampled without a seed: the run computes every such row (no two give one result).
    unseeded = SamplingParams(max_tokens=10, temperature=0.8)
    stats.add(a, unseeded, max_len=100)
    stats.add(a, unseeded, max_len=100)
    assert stats.duplicates == (1, 0)


def test_prompt_stats_memory_is_capped() -> None:
    stats = PromptStats(block_size=2, max_blocks=3, max_distinct=100)
    for i in range(2000):
        stats.add([i, i, i + 1, i + 1], GREEDY, max_len=100)
    for i in range(500):  # repeats: the first 100 rows are in the exact set, the rest are not
        stats.add([i, i, i + 1, i + 1], GREEDY, max_len=100)
    # 3 block keys kept (row 0's two, row 1's first); later blocks are not remembered, so only
    # the repeats of rows 0 (2 blocks) and 1 (1 block) count as shared: a lower bound
    assert stats.prefix_capped and stats.shared_prefix_tokens == 2 * 2 + 2
    duplicates, error = stats.duplicates  # past 100 distinct rows: the sketch's estimate
    assert 0 < error <= 0.01 * 2000  # one standard error: 0.81% of the distinct rows
    assert abs(duplicates - 500) <= 4 * error


def _config(**shape: int | bool) -> ModelConfig:
    base = dict(
        architecture="LlamaForCausalLM",
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        max_position_embeddings=4096,
    )
    return ModelConfig(**base, **shape)  # type: ignore[arg-type]


def test_model_params_match_the_table_entries() -> None:
    smollm2 = _config(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        tie_word_embeddings=True,
    )
    llama8b = _config(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    )
    params = {e.name: e.params for e in load_table()}
    assert model_params(smollm2) == params["smollm2-135m-h200-run-job"] == 134_479_872
    assert model_params(llama8b) == params["llama-3-8b-h200"]


def test_every_table_entry_is_a_figure_of_its_benchmarks_section() -> None:
    text = BENCHMARKS.read_text()
    headings = [(m.start(), m.group(2)) for m in re.finditer(r"^(#+) (.+)$", text, re.M)]
    table = load_table()
    assert {e.device for e in table} == {"gpu", "cpu"}
    for entry in table:
        starts = [i for i, (_, title) in enumerate(headings) if title == entry.source]
        assert starts, f"{entry.name}: no section {entry.source!r} in BENCHMARKS.md"
        begin = headings[starts[0]][0]
        end = headings[starts[0] + 1][0] if starts[0] + 1 < len(headings) else len(text)
        section = text[begin:end]
        assert entry.figure in section, f"{entry.name}: {entry.figure} not in {entry.source!r}"
        written = float(entry.figure.replace(",", "").replace("k", ""))
        scale = 1000 if entry.figure.endswith("k") else 1
        assert entry.output_tokens_per_s == pytest.approx(written * scale)


def test_the_estimate_takes_the_nearest_measured_entry_and_says_how_it_differs() -> None:
    est = estimate_time(9_212_000, 8_030_000_000, "gpu", "NVIDIA H200", "bfloat16", "none")
    assert est.entry.name == "llama-3-8b-h200" and est.seconds == pytest.approx(1000)
    assert est.notes == ()
    fp8 = estimate_time(1000, 8_030_000_000, "gpu", "NVIDIA H200", "bfloat16", "fp8", replicas=4)
    assert fp8.entry.name == "llama-3-8b-h200-fp8" and fp8.wall_seconds == fp8.seconds / 4
    other = estimate_time(1000, 70_000_000_000, "gpu", "NVIDIA A100-SXM4-80GB", "bfloat16", "none")
    assert other.entry.name == "llama-3-8b-h200"
    assert any("weights" in n for n in other.notes) and any("A100" in n for n in other.notes)
    small = estimate_time(1000, 140_000_000, "gpu", None, "bfloat16", "none")
    assert small.entry.name == "smollm2-135m-h200-run-job"
    assert any("no GPU visible" in n for n in small.notes)
    cpu = estimate_time(1000, 134_479_872, "cpu", None, "float32", "none")
    assert cpu.entry.name == "smollm2-135m-cpu-fp32" and cpu.notes == ()


def test_the_estimate_says_when_the_job_holds_far_fewer_rows_a_step_than_its_entry() -> None:
    """The entries ran 64-1,024 rows a step; a job of 8 rows at a time (its rows, or
    engine.max_num_seqs) decodes far fewer tokens a step, which the rate alone hid."""
    h200 = ("gpu", "NVIDIA H200", "bfloat16", "none")
    full = estimate_time(1000, 8_030_000_000, *h200, rows_in_flight=384)
    half = estimate_time(1000, 8_030_000_000, *h200, rows_in_flight=200)
    assert full.notes == half.notes == ()  # within a factor of two: the entry's own
    few = estimate_time(1000, 8_030_000_000, *h200, rows_in_flight=8)
    assert few.seconds == full.seconds  # a note, not a model of the hardware
    assert few.notes == (
        "a step holds at most 8 sequences here (the job's rows, a row of n completions n of "
        "them, or engine.max_num_seqs, whichever is fewer), 384 in the entry: a decode step "
        "takes about as long with fewer, so expect it slower, by up to about 48x",
    )


def test_dry_run_counts_duplicates_and_shared_prefixes_and_estimates_the_time(
    tiny_model: Path, tmp_path: Path
) -> None:
    rows = chat_rows(6)
    for r in rows:  # one long system prompt: every row's first blocks are shared
        r["messages"].insert(0, {"role": "system", "content": "Answer in one word. " * 8})
    again = [dict(rows[0], id="dup-a"), dict(rows[3], id="dup-b"), dict(rows[0], id="dup-c")]
    lines = [json.dumps(r) for r in rows + again] + ['{"id": "broken", "messages": 5}']
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out"
    spec = JobSpec.from_dict(job_dict(tiny_model, src, out, sampling={"max_tokens": 8}))
    report = dry_run(spec)

    assert (report.rows, report.bad_rows) == (10, 1)
    assert (report.duplicate_rows, report.duplicate_error) == (3, 0)
    # the duplicates share all their full blocks, the others the system prompt's
    assert report.shared_prefix_share > 0.6 and not report.shared_prefix_capped
    assert report.output_tokens == 9 * 8 and not report.output_tokens_exact
    est = report.estimate
    assert est is not None and est.entry.name == "tiny-llama-cpu"  # engine.device: cpu
    assert est.seconds == pytest.approx(72 / 85_000)
    assert "a step holds at most 8 sequences here" in est.notes[-1]  # max_num_seqs; entry 1,024
    summary = report.summary()
    assert "duplicates      3 rows repeat an earlier row's prompt and sampling settings" in summary
    assert "output tokens   at most 72" in summary
    assert "max_tokens, an estimate: 72 output tokens / 85,000 output tok/s" in summary
    assert "tiny-llama-cpu (throughput_table.json)" in summary
    assert 'section "Session 7: CPU, after the torch backend\'s batched decode path"' in summary
    assert "less than 1 s of CPU time with every row to max_tokens, an estimate" in summary
    # The prompts far outweigh the outputs: the rate (decode-heavy workloads) says so.
    ratio = f"the prompts hold {report.prompt_tokens / 72:,.0f}x the output tokens"
    assert report.prompt_tokens > 4 * 72 and ratio in summary
    roomy = JobSpec.from_dict(
        job_dict(tiny_model, src, out, sampling={"max_tokens": report.prompt_tokens})
    )
    assert "the prompts hold" not in dry_run(roomy).summary()
    assert not out.exists()  # a dry run writes nothing


def test_a_row_of_n_completions_is_n_sequences_in_a_step(tiny_model: Path, tmp_path: Path) -> None:
    """40 rows of best_of 32 fill 1,024 sequences a step, as the entry's run did: no note
    that the job holds fewer (a review's reproduction said "40 rows ... up to about 26x")."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(40))
    sections = {"sampling": {"max_tokens": 4, "temperature": 1.0, "best_of": 32}}
    spec = job_dict(tiny_model, src, tmp_path / "out", **sections)
    spec["engine"]["max_num_seqs"] = 1024
    est = dry_run(JobSpec.from_dict(spec)).estimate
    assert est is not None and est.entry.name == "tiny-llama-cpu"
    assert not any("sequences here" in note for note in est.notes)
    spec["sampling"]["best_of"] = 8  # 320 a step: the note
    est = dry_run(JobSpec.from_dict(spec)).estimate
    assert est is not None and "at most 320 sequences here" in est.notes[-1]


def test_the_dry_run_refuses_a_huge_prompt_by_its_length_as_a_run_does(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It tokenized a 50 MB prompt in full before refusing it (91 s, 11.7 GB); the run
    refuses by the characters alone, and so does the dry run now, with the run's words."""
    from tokenmill.jobs import dry_run as dry_run_module

    huge = "word " * 200_000
    src = write_jsonl(
        tmp_path / "in.jsonl", [{"id": "a", "prompt": "hi"}, {"id": "huge", "prompt": huge}]
    )
    spec = job_dict(tiny_model, src, tmp_path / "out")
    spec["input"] |= {"messages_column": None, "prompt_column": "prompt", "passthrough_columns": []}
    tokenized = []
    real = dry_run_module.prompt_ids_for
    monkeypatch.setattr(
        dry_run_module,
        "prompt_ids_for",
        lambda row, tok, chat: tokenized.append(row.row_id) or real(row, tok, chat),
    )
    report = dry_run(JobSpec.from_dict(spec))
    assert (report.rows, report.bad_rows, tokenized) == (2, 1, ["a"])
    assert "prompt has 1,000,000 characters, so at least" in report.bad_examples[0][1]


def test_the_dry_run_says_how_far_it_has_read(
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """It printed nothing for minutes on a big input (115 s on 1M rows)."""
    import logging

    from tokenmill.jobs import dry_run as dry_run_module

    monkeypatch.setattr(dry_run_module, "PROGRESS_EVERY_S", 0.0)
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    with caplog.at_level(logging.INFO, logger="tokenmill.jobs"):
        dry_run(JobSpec.from_dict(job_dict(tiny_model, src, tmp_path / "out")))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dry run: ")]
    assert [line.split(" rows read")[0] for line in lines] == [
        "dry run: 1",
        "dry run: 2",
        "dry run: 3",
    ]


def test_the_dry_run_of_a_resumed_job_counts_the_work_left(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A job done to the end (or half way) was estimated as if none of it were: every row's
    output tokens and time, beside "already done 6 rows"."""
    from tokenmill import run_job

    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(6))
    raw = job_dict(tiny_model, src, tmp_path / "out", sampling={"max_tokens": 8})
    before = dry_run(JobSpec.from_dict(raw))
    assert before.output_tokens == 48 and before.rows_already_done == 0
    assert "count the rows not done yet" not in before.summary()
    run_job(raw, show_progress=False)
    after = dry_run(JobSpec.from_dict(raw))
    assert (after.rows, after.rows_already_done, after.output_tokens) == (6, 6, 0)
    assert after.prompt_tokens == 0
    assert "output tokens and the estimate count the rows not done yet" in after.summary()
    # An audit: `--dry-run --fresh` said "already done 6 rows", 0 tokens; a --fresh run
    # discards them and runs all 6.
    fresh = dry_run(JobSpec.from_dict(raw), fresh=True)
    assert (fresh.rows, fresh.rows_already_done, fresh.output_tokens) == (6, 0, 48)


def test_the_dry_run_of_a_job_whose_model_moved_hashes_its_input_once(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resumed job whose model folder moved (or whose manifest's shard size differs) took
    the job's settings twice: every input file's edges hashed again, the model's config read
    again (on an object store, two more requests a file). A run takes them once."""
    import shutil

    from tokenmill import run_job
    from tokenmill.jobs import runner

    first, moved = tmp_path / "a" / "model", tmp_path / "b" / "model"
    shutil.copytree(tiny_model, first)
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(6))
    run_job(job_dict(first, src, tmp_path / "out"), show_progress=False)
    shutil.move(first, moved)
    hashed: list[object] = []
    fingerprint_input = runner.fingerprint_input

    def counted(cfg: Any, *args: Any, **kwargs: Any) -> Any:
        hashed.append(cfg)
        return fingerprint_input(cfg, *args, **kwargs)

    monkeypatch.setattr(runner, "fingerprint_input", counted)
    report = dry_run(JobSpec.from_dict(job_dict(moved, src, tmp_path / "out")))
    assert report.resumable and report.rows_already_done == 6
    assert len(hashed) == 1


def test_the_dry_run_refuses_a_link_inside_the_output_as_a_run_does(
    tiny_model: Path, tmp_path: Path
) -> None:
    """An audit: the dry run passed an output folder holding a symbolic link (exit 0, with
    an estimate), which the run then refused (exit 2)."""
    from tokenmill.jobs.output_location import OutputPathError

    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(2))
    out = tmp_path / "out"
    out.mkdir()
    (out / "elsewhere").symlink_to(tmp_path)
    with pytest.raises(OutputPathError, match="holds a symbolic link"):
        dry_run(JobSpec.from_dict(job_dict(tiny_model, src, out)))


def test_a_stop_signal_stops_the_dry_run(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGTERM logged "stopping at the next commit boundary", then the dry run read on to
    the end and exited 0 (a second one became a bad row)."""
    import threading

    from tokenmill.jobs import dry_run as dry_run_module
    from tokenmill.jobs.stop_signals import JobInterrupted

    cancel = threading.Event()
    rows = dry_run_module.iter_input_rows

    def signalled_after_two(*args, **kwargs):
        for i, row in enumerate(rows(*args, **kwargs)):
            if i == 2:
                cancel.set()
            yield row

    monkeypatch.setattr(dry_run_module, "iter_input_rows", signalled_after_two)
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(5))
    spec = JobSpec.from_dict(job_dict(tiny_model, src, tmp_path / "out"))
    with pytest.raises(JobInterrupted, match="stopped after 2 rows"):
        dry_run(spec, cancel)


def test_a_stopped_dry_run_says_rerun_it_not_committed_shards_kept(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """An audit: a dry run stopped by a signal said "committed shards are kept; rerun the
    same command to resume", though a dry run writes nothing."""
    import yaml

    from tokenmill.jobs import dry_run as dry_run_module
    from tokenmill.jobs.cli import main as cli_main
    from tokenmill.jobs.stop_signals import JobInterrupted

    def stopped(*args, **kwargs):
        raise JobInterrupted("the dry run stopped after 0 rows")
        yield  # (a generator, as iter_input_rows is)

    monkeypatch.setattr(dry_run_module, "iter_input_rows", stopped)
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(5))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict(tiny_model, src, tmp_path / "out")))
    assert cli_main([str(job), "--dry-run", "--quiet"]) == 75
    err = capsys.readouterr().err
    assert "a dry run writes nothing; rerun it" in err and "committed shards" not in err


def test_a_dry_run_on_a_corrupt_input_says_rerun_it_not_committed_shards_kept(
    tiny_model: Path, tmp_path: Path, capsys: Any
) -> None:
    """An audit: a dry run of a corrupt Parquet input exited 2 saying "committed shards are
    kept; rerun the same command to resume once it is fixed", though a dry run writes
    nothing (the stop-signal message already said so)."""
    import yaml

    from tokenmill.jobs.cli import main as cli_main

    src = tmp_path / "in.parquet"
    src.write_bytes(b"junk")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict(tiny_model, src, tmp_path / "out")))
    assert cli_main([str(job), "--dry-run", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "not a readable Parquet file" in err
    assert "a dry run writes nothing; rerun it once it is fixed" in err
    assert "committed shards" not in err
    assert not (tmp_path / "out").exists()


def test_the_dry_run_refuses_another_jobs_output_as_a_run_does(
    tiny_model: Path, tmp_path: Path
) -> None:
    from tokenmill import run_job
    from tokenmill.jobs.ownership import OutputOwnedError

    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(2))
    out = tmp_path / "out"
    run_job(job_dict(tiny_model, src, out, name="first"), show_progress=False)
    other = JobSpec.from_dict(job_dict(tiny_model, src, out, name="other"))
    with pytest.raises(OutputOwnedError, match="first"):
        dry_run(other)


def test_the_dry_run_refuses_what_a_sliding_window_refuses(tmp_path: Path) -> None:
    """A model whose attention slides over a window shorter than its context runs prompts
    up to the window (the engine does not implement the slide); the dry run measured them
    against the whole context and passed rows every run then failed."""
    from tests.tiny_models import save_tiny_model
    from tokenmill import run_job
    from tokenmill.jobs.dry_run import dry_run
    from tokenmill.jobs.spec import JobSpec

    model = save_tiny_model(
        "mistral", tmp_path / "m", sliding_window=48, max_position_embeddings=1024
    )
    rows = [{"id": "short", "prompt": "hi"}, {"id": "long", "prompt": "word " * 80}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    spec = job_dict(model, src, tmp_path / "out")
    spec["input"] = {"path": str(src)}
    dry = dry_run(JobSpec.model_validate(spec))
    assert (dry.rows, dry.bad_rows) == (2, 1)
    assert dry.bad_examples[0][0] == "long"
    report = run_job(spec, show_progress=False)
    assert (report.rows_ok, report.rows_failed) == (1, 1)  # what the run refuses too
