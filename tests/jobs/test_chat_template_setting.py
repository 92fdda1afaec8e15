"""``model.chat_template`` / ``model.chat_template_kwargs`` in a job: conversations rendered
with the job's template and variables (as ``LLM.chat`` renders them with the same
arguments), in a run and in a dry run; the template given as text or as a file; bad values
refused naming the key; a change of either refuses a resume."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.jobs.job_helpers import TINY_ENGINE, chat_rows, job_dict, read_jsonl_dir, write_jsonl
from tokenmill import LLM, SamplingParams, run_job
from tokenmill.jobs.dry_run import dry_run
from tokenmill.jobs.manifest import FingerprintMismatchError
from tokenmill.jobs.spec import JobSpec, JobSpecError

# Shouts the messages when the job says so: a variable only this template reads.
TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if shout %}{{ m['content'] | upper }}{% else %}{{ m['content'] }}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _spec(model: Path, tmp_path: Path, **model_keys: object) -> dict:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(6))
    spec = job_dict(model, src, tmp_path / "out")
    spec["model"].update(model_keys)
    return spec


def test_a_job_renders_with_its_template_and_variables(tiny_model: Path, tmp_path: Path) -> None:
    spec = _spec(tiny_model, tmp_path, chat_template=TEMPLATE, chat_template_kwargs={"shout": True})
    report = run_job(spec, show_progress=False)
    assert report.status == "complete" and report.rows_ok == 6
    got = {r["id"]: r for r in read_jsonl_dir(tmp_path / "out" / "shards")}

    llm = LLM(str(tiny_model), **TINY_ENGINE)
    rows = chat_rows(6)
    convs = [r["messages"] for r in rows]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    want = llm.chat(convs, params, chat_template=TEMPLATE, chat_template_kwargs={"shout": True})
    plain = llm.chat(convs, params)
    for row, out, own in zip(rows, want, plain, strict=True):
        ids = llm.encode_chat(
            row["messages"], chat_template=TEMPLATE, chat_template_kwargs={"shout": True}
        )
        assert "QUESTION NUMBER" in llm.tokenizer.decode(ids)
        assert got[row["id"]]["prompt_tokens"] == len(ids) == len(out.prompt_token_ids)
        assert got[row["id"]]["text"] == out.outputs[0].text
        assert list(out.prompt_token_ids) != list(own.prompt_token_ids)  # not the model's own

    # The dry run counts the same prompts.
    estimate = dry_run(
        JobSpec.from_dict(
            _spec(
                tiny_model,
                tmp_path / "dry",
                chat_template=TEMPLATE,
                chat_template_kwargs={"shout": True},
            )
        )
    )
    assert estimate.prompt_tokens == sum(len(o.prompt_token_ids) for o in want)


def test_the_template_may_be_a_file(tiny_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "shout.jinja"
    path.write_text(TEMPLATE)
    spec = JobSpec.from_dict(_spec(tiny_model, tmp_path, chat_template=str(path)))
    assert spec.model.chat_template == TEMPLATE  # the text travels with the spec (Ray)
    assert JobSpec.from_dict(spec.to_dict()).model.chat_template == TEMPLATE


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"chat_template": "templates/none.jinja"}, "model.chat_template: no file"),
        ({"chat_template": ""}, "model.chat_template"),
        ({"chat_template": 5}, "model.chat_template"),
        (  # the message names the setting of its own a job has for it
            {"chat_template_kwargs": {"add_generation_prompt": False}},
            "may not set add_generation_prompt: chat_template, add_generation_prompt and "
            "continue_final_message are settings of their own (job.yaml: model.chat_template, "
            "model.add_generation_prompt",
        ),
        # transformers renders the conversation under these names: every row failed, exit 0
        ({"chat_template_kwargs": {"messages": 1}}, "may not set messages"),
        ({"chat_template_kwargs": {"conversations": []}}, "may not set conversations"),
        ({"chat_template_kwargs": {"not-a-name": 1}}, "keys must be identifiers"),
        ({"chat_template_kwargs": ["shout"]}, "model.chat_template_kwargs"),
    ],
)
def test_bad_values_are_refused_naming_the_key(
    tiny_model: Path, tmp_path: Path, keys: dict, message: str
) -> None:
    with pytest.raises(JobSpecError, match="model.chat_template") as info:
        JobSpec.from_dict(_spec(tiny_model, tmp_path, **keys))
    assert message in str(info.value)


def test_a_yaml_date_variable_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    import datetime

    with pytest.raises(JobSpecError, match="when: date values cannot be kept"):
        JobSpec.from_dict(
            _spec(tiny_model, tmp_path, chat_template_kwargs={"when": datetime.date(2026, 1, 2)})
        )


def test_tools_the_template_never_reads_fail_the_job(tiny_model: Path, tmp_path: Path) -> None:
    """Tools in model.chat_template_kwargs that the template never reads were dropped from
    every prompt; the job ran as if none had been given."""
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    spec = _spec(
        tiny_model, tmp_path, chat_template=TEMPLATE, chat_template_kwargs={"tools": tools}
    )
    with pytest.raises(JobSpecError, match="model.chat_template_kwargs.tools: tools are given"):
        run_job(spec, show_progress=False)
    assert not (tmp_path / "out" / "shards").exists()


def test_a_template_that_does_not_compile_fails_the_job(tiny_model: Path, tmp_path: Path) -> None:
    spec = _spec(tiny_model, tmp_path, chat_template="{% for m in messages %}{{ m }")
    with pytest.raises(JobSpecError, match="model.chat_template: the template does not compile"):
        run_job(spec, show_progress=False)
    assert not (tmp_path / "out" / "shards").exists()


def test_changing_the_variables_refuses_a_resume(tiny_model: Path, tmp_path: Path) -> None:
    spec = _spec(tiny_model, tmp_path, chat_template=TEMPLATE, chat_template_kwargs={"shout": True})
    run_job(spec, show_progress=False)
    spec["model"]["chat_template_kwargs"] = {"shout": False}
    with pytest.raises(FingerprintMismatchError, match="chat_template_kwargs.shout: true -> false"):
        run_job(spec, show_progress=False)
    spec["model"]["chat_template_kwargs"] = {"shout": True}
    spec["model"]["chat_template"] = TEMPLATE.replace("upper", "lower")
    with pytest.raises(FingerprintMismatchError, match="chat_template"):
        run_job(spec, show_progress=False)


def test_openai_batch_bodies_bring_their_own_variables(tiny_model: Path, tmp_path: Path) -> None:
    """vLLM's chat bodies take chat_template_kwargs (Qwen3's enable_thinking, per request):
    a body's variables go over the job's; two bodies alike but for them are two prompts,
    not one computed once and copied (dedup); bad ones are the row's error."""
    from tests.jobs.job_helpers import CHAT_URL, batch_job, batch_line

    messages = [{"role": "user", "content": "shout or not"}]
    lines = [
        batch_line("job", CHAT_URL, {"messages": messages}),
        batch_line(
            "own", CHAT_URL, {"messages": messages, "chat_template_kwargs": {"shout": False}}
        ),
        batch_line(
            "bad", CHAT_URL, {"messages": messages, "chat_template_kwargs": {"tokenize": 1}}
        ),
        batch_line("tpl", CHAT_URL, {"messages": messages, "chat_template": TEMPLATE}),
    ]
    spec = batch_job(tiny_model, lines, tmp_path, fmt="jsonl")
    spec["model"].update(chat_template=TEMPLATE, chat_template_kwargs={"shout": True})
    report = run_job(spec, show_progress=False)
    assert report.rows_ok == 2 and report.rows_failed == 2
    got = {r["id"]: r for r in read_jsonl_dir(tmp_path / "out" / "shards")}
    llm = LLM(str(tiny_model), **TINY_ENGINE)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    texts = {}
    for custom_id, shout in (("job", True), ("own", False)):
        kwargs = {"shout": shout}
        want = llm.chat([messages], params, chat_template=TEMPLATE, chat_template_kwargs=kwargs)
        texts[custom_id] = want[0].outputs[0].text
        assert got[custom_id]["text"] == texts[custom_id]
    assert texts["job"] != texts["own"]  # two prompts, two texts: not one copied
    errors = "".join(p.read_text() for p in (tmp_path / "out" / "errors").iterdir())
    assert "body.chat_template_kwargs may not set tokenize" in errors
    assert "body.chat_template is not taken from a batch line; set model.chat_template" in errors


def test_an_openai_batch_body_may_continue_its_last_message(
    tiny_model: Path, tmp_path: Path
) -> None:
    """vLLM's chat bodies take continue_final_message (with add_generation_prompt false):
    the row's prompt ends inside the assistant message it began, as LLM.chat renders it;
    both true is the row's error; a row that continues is not a copy of one that does not."""
    from tests.jobs.job_helpers import CHAT_URL, batch_job, batch_line

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    ending = {"add_generation_prompt": False, "continue_final_message": True}
    lines = [
        batch_line("open", CHAT_URL, {"messages": messages, **ending}),
        batch_line("closed", CHAT_URL, {"messages": messages}),
        batch_line("both", CHAT_URL, {"messages": messages, "continue_final_message": True}),
    ]
    spec = batch_job(tiny_model, lines, tmp_path, fmt="jsonl")
    report = run_job(spec, show_progress=False)
    assert (report.rows_ok, report.rows_failed) == (2, 1)
    got = {r["id"]: r for r in read_jsonl_dir(tmp_path / "out" / "shards")}
    llm = LLM(str(tiny_model), **TINY_ENGINE)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    want = llm.chat([messages], params, **ending)[0]
    assert want.prompt.endswith("Hel")
    assert got["open"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert got["open"]["text"] == want.outputs[0].text
    assert got["closed"]["prompt_tokens"] == len(llm.encode_chat(messages))
    errors = "".join(p.read_text() for p in (tmp_path / "out" / "errors").iterdir())
    assert "continue_final_message and add_generation_prompt cannot both be true" in errors


def test_a_relative_template_file_not_found_says_where_it_was_looked_for(
    tiny_model: Path, tmp_path: Path, monkeypatch
) -> None:
    """A job run from another directory (cron, Airflow) named only the relative path."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with pytest.raises(JobSpecError) as info:
        JobSpec.from_dict(_spec(tiny_model, tmp_path, chat_template="templates/t.jinja"))
    assert str(elsewhere / "templates" / "t.jinja") in str(info.value)
    assert "working directory" in str(info.value)
