"""Result rows as OpenAI Batch output lines (one JSON object per line).

A good row becomes

    {"id": "batch_req_<hex>", "custom_id": "...", "error": null,
     "response": {"status_code": 200, "request_id": "req_<hex>",
                  "body": <a chat.completion or text_completion object>}}

A row that asked for ``n`` completions has n choices (index 0..n-1) in its one line, and
its ``usage.completion_tokens`` counts them all (with ``best_of``, the n returned). A row that
asked for prompt logprobs has them where vLLM's OpenAI server writes them (a vLLM field, not
OpenAI's): on each choice of a text_completion, on the chat.completion itself
(``prompt_logprobs_column.vllm_prompt_logprobs``). Each choice's own logprobs, when the row
asked for them, are in OpenAI's shapes (``logprobs_column.py``). A failed row, in the
separate error file:

    {"id": "batch_req_<hex>", "custom_id": "...", "response": null,
     "error": {"code": "invalid_request", "message": "..."}}

Every id is a hash of the row's place in the input (its row index: the same in every run and
resume of the job, and never another row's) and its id, so each line of a job has its own
``id`` (as OpenAI's do), also when two input lines share a custom_id (the second is a row
error, under its file:line). ``created`` is passed in (default 0), so a rerun of a greedy job
writes byte-identical lines: that is what makes a recomputed shard indistinguishable from the
one a crash interrupted.
"""

from __future__ import annotations

import hashlib
from typing import Any

from tokenmill.io.logprobs_column import openai_chat_logprobs, openai_completion_logprobs
from tokenmill.io.prompt_logprobs_column import PROMPT_LOGPROBS, vllm_prompt_logprobs
from tokenmill.io.rows import Choice, ResultRow

__all__ = ["CHAT_ENDPOINT", "COMPLETIONS_ENDPOINT", "error_line", "result_line"]

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"


def _stable_hex(kind: str, row: ResultRow, n: int) -> str:
    key = f"{kind}\0{row.row_index}\0{row.row_id}"
    return hashlib.sha256(key.encode()).hexdigest()[:n]


def _custom_id(row: ResultRow) -> str:
    return row.custom_id if row.custom_id is not None else row.row_id


def result_line(row: ResultRow, created: int = 0) -> dict[str, Any]:
    """The Batch output object of a good row. Raises ValueError for an unknown endpoint."""
    if row.endpoint == CHAT_ENDPOINT:
        body = _chat_body(row, created)
    elif row.endpoint == COMPLETIONS_ENDPOINT:
        body = _completion_body(row, created)
    else:
        raise ValueError(
            f"row {row.row_id!r}: OpenAI Batch output needs url {CHAT_ENDPOINT!r} or "
            f"{COMPLETIONS_ENDPOINT!r}, got {row.endpoint!r}; fix the input line's 'url'"
        )
    return {
        "id": f"batch_req_{_stable_hex('batch_req', row, 32)}",
        "custom_id": _custom_id(row),
        "response": {
            "status_code": 200,
            "request_id": f"req_{_stable_hex('request', row, 32)}",
            "body": body,
        },
        "error": None,
    }


def error_line(row: ResultRow) -> dict[str, Any]:
    """The Batch error-file object of a failed row."""
    return {
        "id": f"batch_req_{_stable_hex('batch_req', row, 32)}",
        "custom_id": _custom_id(row),
        "response": None,
        "error": {"code": "invalid_request", "message": row.error or "unknown error"},
    }


def _choices(row: ResultRow) -> tuple[Choice, ...]:
    """The row's completions: all of them for a row that asked for n > 1, else its one."""
    if row.choices:
        return row.choices
    return (Choice(row.text, row.finish_reason, row.completion_tokens, row.logprobs),)


def _usage(row: ResultRow) -> dict[str, int]:
    # completion_tokens counts every choice's tokens (ResultRow), as OpenAI bills them.
    return {
        "prompt_tokens": row.prompt_tokens,
        "completion_tokens": row.completion_tokens,
        "total_tokens": row.prompt_tokens + row.completion_tokens,
    }


def _chat_body(row: ResultRow, created: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": f"chatcmpl-{_stable_hex('chatcmpl', row, 29)}",
        "object": "chat.completion",
        "created": created,
        "model": row.model,
        "choices": [
            {
                "index": index,
                "message": {"role": "assistant", "content": choice.text},
                "logprobs": _chat_logprobs(choice),
                "finish_reason": choice.finish_reason,
            }
            for index, choice in enumerate(_choices(row))
        ],
        "usage": _usage(row),
    }
    if row.prompt_logprobs is not None:
        body[PROMPT_LOGPROBS] = vllm_prompt_logprobs(row.prompt_logprobs)
    return body


def _chat_logprobs(choice: Choice) -> dict[str, Any] | None:
    return None if choice.logprobs is None else openai_chat_logprobs(choice.logprobs)


def _completion_body(row: ResultRow, created: int) -> dict[str, Any]:
    choices = [
        {
            "index": index,
            "text": choice.text,
            "logprobs": _completion_logprobs(choice),
            "finish_reason": choice.finish_reason,
        }
        for index, choice in enumerate(_choices(row))
    ]
    if row.prompt_logprobs is not None:
        prompt_logprobs = vllm_prompt_logprobs(row.prompt_logprobs)
        for choice_body in choices:  # one prompt: every choice repeats it, as vLLM's do
            choice_body[PROMPT_LOGPROBS] = prompt_logprobs
    return {
        "id": f"cmpl-{_stable_hex('cmpl', row, 29)}",
        "object": "text_completion",
        "created": created,
        "model": row.model,
        "choices": choices,
        "usage": _usage(row),
    }


def _completion_logprobs(choice: Choice) -> dict[str, Any] | None:
    if choice.logprobs is None:
        return None
    return openai_completion_logprobs(choice.logprobs, choice.text)
