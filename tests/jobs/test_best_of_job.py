"""``best_of`` through whole jobs: an OpenAI Batch completions body's own, and the job.yaml
sampling section's for every row. The n choices written are the n best (by cumulative
logprob) of best_of samples, the ones ``LLM.generate`` returns for the same prompt, params
and seed; values best_of cannot take are row errors naming the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
from tokenmill import LLM, SamplingParams, run_job
from tokenmill.engine.seeds import input_row_seed
from tokenmill.jobs.dry_run import dry_run
from tokenmill.jobs.spec import JobSpec

PROMPT = "Once upon"
# Sampled, with a seed for which ranking matters: the 2 best of 4 samples are not the first 2.
BEST = {"n": 2, "best_of": 4, "temperature": 1.0, "seed": 5, "max_tokens": 6}


def _outputs(tmp_path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """({custom_id: response body}, {custom_id: error message}) of a finished job."""
    out = tmp_path / "out"
    bodies = {x["custom_id"]: x["response"]["body"] for x in read_jsonl_dir(out / "shards")}
    errors = {x["custom_id"]: x["error"]["message"] for x in read_jsonl_dir(out / "errors")}
    return bodies, errors


def test_best_of_in_completions_bodies_keeps_the_n_best(
    tiny_model: Path, llm: LLM, tmp_path: Path
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    lines = [
        batch_line("best", COMPLETIONS_URL, {"prompt": PROMPT, **BEST}),
        batch_line("best-logprobs", COMPLETIONS_URL, {"prompt": PROMPT, **BEST, "logprobs": 1}),
        batch_line("fewer-than-n", COMPLETIONS_URL, {"prompt": PROMPT, **BEST, "best_of": 1}),
        batch_line("chat", CHAT_URL, {"messages": messages, "best_of": 2}),
    ]
    spec = batch_job(tiny_model, lines, tmp_path)
    report = run_job(spec, show_progress=False)
    assert (report.status, report.rows_ok, report.rows_failed) == ("complete", 2, 2)
    bodies, errors = _outputs(tmp_path)

    ref = llm.generate(PROMPT, SamplingParams(**BEST))[0]
    # The best_of samples are the n=4 samples of the same seed; the 2 kept rank first.
    four = llm.generate(PROMPT, SamplingParams(**{**BEST, "n": 4, "best_of": None}, logprobs=0))
    samples = four[0].outputs
    ranked = sorted(samples, key=lambda c: -(c.cumulative_logprob or 0.0))
    assert [c.text for c in ref.outputs] == [c.text for c in ranked[:2]]
    assert [c.text for c in ranked[:2]] != [c.text for c in samples[:2]]  # ranking mattered

    completion = Completion.model_validate(bodies["best"])
    assert [c.index for c in completion.choices] == [0, 1]
    assert [c.text for c in completion.choices] == [c.text for c in ref.outputs]
    assert all(c.logprobs is None for c in completion.choices)  # ranked by, not asked for
    assert completion.usage is not None
    assert completion.usage.completion_tokens == sum(len(c.token_ids) for c in ref.outputs)

    with_lp = Completion.model_validate(bodies["best-logprobs"])
    assert [c.text for c in with_lp.choices] == [c.text for c in ref.outputs]
    for choice, want in zip(with_lp.choices, ref.outputs, strict=True):
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        assert len(choice.logprobs.token_logprobs) == len(want.token_ids)
        tops, tokens = choice.logprobs.top_logprobs or [], choice.logprobs.tokens or []
        # the likeliest, and the sampled token where it is another (OpenAI: logprobs + 1)
        assert all(1 <= len(top) <= 2 and tok in top for top, tok in zip(tops, tokens, strict=True))

    assert "body.best_of=1 is less than body.n=2" in errors["fewer-than-n"]
    assert "body.best_of=2 is not supported for /v1/chat/completions" in errors["chat"]
    assert dry_run(JobSpec.from_dict(spec)).bad_rows == 2


def test_job_yaml_best_of_applies_to_every_row(tiny_model: Path, llm: LLM, tmp_path: Path) -> None:
    """sampling.best_of in a plain JSONL job (n=1: the best of best_of, one text a row), and
    in an OpenAI Batch job, where a body's own best_of overrides it and a body's n above it
    is that row's error."""
    sampling = {"best_of": 3, "temperature": 1.0, "seed": 7}
    rows = chat_rows(3)
    src = write_jsonl(tmp_path / "plain" / "in.jsonl", rows)
    plain = job_dict(tiny_model, src, tmp_path / "plain" / "out", sampling=sampling)
    report = run_job(plain, show_progress=False)
    assert report.rows_ok == 3
    written = read_jsonl_dir(tmp_path / "plain" / "out" / "shards")
    texts = {r["id"]: r["text"] for r in written}
    # The run's tokens are the engine's work: every sample of best_of, not the rows' own.
    engine_tokens = report.throughput_over_time[-1][1]
    assert report.completion_tokens == engine_tokens > sum(r["completion_tokens"] for r in written)
    # Each row samples from its own seed, derived from the job's and its index in the input.
    want = [
        llm.chat(r["messages"], SamplingParams(max_tokens=8, **{**sampling, "seed": seed}))[0]
        for r, seed in ((r, input_row_seed(7, i)) for i, r in enumerate(rows))
    ]
    assert texts == {r["id"]: o.text for r, o in zip(rows, want, strict=True)}

    messages = rows[0]["messages"]
    lines = [
        batch_line("chat", CHAT_URL, {"messages": messages}),
        batch_line("own-best-of", COMPLETIONS_URL, {"prompt": PROMPT, **BEST}),
        batch_line("n-above", CHAT_URL, {"messages": messages, "n": 4}),
    ]
    spec = batch_job(tiny_model, lines, tmp_path / "batch")
    spec["sampling"].update(sampling)
    assert run_job(spec, show_progress=False).rows_ok == 2
    bodies, errors = _outputs(tmp_path / "batch")
    chat = ChatCompletion.model_validate(bodies["chat"])
    assert [c.message.content for c in chat.choices] == [want[0].text]
    own = Completion.model_validate(bodies["own-best-of"])
    ref = llm.generate(PROMPT, SamplingParams(**BEST))[0]
    assert [c.text for c in own.choices] == [c.text for c in ref.outputs]
    assert "n=4 completions, more than the job's sampling.best_of=3" in errors["n-above"]
    assert dry_run(JobSpec.from_dict(spec)).bad_rows == 1
