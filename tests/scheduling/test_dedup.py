"""Dedup: which rows count as identical, the held / cached / run decisions within their
bounds, and copies that carry their own row's identity."""

from __future__ import annotations

import pytest

from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.io.rows import InputRow, ResultRow
from tokenmill.jobs.requests import error_result
from tokenmill.scheduling.dedup import (
    HELD,
    RUN,
    Cached,
    Deduplicator,
    copy_result,
    dedup_key,
    text_prompt_bytes,
    token_prompt_bytes,
)

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
IDS = token_prompt_bytes([1, 2, 3, 300_000])


def test_same_prompt_and_sampling_share_a_key() -> None:
    key = dedup_key(IDS, GREEDY)
    assert key is not None and len(key) == 16
    same_ids = token_prompt_bytes([1, 2, 3, 300_000])
    assert dedup_key(same_ids, SamplingParams(max_tokens=8, temperature=0)) == key  # 0 == 0.0
    assert dedup_key(token_prompt_bytes([1, 2, 3]), GREEDY) != key
    assert dedup_key(IDS, SamplingParams(max_tokens=9, temperature=0.0)) != key
    assert dedup_key(IDS, SamplingParams(max_tokens=8, temperature=0.0, stop=("x",))) != key
    assert dedup_key(IDS, SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)) != key


def test_only_reproducible_rows_have_a_key() -> None:
    assert dedup_key(IDS, SamplingParams(temperature=0.7, seed=None)) is None  # two draws
    seeded = dedup_key(IDS, SamplingParams(temperature=0.7, seed=3))
    assert seeded is not None
    assert dedup_key(IDS, SamplingParams(temperature=0.7, seed=4)) not in (None, seeded)


def test_text_keys_tell_prompts_from_conversations() -> None:
    prompt = InputRow(0, "a", "f:1", prompt="hello")
    chat = InputRow(1, "b", "f:2", messages=[{"role": "user", "content": "hello"}])
    same_chat = InputRow(2, "c", "f:3", messages=[{"role": "user", "content": "hello"}])
    assert text_prompt_bytes(prompt) != text_prompt_bytes(chat)
    assert text_prompt_bytes(chat) == text_prompt_bytes(same_chat)
    assert text_prompt_bytes(prompt) != token_prompt_bytes([])
    # An OpenAI Batch body's own template variables make another prompt (Ray replicas
    # tokenize after the driver's dedup: the rows were one there)
    messages = [{"role": "user", "content": "hello"}]
    thinking = InputRow(3, "d", "f:4", messages=messages, chat_template_kwargs={"think": True})
    assert text_prompt_bytes(thinking) != text_prompt_bytes(chat)
    kept_open = InputRow(4, "e", "f:5", messages=messages, add_generation_prompt=False,
                         continue_final_message=True)  # fmt: skip
    assert text_prompt_bytes(kept_open) != text_prompt_bytes(chat)


def test_held_cached_and_run_decisions() -> None:
    dedup: Deduplicator[str, str] = Deduplicator(max_held=2, max_cached=1)
    a, b = b"a" * 16, b"b" * 16
    assert dedup.claim(a, 0, "row0") is RUN  # the primary of a
    assert dedup.claim(a, 1, "row1") is HELD
    assert dedup.claim(a, 2, "row2") is HELD
    assert dedup.claim(a, 3, "row3") is RUN  # no room to hold: it runs, as without dedup
    assert dedup.held == 2
    assert dedup.finished(3, "result3") == []  # not a primary
    assert dedup.finished(0, "result0") == ["row1", "row2"]
    assert dedup.held == 0
    assert dedup.claim(a, 4, "row4") == Cached("result0")
    assert dedup.claim(b, 5, "row5") is RUN
    assert dedup.finished(5, "result5") == []
    assert dedup.claim(a, 6, "row6") is RUN  # a's result was dropped for b's (max_cached=1)
    with pytest.raises(ValueError, match="max_held"):
        Deduplicator(max_held=-1, max_cached=0)


def test_a_copy_carries_its_own_rows_identity() -> None:
    first = InputRow(3, "q1", "in.jsonl:4", messages=[], passthrough={"k": 1}, custom_id="c1")
    twin = InputRow(
        9, "q2", "in.jsonl:10", messages=[], passthrough={"k": 2}, custom_id="c2", endpoint="/e"
    )
    result = ResultRow(
        3, "q1", text="hi", finish_reason="stop", prompt_tokens=5, completion_tokens=2,
        passthrough={"k": 1}, custom_id="c1", model="m", source="in.jsonl:4",
    )  # fmt: skip
    copy = copy_result(result, twin)
    expected_identity = error_result(twin, "", "m")
    for name in ("row_index", "row_id", "source", "passthrough", "custom_id", "endpoint"):
        assert getattr(copy, name) == getattr(expected_identity, name), name
    assert (copy.text, copy.finish_reason, copy.prompt_tokens, copy.completion_tokens) == (
        "hi", "stop", 5, 2,
    )  # fmt: skip
    failed = copy_result(error_result(first, "prompt too long", "m"), twin)
    assert failed.row_id == "q2" and failed.error == (  # whose error it is (an audit)
        "in.jsonl:10: prompt too long (the error of the identical row at in.jsonl:4: this "
        "row was not run again)"
    )
