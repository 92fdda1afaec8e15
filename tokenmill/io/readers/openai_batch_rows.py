"""Turning one OpenAI Batch input line (custom_id, method, url, body) into an InputRow.

See https://platform.openai.com/docs/guides/batch. Supported endpoints:
``/v1/chat/completions`` (body.messages) and ``/v1/completions`` (body.prompt: one string,
or one prompt's token ids, as the API takes them: ``[1, 2]`` or ``[[1, 2]]``).
"""

from __future__ import annotations

from typing import Any

from tokenmill.engine.prompts import check_chat_options, template_variables
from tokenmill.io.readers.messages import check_messages
from tokenmill.io.readers.openai_sampling import CHAT, COMPLETIONS, openai_sampling
from tokenmill.io.readers.row_error import RowError, short_repr, type_name
from tokenmill.io.rows import InputRow


def parse_openai_batch_row(
    value: Any, *, passthrough_columns: tuple[str, ...], row_index: int, source: str
) -> InputRow:
    """The InputRow for one batch line (row_id = custom_id), or RowError saying what is wrong."""
    custom_id = batch_row_id(value)
    method = value.get("method")
    if method != "POST":
        raise RowError(f'method must be "POST", got {short_repr(method)}', custom_id)
    url = value.get("url")
    if url not in (CHAT, COMPLETIONS):
        raise RowError(
            f"url {short_repr(url)} is not supported; use {CHAT} or {COMPLETIONS}", custom_id
        )
    body = value.get("body")
    if not isinstance(body, dict):
        raise RowError(f"body must be an object, got {type_name(body)}", custom_id)
    sampling = openai_sampling(body, url, custom_id)
    passthrough = {name: value.get(name) for name in passthrough_columns}
    fields: dict[str, Any] = {}
    if url == CHAT:
        fields["messages"] = check_messages(body.get("messages"), "body.messages", custom_id)
        fields["chat_template_kwargs"] = _template_kwargs(body, custom_id)
        fields.update(_conversation_end(body, custom_id))
    elif isinstance(prompt := _prompt(body.get("prompt"), custom_id), str):
        fields["prompt"] = prompt
    else:
        fields["prompt_token_ids"] = prompt
    return InputRow(
        row_index,
        custom_id,
        source,
        sampling=sampling,
        passthrough=passthrough,
        custom_id=custom_id,
        endpoint=url,
        **fields,
    )


def batch_row_id(value: Any) -> str:
    """The custom_id of the batch line ``value``, the first thing ``parse_openai_batch_row``
    reads: RowError (without a row id) when it has none; any error past it carries it."""
    if not isinstance(value, dict):
        raise RowError(f"expected a JSON object per line, got {type_name(value)}")
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise RowError(
            f"missing id: custom_id must be a non-empty string, got {type_name(custom_id)}; "
            "every batch line needs a unique custom_id"
        )
    return custom_id


def _template_kwargs(body: dict[str, Any], custom_id: str) -> dict[str, Any]:
    """A chat body's ``chat_template_kwargs`` (vLLM's extension: variables its template
    reads, e.g. Qwen3's ``enable_thinking``), checked as ``LLM.chat`` checks them."""
    value = body.get("chat_template_kwargs")
    try:
        return template_variables(value)
    except ValueError as exc:
        raise RowError(f"body.{exc}", custom_id) from None


def _conversation_end(body: dict[str, Any], custom_id: str) -> dict[str, bool]:
    """A chat body's ``add_generation_prompt`` (true unless given) and
    ``continue_final_message`` (false unless given): vLLM's, for a row that has the model
    go on writing an assistant message its conversation began. Neither given: none (the
    job's ``model`` section says)."""
    options = {"add_generation_prompt": True, "continue_final_message": False}
    given = {k: body[k] for k in options if body.get(k) is not None}
    if not given:
        return {}
    options |= given
    try:
        check_chat_options(**options)
    except ValueError as exc:
        raise RowError(f"body: {exc}", custom_id) from None
    return options


def _prompt(prompt: Any, custom_id: str) -> str | tuple[int, ...]:
    """The prompt of a completions body: its text, or its token ids (checked against the
    vocabulary when the row is run)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # one prompt, in OpenAI's list form
    if isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
        return tuple(prompt)
    if (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(p, str | list) for p in prompt)
    ):
        raise RowError(
            "body.prompt is a list of several prompts: only one prompt per line is "
            "supported; write one line per prompt",
            custom_id,
        )
    if isinstance(prompt, list) and prompt:
        raise RowError(
            "body.prompt must be a string or a list of token ids (integers from 0 to "
            f"{MAX_TOKEN_ID}), got "
            f"{short_repr(prompt)}",
            custom_id,
        )
    if not isinstance(prompt, str) or not prompt:
        raise RowError(
            "missing prompt: body.prompt must be a non-empty string or list of token ids, "
            f"got {short_repr(prompt) if isinstance(prompt, list | str) else type_name(prompt)}",
            custom_id,
        )
    return prompt


MAX_TOKEN_ID = 2**31 - 1  # past any vocabulary (an id past the model's is the row's error)


def _is_token_id(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_TOKEN_ID  # (not bool)
