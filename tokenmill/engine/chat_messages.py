"""Conversations as the chat template gets them, the same from every entry point (``LLM.chat``,
a job's messages column or OpenAI Batch body, the Ray Data processor).

A conversation is a non-empty list of {role, content} messages. OpenAI's spellings are taken
as they are written: the ``developer`` role (what OpenAI's newer models call system
messages) becomes ``system``, which chat templates know; content given as a list of parts,
``[{"type": "text", "text": ...}]``, becomes the parts' texts joined by newlines (as vLLM
joins them); an assistant message calling tools (``tool_calls``, content null) gets empty
content, and each call's ``function.arguments`` JSON text becomes the mapping templates
expect (as vLLM passes it); an assistant message refusing (``refusal``, content null) gets
the refusal's text as its content. Other parts (images, audio) are refused naming the part: the
engine runs text-only models. Other keys (``name``, ``tool_call_id``) are kept unless null,
since Parquet structs fill absent fields with nulls; so are a tool call's and its function's
(from any entry point: an explicit null reads as absent).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tokenmill.engine.value_text import short_repr, type_name

ROLES = ("system", "user", "assistant", "tool")
ALIASES = {"developer": "system"}


def check_tool_calls_rendered(template: Any, messages: list[dict[str, Any]]) -> None:
    """Raise ValueError when a message calls tools but the chat ``template`` never reads
    ``tool_calls``: the calls would be left out of the prompt unsaid (a ChatML template
    rendered an empty assistant turn, and the row ran on a conversation it never had)."""
    if template is None or "tool_calls" in str(template):
        return
    for i, message in enumerate(messages):
        if message.get("tool_calls"):
            raise ValueError(
                f"messages[{i}] calls tools (tool_calls), but the model's chat template does "
                "not render tool calls: they would be left out of the prompt; write them "
                "into the message's content, or pass a chat_template that renders them"
            )


def check_tools_rendered(template: Any, variables: Mapping[str, Any]) -> None:
    """Raise ValueError when the template variables give ``tools`` but the chat ``template``
    never reads them: the model would answer never told of the tools it was given (a ChatML
    template rendered the conversation alone, as if no tools had been passed)."""
    if template is None or not variables.get("tools") or "tools" in str(template):
        return
    raise ValueError(
        "tools are given, but the model's chat template does not render them: the model "
        "would never see them; describe them in a system message, or pass a chat_template "
        "that renders tools"
    )


def normalize_messages(value: Any, where: str = "messages") -> list[dict[str, Any]]:
    """``value`` as the list of message dicts a chat template gets; ValueError naming
    ``where`` (a column, a field, an argument) and the message when it is not one."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(
            f"{where} must be a non-empty list of {{role, content}} messages, "
            f"got {type_name(value)}"
        )
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise ValueError(
                f"{where}[{i}] must be an object with role and content, got {type_name(message)}"
            )
        role = message.get("role")
        role = ALIASES.get(role, role) if isinstance(role, str) else None
        if role not in ROLES:
            raise ValueError(
                f"{where}[{i}].role is {_shown(message.get('role'))}; expected one of "
                f"{', '.join((*ROLES, *ALIASES))}"
            )
        kept = {k: v for k, v in message.items() if v is not None}
        calls = message.get("tool_calls")
        refusal = message.get("refusal")
        if role == "assistant" and calls and message.get("content") is None:
            content = ""
        elif role == "assistant" and isinstance(refusal, str) and message.get("content") is None:
            content = refusal  # OpenAI's refusing answer: its text in place of content
        else:
            content = _text(message.get("content"), f"{where}[{i}].content")
        if calls:
            kept["tool_calls"] = _tool_calls(calls, f"{where}[{i}].tool_calls")
        messages.append({**kept, "role": role, "content": content})
    return messages


def _shown(value: Any) -> str:
    """``value`` as an error shows it: JSON's null for None (a missing role read "None")."""
    return "null" if value is None else short_repr(value)


def _text(content: Any, where: str) -> str:
    """A message's content as one string: itself, or its text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)) or not content:
        raise ValueError(
            f"{where} must be a string or a non-empty list of text parts, got {type_name(content)}"
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and not isinstance(part.get("text"), str):
            raise ValueError(
                f"{where}[{j}].text must be a string, got {type_name(part.get('text'))}"
            )
        if kind != "text":
            shown = f"type {short_repr(kind)}" if kind is not None else type_name(part)
            raise ValueError(
                f"{where}[{j}] is not a text part (got {shown}); only text parts "
                '({"type": "text", "text": ...}) are supported'
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_calls(calls: Any, where: str) -> list[Any]:
    """The calls, each ``function.arguments`` given as JSON text parsed into its mapping.
    Null fields are left out, of a call and of its function, as of a message: a Parquet
    struct column holds every field, null where a row has none (a call without an ``id``),
    and a template testing ``is defined`` would otherwise render ``None``."""
    if not isinstance(calls, (list, tuple)):
        raise ValueError(f"{where} must be a list of tool calls, got {type_name(calls)}")
    out = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(
                f'{where}[{k}] must be a tool call, {{"type": "function", "function": '
                f'{{"name": ..., "arguments": ...}}}}, got {short_repr(call)}'
            )
        function = {key: v for key, v in function.items() if v is not None}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None  # not JSON: the template gets the text as it was written
            if isinstance(parsed, dict):
                function["arguments"] = parsed
        out.append({**{key: v for key, v in call.items() if v is not None}, "function": function})
    return out


def conversation_cell(cell: Any) -> Any:
    """A messages cell as written by common tools, as the list of message objects it holds:
    JSON text (a string column) parsed, and Parquet maps (Spark's array<map<string,string>>,
    read as lists of (key, value) pairs) made objects. Anything else as it is, for
    ``normalize_messages`` to judge. Every reader of a messages column takes its cells
    through this: run-job, and the Ray Data processor."""
    if isinstance(cell, str) and cell.lstrip().startswith("["):
        try:
            cell = json.loads(cell)
        except ValueError:
            return cell
    if isinstance(cell, list):
        return [_pairs_to_dict(m) for m in cell]
    return cell


def _pairs_to_dict(message: Any) -> Any:
    if isinstance(message, list) and all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in message
    ):
        return dict(message)
    return message
