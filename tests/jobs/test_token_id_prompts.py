"""Prompts given as token ids: OpenAI Batch completions bodies (``"prompt": [ids]``) through a
whole job, and vLLM's dict prompts in ``LLM.generate``; both run what the text would."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from openai.types import Completion

from tests.jobs.job_helpers import COMPLETIONS_URL, batch_job, batch_line, read_jsonl_dir
from tokenmill import LLM, SamplingParams, run_job
from tokenmill.jobs.dry_run import dry_run
from tokenmill.jobs.spec import JobSpec


def test_token_id_prompts_run_as_their_text_does(
    tiny_model: Path, llm: LLM, tmp_path: Path
) -> None:
    text = "Once upon a time"
    ids = llm.tokenizer(text)["input_ids"]  # with the model's BOS rules, as a text prompt
    vocab = llm.engine.model_config.vocab_size
    body = {"max_tokens": 6, "temperature": 0}
    lines = [
        batch_line("text", COMPLETIONS_URL, {**body, "prompt": text}),
        batch_line("ids", COMPLETIONS_URL, {**body, "prompt": ids}),
        batch_line("nested", COMPLETIONS_URL, {**body, "prompt": [ids]}),
        batch_line("past-vocab", COMPLETIONS_URL, {**body, "prompt": [1, vocab]}),
        batch_line("other", COMPLETIONS_URL, {**body, "prompt": ids[:-1]}),
    ]
    spec = batch_job(tiny_model, lines, tmp_path)
    spec["planner"] = {"dedup": False}  # every row computed, not copied from its twin
    dry = dry_run(JobSpec.model_validate(spec))
    assert (dry.rows, dry.bad_rows) == (5, 1)
    assert f"outside the vocabulary [0, {vocab})" in dry.bad_examples[0][1]
    report = run_job(spec, show_progress=False)
    assert (report.status, report.rows_ok, report.rows_failed) == ("complete", 4, 1)
    out = {
        x["custom_id"]: x["response"]["body"] for x in read_jsonl_dir(tmp_path / "out" / "shards")
    }
    bodies = {k: Completion.model_validate(v) for k, v in out.items()}
    ref = llm.generate(text, SamplingParams(max_tokens=6, temperature=0))[0]
    for key in ("text", "ids", "nested"):
        assert bodies[key].choices[0].text == ref.text
        assert bodies[key].usage is not None
        assert bodies[key].usage.prompt_tokens == len(ids)
    assert bodies["other"].usage is not None and bodies["other"].usage.prompt_tokens == len(ids) - 1
    (error,) = read_jsonl_dir(tmp_path / "out" / "errors")
    assert error["custom_id"] == "past-vocab"
    assert f"outside the vocabulary [0, {vocab})" in error["error"]["message"]


def test_token_id_twins_are_deduplicated(tiny_model: Path, llm: LLM, tmp_path: Path) -> None:
    ids = llm.tokenizer("a shared prompt")["input_ids"]
    body = {"max_tokens": 4, "temperature": 0, "prompt": ids}
    lines = [batch_line(f"r{i}", COMPLETIONS_URL, body) for i in range(3)]
    lines.append(batch_line("shorter", COMPLETIONS_URL, {**body, "prompt": ids[:-1]}))
    report = run_job(batch_job(tiny_model, lines, tmp_path), show_progress=False)
    assert (report.rows_ok, report.rows_deduplicated) == (4, 2)
    texts = {
        x["custom_id"]: x["response"]["body"]["choices"][0]["text"]
        for x in read_jsonl_dir(tmp_path / "out" / "shards")
    }
    assert texts["r0"] == texts["r1"] == texts["r2"]


def test_generate_takes_vllm_dict_prompts(llm: LLM) -> None:
    params = SamplingParams(max_tokens=5, temperature=0)
    ids = llm.tokenizer("hello there")["input_ids"]
    plain = llm.generate(["hello there", ids], params)
    dicts = llm.generate([{"prompt": "hello there"}, {"prompt_token_ids": ids}], params)
    assert [o.text for o in dicts] == [o.text for o in plain]
    assert dicts[0].text == dicts[1].text  # the same tokens
    assert dicts[0].prompt == "hello there" and dicts[1].prompt is None
    (single,) = llm.generate({"prompt_token_ids": tuple(ids)}, params)
    assert single.text == plain[0].text
    one_each = (tuple(ids), np.array(ids), np.array(ids, dtype=np.int32), torch.tensor(ids),
                [np.int64(t) for t in ids])  # fmt: skip
    for one in one_each:  # one prompt each
        (out,) = llm.generate(one, params)
        assert out.text == plain[0].text


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ({}, "a dict prompt holds 'prompt' (text) or 'prompt_token_ids'"),
        (
            {"multi_modal_data": {}},
            "'multi_modal_data' is not supported (the engine runs text-only",
        ),
        ({"prompt_token_ids": [1, 2.5]}, "'prompt_token_ids' holds a list of token ids; got list"),
        ({"prompt_token_ids": [True, 1]}, "token ids; got list holding bool (ids are integers)"),
        ([True, 2, 3], "expected text or a list of token ids, got list holding bool"),
        ([1, 2.5, "x"], "got list holding float, str (ids are integers)"),
        ({"prompt_token_ids": np.array([[1, 2]])}, "got ndarray of int64 with shape (1, 2)"),
        ({"prompt_token_ids": np.array([1.0, 2.0])}, "got ndarray"),
        ({"prompt": None}, "'prompt' holds text; got NoneType"),
        ({"prompt_token_ids": "text"}, "'prompt_token_ids' holds a list of token ids; got str"),
        ({"prompt": [1, 2]}, "'prompt' holds text"),
        ({"prompt": 5, "prompt_token_ids": [1]}, "'prompt' holds text; got int"),
    ],
)
def test_generate_refuses_other_prompt_forms(llm: LLM, prompt: object, message: str) -> None:
    with pytest.raises(ValueError, match="prompt 1: ") as caught:
        llm.generate(["fine", prompt], SamplingParams(max_tokens=2))  # type: ignore[list-item]
    assert message in str(caught.value)
