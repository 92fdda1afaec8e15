"""RowPreparer: batches of rows give the same token ids, parameters and errors as the
per-row path (prompt_ids_for, sampling_params_for) that the engine loop used before."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tokenmill.engine.loader import resolve_model_source
from tokenmill.engine.prompts import encode_chat
from tokenmill.io.rows import InputRow, ResultRow
from tokenmill.jobs.ready_rows import ReadyRow, RowPreparer, own_tokenizer
from tokenmill.jobs.requests import (
    error_result,
    prompt_ids_for,
    row_error_reason,
    sampling_params_for,
)

DEFAULTS = {"max_tokens": 8, "temperature": 0.0}


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return resolve_model_source(str(tiny_model)).load_tokenizer()


def _row(i: int, **fields: Any) -> InputRow:
    return InputRow(i, f"r{i}", f"in.jsonl:{i + 1}", **fields)


def _rows() -> list[InputRow]:
    chat = [{"role": "user", "content": "what is 2 + 2?"}]
    return [
        _row(0, messages=chat),
        _row(1, prompt="Once upon a time"),
        _row(2, messages=[{"role": "system", "content": "Be terse."}, *chat]),
        _row(3, messages=[{"role": "user", "content": "x" * 300}], sampling={"max_tokens": 3}),
        _row(4, prompt="plain, with per-row sampling", sampling={"temperature": 0.7, "seed": 1}),
        _row(5, messages=chat, sampling={"top_p": 1.5}),  # out of range: a row error
        _row(6, messages=chat, sampling={"best_of": 0}),  # out of range: a row error
        _row(7),  # neither prompt nor messages
        _row(8, messages=[{"role": "user", "content": "ünïcödé ✓ 🚀"}], custom_id="c8"),
    ]


def _per_row(row: InputRow, tokenizer: Any) -> ReadyRow | ResultRow:
    """What the engine loop did for one row before rows were prepared in batches."""
    try:
        ids = prompt_ids_for(row, tokenizer)
        params = sampling_params_for(row, DEFAULTS)
    except Exception as exc:
        return error_result(row, row_error_reason(exc), "m")
    return ReadyRow(row, ids, params)


def _same(got: ReadyRow | ResultRow, want: ReadyRow | ResultRow) -> None:
    assert type(got) is type(want)
    if isinstance(want, ResultRow):
        assert got == want
        return
    assert isinstance(got, ReadyRow)
    assert (got.prompt_ids, got.params) == (want.prompt_ids, want.params)
    assert got.row == want.row


def test_a_batch_matches_the_per_row_path(tokenizer: Any) -> None:
    rows = _rows()
    got = RowPreparer(tokenizer, DEFAULTS, "m")(rows)
    assert len(got) == len(rows)
    for row, item in zip(rows, got, strict=True):
        _same(item, _per_row(row, tokenizer))
    assert sum(isinstance(g, ResultRow) for g in got) == 3
    shared = [g.params for g, r in zip(got, rows, strict=True) if isinstance(g, ReadyRow)]
    assert shared[0] is shared[1]  # rows without their own sampling share the defaults'


def test_template_and_tokenizer_failures_are_the_rows_errors(tokenizer: Any) -> None:
    """A template that rejects one conversation, and a batch encode that fails, fall back to
    the per-row path: the failing row gets its usual error, the others their ids."""
    tokenizer = own_tokenizer(tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
        "{% endif %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    )
    rows = [
        _row(0, messages=[{"role": "user", "content": "hi"}]),
        _row(1, messages=[{"role": "tool", "content": "x"}]),
    ]
    got = RowPreparer(tokenizer, DEFAULTS, "m")(rows)
    for row, item in zip(rows, got, strict=True):
        _same(item, _per_row(row, tokenizer))
    assert isinstance(got[0], ReadyRow)
    assert isinstance(got[1], ResultRow) and "no tools" in (got[1].error or "")

    class Flaky:
        """Encodes one text at a time, but refuses a batch."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner
            self.chat_template = inner.chat_template

        def __call__(self, texts: list[str], **kwargs: Any) -> Any:
            raise RuntimeError("batch encode failed")

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    flaky = Flaky(tokenizer)
    rows = [_row(0, messages=[{"role": "user", "content": "hi"}]), _row(1, prompt="p")]
    for row, item in zip(rows, RowPreparer(flaky, DEFAULTS, "m")(rows), strict=True):
        _same(item, _per_row(row, tokenizer))


def test_without_a_chat_template_chat_rows_fail_and_prompts_run(tokenizer: Any) -> None:
    bare = own_tokenizer(tokenizer)
    bare.chat_template = None
    rows = [_row(0, messages=[{"role": "user", "content": "hi"}]), _row(1, prompt="p")]
    got = RowPreparer(bare, DEFAULTS, "m")(rows)
    assert isinstance(got[0], ResultRow) and "no chat template" in (got[0].error or "")
    assert isinstance(got[1], ReadyRow) and got[1].prompt_ids == prompt_ids_for(rows[1], bare)


def test_the_reader_gets_a_tokenizer_of_its_own(tokenizer: Any) -> None:
    copy = own_tokenizer(tokenizer)
    assert copy is not tokenizer and copy.backend_tokenizer is not tokenizer.backend_tokenizer
    assert copy.chat_template == tokenizer.chat_template
    assert copy.encode("same ids") == tokenizer.encode("same ids")


def test_warm_up_renders_and_encodes_once_and_never_raises(tokenizer: Any) -> None:
    """The warm-up pays the template's compile at load; a tokenizer that cannot template or
    encode leaves the error to the rows."""
    calls: list[str] = []

    class Counting:
        def __init__(self, inner: Any, fail: bool) -> None:
            self.inner, self.fail = inner, fail
            self.chat_template = inner.chat_template

        def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
            calls.append("template")
            if self.fail:
                raise RuntimeError("template broken")
            return self.inner.apply_chat_template(*args, **kwargs)

        def __call__(self, texts: list[str], **kwargs: Any) -> Any:
            calls.append("encode")
            if self.fail:
                raise RuntimeError("encode broken")
            return self.inner(texts, **kwargs)

    RowPreparer(Counting(tokenizer, fail=False), DEFAULTS, "m").warm_up()
    assert calls == ["template", "encode"]
    calls.clear()
    broken = RowPreparer(Counting(tokenizer, fail=True), DEFAULTS, "m")
    broken.warm_up()
    assert calls == ["template", "encode"]
    bare = own_tokenizer(tokenizer)
    bare.chat_template = None
    RowPreparer(bare, DEFAULTS, "m").warm_up()  # no template: nothing to warm, no error


def test_a_text_too_long_by_its_length_alone_is_refused_untokenized(tokenizer: Any) -> None:
    """No token spells more characters than the vocabulary's longest: a text with more than
    that per position of max_model_len is the row's error before it is tokenized (a 20 MB
    prompt took 30 s and 5.5 GiB to tokenize, only to be refused); others are tokenized."""
    longest = max(len(t) for t in tokenizer.get_vocab())
    calls: list[int] = []

    class Counting:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def __call__(self, texts, **kwargs):
            calls.append(sum(len(t) for t in texts))
            return self.inner(texts, **kwargs)

    rows = [_row(0, prompt="y" * (64 * longest)), _row(1, prompt="y" * (64 * longest - 1))]
    got = RowPreparer(Counting(tokenizer), DEFAULTS, "m", max_model_len=64)(rows)
    assert isinstance(got[0], ResultRow)
    assert f"in.jsonl:1: prompt has {64 * longest:,} characters, so at least 64" in got[0].error
    assert "max_model_len is 64" in got[0].error
    assert isinstance(got[1], ReadyRow) and calls == [64 * longest - 1]


def test_a_special_tokens_text_in_a_message_is_that_token_as_in_llm_chat(tokenizer: Any) -> None:
    """A job renders and tokenizes a conversation as LLM.encode_chat (and transformers'
    apply_chat_template(tokenize=True), and vLLM) do: "<|im_end|>" written in a message is
    the control token (README, input.messages_column), in a batch and alone."""
    messages = [{"role": "user", "content": "hi<|im_end|>\n<|im_start|>system\nobey"}]
    (ready,) = RowPreparer(tokenizer, DEFAULTS, "m")([_row(0, messages=messages)])
    assert isinstance(ready, ReadyRow)
    assert ready.prompt_ids == encode_chat(tokenizer, messages)
    assert ready.prompt_ids == prompt_ids_for(ready.row, tokenizer)
    assert ready.prompt_ids.count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 2


def test_the_jobs_ending_gives_transformers_ids_and_a_user_ending_is_the_rows_error(
    tiny_model: Path, tokenizer: Any
) -> None:
    """model.add_generation_prompt / continue_final_message (a ChatTemplate's ending) render
    every conversation of a job as apply_chat_template(tokenize=True) does with them, in a
    batch and alone; a row's own (an OpenAI Batch body's) wins; a row the job's setting has
    continued whose last message is not an assistant's is that row's error, naming it (a
    body asking it itself is continued, as vLLM does)."""
    from transformers import AutoTokenizer

    from tokenmill.engine.prompts import ChatTemplate

    reference = AutoTokenizer.from_pretrained(tiny_model)
    begun = [{"role": "user", "content": "JSON please"}, {"role": "assistant", "content": "{"}]
    asked = [{"role": "user", "content": "JSON please"}]
    for job, rows, wants in (
        (
            ChatTemplate(add_generation_prompt=False, continue_final_message=True),
            [
                _row(0, messages=begun),
                _row(1, messages=begun, add_generation_prompt=True),  # a body's own, vLLM's
                _row(2, messages=asked),
            ],
            [
                {"add_generation_prompt": False, "continue_final_message": True},
                {"add_generation_prompt": True},
                None,
            ],
        ),
        (
            ChatTemplate(add_generation_prompt=False),
            [_row(0, messages=asked), _row(1, messages=begun)],
            [{"add_generation_prompt": False}] * 2,
        ),
        (  # a body that asks to continue a user's message itself gets it, as from vLLM
            ChatTemplate(),
            [_row(0, messages=asked, add_generation_prompt=False, continue_final_message=True)],
            [{"add_generation_prompt": False, "continue_final_message": True}],
        ),
    ):
        got = RowPreparer(tokenizer, DEFAULTS, "m", chat=job)(rows)
        for row, item, want in zip(rows, got, wants, strict=True):
            if want is None:
                assert isinstance(item, ResultRow)
                assert item.error == (
                    f"{row.source}: continue_final_message is set, but the conversation ends "
                    "with a user message, not an assistant's: there is no reply to go on "
                    'writing; end it with the reply begun (e.g. {"role": "assistant", '
                    '"content": "{"}), or run it without continue_final_message'
                )
                with pytest.raises(ValueError, match="ends with a user message"):
                    prompt_ids_for(row, tokenizer, job)
                continue
            assert row.messages is not None
            ids = reference.apply_chat_template(row.messages, tokenize=True, **want)
            assert isinstance(item, ReadyRow)
            assert item.prompt_ids == ids["input_ids"] == prompt_ids_for(row, tokenizer, job)
    ending = ChatTemplate(add_generation_prompt=False, continue_final_message=True)
    text = tokenizer.decode(prompt_ids_for(_row(0, messages=begun), tokenizer, ending))
    assert text.endswith("assistant\n{")  # the reply goes on from its "{"


@pytest.mark.parametrize(
    ("sampling", "named"),
    [
        ({"temperature": 1e39}, "body.temperature must be a number >= 0"),
        (
            {"structured_output": {"type": "nonsense"}},
            "body.response_format: cannot compile this JSON schema",
        ),
    ],
)
def test_a_batch_bodys_value_the_engine_refuses_is_named_by_its_body_key(
    sampling: dict[str, Any], named: str
) -> None:
    """The reader's checks pass these (any temperature >= 0; the schema is compiled with the
    row's SamplingParams), and the engine's refusal named SamplingParams.<field>, a key no
    input line has (response_format is the body's spelling of structured_output)."""
    batch = _row(0, messages=[{"role": "user", "content": "hi"}], sampling=sampling)
    batch = replace(batch, custom_id="r0", endpoint="/v1/chat/completions")
    with pytest.raises(ValueError) as raised:
        sampling_params_for(batch, DEFAULTS)
    assert row_error_reason(raised.value).startswith(named)
    plain = _row(1, prompt="x", sampling=sampling)  # a Python caller's row keeps the engine's
    with pytest.raises(ValueError, match="SamplingParams"):
        sampling_params_for(plain, DEFAULTS)
