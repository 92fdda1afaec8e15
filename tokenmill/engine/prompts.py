"""Turning prompts and conversations into token ids, the same way for every entry point."""

from __future__ import annotations

import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from tokenmill.engine.chat_messages import (
    check_tool_calls_rendered,
    check_tools_rendered,
    normalize_messages,
)

__all__ = [
    "ChatTemplate",
    "check_chat_options",
    "check_template_text",
    "check_prompt_ids",
    "encode_chat",
    "encode_prompt",
    "encode_texts",
    "is_jinja",
    "render_chat",
    "template_variables",
]

# What marks text as a Jinja template rather than a file's path or a template's name.
_JINJA_MARKS = ("{{", "{%", "{#")


def is_jinja(text: str) -> bool:
    """Whether ``text`` holds a Jinja delimiter (``_JINJA_MARKS``): a template's text, not a
    file's path or a template's name."""
    return any(mark in text for mark in _JINJA_MARKS)


# apply_chat_template's own arguments: they steer the call rather than reach the template,
# so chat_template_kwargs may not set them (tools and documents are template variables);
# nor the names transformers renders the conversation under (messages, conversations).
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "conversations",
     "chat_template", "add_generation_prompt", "continue_final_message",
     "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
     "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


@dataclass(frozen=True)
class ChatTemplate:
    """How a job renders its conversations: ``template`` (Jinja text) in place of the
    model's own when set, with ``kwargs`` as extra template variables, and how a
    conversation ends: a new assistant turn opened after it (``add_generation_prompt``), or
    its last, assistant, message left open for the model to go on writing
    (``continue_final_message``, with ``add_generation_prompt`` false)."""

    template: str | None = None
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def of(self, tokenizer: Any) -> str | None:
        """The template conversations are rendered with: this one, else the model's."""
        return self.template or getattr(tokenizer, "chat_template", None)

    def arguments(self) -> dict[str, Any]:
        """``apply_chat_template``'s keyword arguments for them (checked as ``render_chat``
        checks its own)."""
        extra = template_variables(self.kwargs)
        if self.template is not None:
            extra["chat_template"] = self.template
        return extra

    @classmethod
    def of_settings(cls, settings: Any) -> ChatTemplate:
        """From an object holding the four settings under their names (chat_template,
        chat_template_kwargs, add_generation_prompt, continue_final_message): job.yaml's
        model section, the Ray Data processor's config."""
        return cls(
            settings.chat_template,
            settings.chat_template_kwargs,
            settings.add_generation_prompt,
            settings.continue_final_message,
        )

    def with_variables(self, kwargs: Mapping[str, Any]) -> ChatTemplate:
        """This template with ``kwargs`` over its variables (a row's own)."""
        return replace(self, kwargs={**self.kwargs, **kwargs}) if kwargs else self

    def ending(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool | None = None,
        continue_final_message: bool | None = None,
    ) -> tuple[bool, bool]:
        """``(add_generation_prompt, continue_final_message)`` for one row's ``messages``:
        the row's own when it gives either (an OpenAI Batch body's, the other then vLLM's
        default, as vLLM reads the body, which continues whatever message ends it), else
        these. Raises ValueError when both are true, or when the job's setting has a row's
        last message continued and it is not an assistant's: a user's would be written on
        as if the model were the user (a row the job-wide setting reached without the reply
        begun in its data)."""
        own = add_generation_prompt is not None or continue_final_message is not None
        if not own:
            generation, final = self.add_generation_prompt, self.continue_final_message
        else:
            generation = True if add_generation_prompt is None else add_generation_prompt
            final = False if continue_final_message is None else continue_final_message
        check_chat_options(generation, final)
        if final and not own:
            last = messages[-1] if messages else None
            role = last.get("role") if isinstance(last, Mapping) else None
            if role != "assistant":
                raise ValueError(
                    f"continue_final_message is set, but the conversation ends with a {role} "
                    "message, not an assistant's: there is no reply to go on writing; end it "
                    'with the reply begun (e.g. {"role": "assistant", "content": "{"}), or '
                    "run it without continue_final_message"
                )
        return generation, final


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of a plain completion prompt, with the model's BOS rules."""
    return list(tokenizer.encode(prompt))


def check_prompt_ids(prompt_token_ids: Sequence[int], vocab_size: int) -> None:
    """Raise ValueError when a prompt is text or a mapping (vLLM's prompt types), is empty,
    or holds anything but integer ids in ``[0, vocab_size)`` (a float such as 5.5 was cut
    to 5, and text raised a TypeError naming neither the prompt nor the fix; True ran as
    id 1). A numpy array of ids is taken."""
    if isinstance(prompt_token_ids, str | bytes):
        raise ValueError(
            "the prompt is text, not token ids: encode it first (engine.tokenizer.encode) "
            "or give the text to LLM.generate"
        )
    if isinstance(prompt_token_ids, Mapping):  # vLLM's TokensPrompt
        raise ValueError(
            "the prompt is a mapping: LLMEngine.add_request takes the token ids themselves "
            "(its prompt_token_ids list)"
        )
    if len(prompt_token_ids) == 0:
        raise ValueError("the prompt is empty")
    # One C loop takes only integers (isinstance per id tripled a 500-token prompt's check)
    try:
        ids = np.frombuffer(array.array("q", prompt_token_ids), dtype=np.int64)  # [L]
    except TypeError:
        bad = [t for t in prompt_token_ids if not isinstance(t, int | np.integer)]
        raise ValueError(f"prompt token ids must be integers, got {bad[:5]!r}") from None
    except OverflowError:  # past int64: outside any vocabulary
        ids = None
    if ids is not None:
        lowest = ids.min()
        if lowest >= 0 and ids.max() < vocab_size:
            if lowest <= 1:  # a bool passed as 0 or 1: look at those ids alone
                _refuse_bools(prompt_token_ids, np.flatnonzero(ids <= 1))
            return
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    raise ValueError(f"prompt token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


def _refuse_bools(prompt_token_ids: Sequence[int], at: np.ndarray) -> None:
    """Raise ValueError when an id at a position in ``at`` is a bool: True is no token id
    (LLM.generate refuses it), though it is the integer 1."""
    bad = [i for i in at.tolist() if isinstance(prompt_token_ids[i], bool)]
    if bad:
        raise ValueError(
            f"prompt token ids must be integers, got {prompt_token_ids[bad[0]]!r} at position "
            f"{bad[0]}: a bool is no token id"
        )


def encode_texts(tokenizer: Any, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
    """Token ids of many texts in one tokenizer call: a fast tokenizer encodes the batch in
    Rust on its own threads, without the GIL (the ids of ``tokenizer.encode`` one by one;
    20,000 chat texts took 2.9 s one by one on an H200 host, inside ``LLM.chat``'s time).
    Chat text is encoded without special tokens (the template wrote them), plain prompts with
    the model's BOS rules."""
    if not texts:
        return []
    try:
        encoded = tokenizer(list(texts), add_special_tokens=add_special_tokens)["input_ids"]
    except (TypeError, ValueError):
        _check_unicode(texts)  # the tokenizer's own error names neither text nor cause
        raise
    return [list(ids) for ids in encoded]


def _check_unicode(texts: Sequence[str]) -> None:
    """Raise ValueError naming the first text that is not valid Unicode (a lone surrogate,
    which no UTF-8 tokenizer can take)."""
    for i, text in enumerate(texts):
        bad = _not_unicode(text)
        if bad is not None:
            raise ValueError(
                f"prompt {i} is not valid Unicode ({bad}); nothing ran. Fix or drop that prompt"
            )


def _not_unicode(text: str) -> str | None:
    """Where ``text`` is not valid Unicode ("a lone surrogate, '\\ud800', at character 4"),
    or None when it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as bad:
        return f"a lone surrogate, {text[bad.start]!r}, at character {bad.start}"
    return None


def render_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    continue_final_message: bool = False,
) -> str:
    """The text of ``messages`` (normalized as ``normalize_messages`` says: every entry point
    renders a conversation alike) rendered with the model's chat template.

    ``chat_template`` (a Jinja string) replaces the model's template; ``chat_template_kwargs``
    are extra variables the template reads (e.g. ``{"enable_thinking": False}`` for Qwen3).
    ``continue_final_message`` leaves the last message open (no end of turn after it), so
    the model goes on writing it: an assistant message started for it (vLLM's option; with
    ``add_generation_prompt`` False).
    The template runs in transformers' sandboxed Jinja environment; nothing else is executed.
    Raises ValueError when there is no template, an argument is malformed (naming it), or the
    template rejects the conversation (e.g. roles out of order).
    """
    check_chat_options(add_generation_prompt, continue_final_message)
    if chat_template is not None:
        check_template_text(tokenizer, chat_template)
    chat = ChatTemplate(chat_template, {} if chat_template_kwargs is None else chat_template_kwargs)
    extra = chat.arguments()
    template = chat.of(tokenizer)
    if not template:
        raise ValueError(
            "the model has no chat template; send plain prompts instead or pass chat_template"
        )
    conversation = normalize_messages(messages)
    check_tool_calls_rendered(template, conversation)
    check_tools_rendered(template, extra)
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **extra,
        )
    except Exception as exc:  # jinja raises its own types for template errors
        raise ValueError(f"the chat template rejected the conversation: {exc}") from None
    return text


def encode_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    continue_final_message: bool = False,
) -> list[int]:
    """Token ids of ``messages`` rendered with the model's chat template (``render_chat``,
    which says what the arguments do and what it raises). The template writes the special
    tokens, so none are added. Also raises ValueError when the text is not valid Unicode (a
    lone surrogate, which JSON may spell: the tokenizer's own TypeError named no cause)."""
    text = render_chat(
        tokenizer,
        messages,
        add_generation_prompt,
        chat_template,
        chat_template_kwargs,
        continue_final_message,
    )
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except (TypeError, ValueError):
        bad = _not_unicode(text)
        if bad is None:
            raise
        raise ValueError(
            f"the conversation is not valid Unicode ({bad} of its rendered text); fix or drop "
            "the text holding it"
        ) from None


def check_template_text(tokenizer: Any, chat_template: Any) -> None:
    """Raise ValueError unless ``chat_template`` is Jinja text, or the name of one of the
    tokenizer's own templates (transformers takes both). Text holding no Jinja delimiter
    rendered as itself: a file's path given here (as ``model.chat_template`` takes one) was
    every conversation's whole prompt, the model never shown the messages."""
    if not isinstance(chat_template, str) or not chat_template:
        raise ValueError(
            f"chat_template must be a non-empty Jinja template string or None, "
            f"got {chat_template!r}"
        )
    own = getattr(tokenizer, "chat_template", None)
    if is_jinja(chat_template) or (isinstance(own, Mapping) and chat_template in own):
        return
    shown = chat_template if len(chat_template) <= 200 else chat_template[:200] + "..."
    raise ValueError(
        f"chat_template {shown!r} holds no Jinja ('{{{{', '{{%' or '{{#'): it would be "
        "every conversation's whole prompt; pass the template's text (a file's: "
        "Path(name).read_text()), not its path"
    )


def check_chat_options(add_generation_prompt: Any, continue_final_message: Any) -> None:
    """Raise ValueError unless both are booleans and not both true (a new assistant turn
    and the last message continued contradict each other)."""
    for name, value in (
        ("add_generation_prompt", add_generation_prompt),
        ("continue_final_message", continue_final_message),
    ):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
    if add_generation_prompt and continue_final_message:
        raise ValueError(
            "continue_final_message and add_generation_prompt cannot both be true: the last "
            "message is continued, or a new assistant turn is started; set "
            "add_generation_prompt to false to continue the last message"
        )


def template_variables(chat_template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` as a dict, checked: string keys, none of apply_chat_template's
    own arguments."""
    if chat_template_kwargs is None:
        return {}
    if not isinstance(chat_template_kwargs, Mapping):
        raise ValueError(
            f"chat_template_kwargs must be a dict of template variables or None, "
            f"got {type(chat_template_kwargs).__name__}"
        )
    bad = [k for k in chat_template_kwargs if not isinstance(k, str) or not k.isidentifier()]
    if bad:
        raise ValueError(f"chat_template_kwargs keys must be identifiers, got {bad!r}")
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(chat_template_kwargs))
    if reserved:
        raise ValueError(
            f"chat_template_kwargs may not set {', '.join(reserved)}: chat_template, "
            "add_generation_prompt and continue_final_message are settings of their own "
            "(job.yaml: model.chat_template, model.add_generation_prompt, "
            "model.continue_final_message; LLM.chat's and a batch body's own keys); the "
            "others are fixed"
        )
    return dict(chat_template_kwargs)
