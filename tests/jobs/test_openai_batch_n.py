"""OpenAI Batch ``n`` and ``logit_bias`` through a whole job: n choices in one output line
(checked with the openai package's own types), usage counting every choice, and the bias
applied as the Python API applies it."""

from __future__ import annotations

from pathlib import Path

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
from tokenmill.jobs.dry_run import dry_run
from tokenmill.jobs.spec import JobSpec


def test_n_choices_in_one_line_validate_and_match_the_python_api(
    tiny_model: Path, llm: LLM, tmp_path: Path
) -> None:
    messages = [{"role": "user", "content": "name three colours"}]
    chat = {"messages": messages, "n": 3, "temperature": 0.9, "seed": 11, "max_tokens": 6}
    chat_lp = {**chat, "n": 2, "logprobs": True, "top_logprobs": 1}
    comp = {"prompt": "Once upon", "n": 2, "temperature": 1.0, "seed": 3, "max_tokens": 4}
    lines = [
        batch_line("chat-n3", CHAT_URL, chat),
        batch_line("chat-n2-logprobs", CHAT_URL, chat_lp),
        batch_line("comp-n2", COMPLETIONS_URL, comp),
        batch_line("chat-n1", CHAT_URL, {"messages": messages, "max_tokens": 4}),
    ]
    spec = batch_job(tiny_model, lines, tmp_path, "openai-batch")
    report = run_job(spec, show_progress=False)
    assert (report.status, report.rows_ok, report.rows_failed) == ("complete", 4, 0)
    out = {x["custom_id"]: x for x in read_jsonl_dir(tmp_path / "out" / "shards")}
    assert len(out) == 4  # one line per input line, whatever its n

    body = ChatCompletion.model_validate(out["chat-n3"]["response"]["body"])
    assert [c.index for c in body.choices] == [0, 1, 2]
    # The same request through LLM.chat: the same seeds per completion, the same tokens.
    ref = llm.chat(messages, SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=6))[0]
    assert [c.message.content for c in body.choices] == [c.text for c in ref.outputs]
    assert len({c.message.content for c in body.choices}) > 1  # sampled: they differ
    assert body.usage is not None
    assert body.usage.completion_tokens == sum(len(c.token_ids) for c in ref.outputs)
    assert body.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert body.usage.total_tokens == body.usage.prompt_tokens + body.usage.completion_tokens

    with_lp = ChatCompletion.model_validate(out["chat-n2-logprobs"]["response"]["body"])
    assert [c.index for c in with_lp.choices] == [0, 1]
    for choice in with_lp.choices:
        assert choice.logprobs is not None and choice.logprobs.content
        assert all(len(e.top_logprobs) == 1 for e in choice.logprobs.content)

    completion = Completion.model_validate(out["comp-n2"]["response"]["body"])
    ref = llm.generate("Once upon", SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4))
    assert [c.text for c in completion.choices] == [c.text for c in ref[0].outputs]
    assert completion.usage is not None
    assert completion.usage.completion_tokens == sum(len(c.token_ids) for c in ref[0].outputs)

    single = ChatCompletion.model_validate(out["chat-n1"]["response"]["body"])
    assert len(single.choices) == 1


def test_logit_bias_in_batch_bodies(tiny_model: Path, llm: LLM, tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "hello"}]
    vocab = llm.engine.model_config.vocab_size
    greedy = llm.chat(messages, SamplingParams(max_tokens=5, temperature=0))[0]
    lines = [
        batch_line(
            "forced", CHAT_URL, {"messages": messages, "max_tokens": 5, "logit_bias": {"70": 100}}
        ),
        batch_line(
            "banned",
            CHAT_URL,
            {"messages": messages, "max_tokens": 5, "logit_bias": {str(greedy.token_ids[0]): -100}},
        ),
        batch_line("too-big", CHAT_URL, {"messages": messages, "logit_bias": {"70": 100.5}}),
        batch_line("not-an-id", CHAT_URL, {"messages": messages, "logit_bias": {"x7": 1}}),
        batch_line("past-vocab", CHAT_URL, {"messages": messages, "logit_bias": {str(vocab): 1}}),
    ]
    spec = batch_job(tiny_model, lines, tmp_path, "openai-batch")
    report = run_job(spec, show_progress=False)
    assert (report.rows_ok, report.rows_failed) == (2, 3)
    out = {
        x["custom_id"]: x["response"]["body"] for x in read_jsonl_dir(tmp_path / "out" / "shards")
    }
    forced = llm.chat(messages, SamplingParams(max_tokens=5, temperature=0, logit_bias={70: 100}))
    assert forced[0].token_ids == [70] * 5
    assert out["forced"]["choices"][0]["message"]["content"] == forced[0].text
    banned = out["banned"]["choices"][0]["message"]["content"]
    assert not banned.startswith(llm.tokenizer.decode(greedy.token_ids[:1]))

    errors = {
        e["custom_id"]: e["error"]["message"] for e in read_jsonl_dir(tmp_path / "out" / "errors")
    }
    assert (
        "body.logit_bias: the bias of token '70' must be a number in [-100, 100]"
        in (errors["too-big"])
    )
    assert "body.logit_bias: key 'x7' is not a token id" in errors["not-an-id"]
    assert f"logit_bias token ids outside the vocabulary [0, {vocab})" in errors["past-vocab"]
    assert dry_run(JobSpec.from_dict(spec)).bad_rows == 3  # the dry run finds the same rows


def test_n_needs_openai_batch_output(tiny_model: Path, tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "hi"}]
    lines = [
        batch_line("one", CHAT_URL, {"messages": messages, "max_tokens": 3}),
        batch_line("two", CHAT_URL, {"messages": messages, "max_tokens": 3, "n": 2}),
    ]
    spec = batch_job(tiny_model, lines, tmp_path, "jsonl")
    report = run_job(spec, show_progress=False)
    assert (report.rows_ok, report.rows_failed) == (1, 1)
    (error,) = read_jsonl_dir(tmp_path / "out" / "errors")
    assert error["id"] == "two"
    assert "n=2 asks for 2 completions, but output.format jsonl" in error["error"]
    assert "use output.format: openai-batch" in error["error"]
    assert dry_run(JobSpec.from_dict(spec)).bad_rows == 1


def test_job_yaml_logit_bias_applies_to_every_row(
    tiny_model: Path, llm: LLM, tmp_path: Path
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    spec = job_dict(tiny_model, src, tmp_path / "out", sampling={"logit_bias": {70: 100}})
    report = run_job(spec, show_progress=False)
    assert report.rows_ok == 3
    forced = llm.tokenizer.decode([70] * 8)  # job_dict's max_tokens: 8, greedy
    assert [r["text"] for r in read_jsonl_dir(tmp_path / "out" / "shards")] == [forced] * 3
