"""``model.chat_template`` and ``model.chat_template_kwargs`` as a job.yaml gives them.

The template replaces the model's own for every conversation of the job (``messages_column``
rows and OpenAI Batch chat bodies), as vLLM's ``--chat-template`` does, and it takes what
that takes: the Jinja text itself, or the path of a file holding it. A value with a Jinja
delimiter (``{{``, ``{%`` or ``{#``) is the text; anything else names a local file (relative
to the current directory, as ``input.path``), read once when the spec loads. The spec then
carries the text itself: to Ray replicas on other machines, and into the job's fingerprint,
so editing the file changes the fingerprint as editing the model's own template does.

The kwargs are extra template variables (Qwen3's ``enable_thinking``): identifier names,
none of ``apply_chat_template``'s own arguments, and plain YAML values (they are part of
the fingerprint, kept as JSON).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenmill.engine.prompts import is_jinja, template_variables
from tokenmill.io.readers.storage import relative_note

__all__ = ["MAX_TEMPLATE_BYTES", "chat_template_kwargs_setting", "chat_template_setting"]

MAX_TEMPLATE_BYTES = 1 << 20


def chat_template_setting(value: str) -> str:
    """The template's text: ``value`` itself when it holds Jinja, else the file it names.
    Raises ValueError saying which it took ``value`` for and what is wrong."""
    if not value.strip():
        raise ValueError("must be a Jinja template or the path of a file holding one, got ''")
    if is_jinja(value):
        return value
    shown = value if len(value) <= 200 else value[:200] + "..."
    try:
        with Path(value).expanduser().open("rb") as f:
            data = f.read(MAX_TEMPLATE_BYTES + 1)
    except FileNotFoundError:
        raise ValueError(
            f"no file {shown!r}{relative_note(value)} (a value holding '{{{{', '{{%' or '{{#' "
            "is the template itself; anything else is read as the path of a file holding it)"
        ) from None
    except OSError as exc:
        raise ValueError(f"cannot read {shown!r}: {exc.strerror or exc}") from None
    if len(data) > MAX_TEMPLATE_BYTES:
        raise ValueError(f"{shown!r} is over {MAX_TEMPLATE_BYTES >> 20} MiB: not a chat template")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{shown!r} is not UTF-8 text: not a chat template") from None
    if not is_jinja(text):
        raise ValueError(f"{shown!r} holds no Jinja ('{{{{' or '{{%'): not a chat template")
    return text


def chat_template_kwargs_setting(value: Any) -> Any:
    """``value`` when it is a mapping of template variables a job can keep (identifier
    names, none reserved, JSON values); None reads as none. Raises ValueError."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        return value  # the schema says what is expected
    template_variables(value)
    for key, item in value.items():
        try:
            json.dumps(item, allow_nan=False)
        except (TypeError, ValueError):
            raise ValueError(
                f"{key}: {type(item).__name__} values cannot be kept with the job; use "
                "strings, numbers, booleans, null, lists and mappings"
            ) from None
    return value
