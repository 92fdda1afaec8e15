"""Rows made ready for the engine in batches: chat template, token ids, sampling parameters.

    rows ─► per row: render the chat template (or take the prompt) ─► one batch encode per
            kind (chat text: no special tokens added; plain prompts: the model's BOS rules)
         ─► ReadyRow(row, prompt_ids, params) | ResultRow(error), in the rows' order

This is ``prompt_ids_for`` + ``sampling_params_for`` over many rows at once, with the same
ids and the same error messages: a row whose template rendering or encoding fails is run
through ``prompt_ids_for`` alone, whose error is the row's. The batch encode runs in the
tokenizer's Rust code without the GIL, so a reader thread preparing rows leaves the engine
thread free to run (templating is Python, and holds it).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.chat_messages import check_tool_calls_rendered, check_tools_rendered
from tokenmill.engine.prompts import ChatTemplate, encode_texts
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.io.rows import InputRow, ResultRow
from tokenmill.jobs.requests import (
    error_result,
    prompt_ids_for,
    row_error_reason,
    sampling_params_for,
    seeded_for_row,
)

__all__ = ["ReadyRow", "RowPreparer", "own_tokenizer"]

log = logging.getLogger("tokenmill.jobs")


@dataclass(frozen=True)
class ReadyRow:
    """A good row as the engine takes it: the row (for what its result carries over: id,
    source, passthrough), its prompt's token ids and its sampling parameters."""

    row: InputRow
    prompt_ids: list[int]
    params: SamplingParams


def own_tokenizer(tokenizer: Any) -> Any:
    """A copy of ``tokenizer`` for a worker thread, so that it never shares the engine's Rust
    tokenizer (whose settings a call may change); ``tokenizer`` itself if it cannot be copied."""
    try:
        return copy.deepcopy(tokenizer)
    except Exception as exc:  # a tokenizer class that does not copy: share it
        log.debug("tokenizer not copied (%s: %s); the reader shares it", type(exc).__name__, exc)
        return tokenizer


class RowPreparer:
    """Callable: a list of good InputRows in, a list of ReadyRow | ResultRow out (same order)."""

    def __init__(
        self,
        tokenizer: Any,
        sampling_defaults: dict[str, Any],
        model: str,
        max_model_len: int | None = None,
        chat: ChatTemplate | None = None,
    ) -> None:
        """``max_model_len``: the engine's; a text too long for it by its length alone is
        the row's error before it is tokenized (see ``_too_long``). ``chat``: the job's own
        chat template, variables and ending (model.chat_template, model.chat_template_kwargs,
        model.add_generation_prompt, model.continue_final_message)."""
        self.tokenizer = tokenizer
        self.chat = chat or ChatTemplate()
        self._chat_arguments = self.chat.arguments()
        self.sampling_defaults = sampling_defaults
        self.model = model
        self.max_model_len = max_model_len
        self._chars_per_token: int | None = None
        self._default_params: SamplingParams | None = None

    def warm_up(self) -> None:
        """Render and encode one short conversation, so that first-use costs are paid at
        load, not by the first rows: compiling the chat template, and the first isinstance
        checks against ABCs in transformers' message handling, which scan every subclass
        loaded (0.3 s in a Ray worker, 15x a batch of rows). Failures are the rows' to
        report: ignored here."""
        row = InputRow(-1, "warm-up", "warm-up", messages=[{"role": "user", "content": "hi"}])
        try:
            self._text(row)  # the rows' own path: template errors are swallowed there
            self.tokenizer(["hi"], add_special_tokens=False)
        except Exception as exc:  # an odd tokenizer: the rows will say what is wrong
            log.debug("tokenizer warm-up failed (%s: %s)", type(exc).__name__, exc)

    def __call__(self, rows: list[InputRow]) -> list[ReadyRow | ResultRow]:
        encoded: list[list[int] | ResultRow] = [[] for _ in rows]
        texts: dict[bool, list[tuple[int, str]]] = {True: [], False: []}  # special tokens?
        for i, row in enumerate(rows):
            text = self._text(row)
            if text is None:  # the per-row path decides: ids, or the row's error
                encoded[i] = self._one(row)
            elif (too_long := self._too_long(text)) is not None:
                encoded[i] = error_result(row, too_long, self.model)
            else:
                texts[row.messages is None].append((i, text))
        for special, group in texts.items():
            for i, ids in self._encode(rows, group, special):
                encoded[i] = ids
        out: list[ReadyRow | ResultRow] = []
        for row, ids in zip(rows, encoded, strict=True):
            if isinstance(ids, ResultRow):  # the prompt's error comes first, as per row
                out.append(ids)
                continue
            try:
                params = self._params(row)
            except Exception as exc:
                out.append(error_result(row, row_error_reason(exc), self.model))
                continue
            out.append(ReadyRow(row, ids, params))
        return out

    def _params(self, row: InputRow) -> SamplingParams:
        """``sampling_params_for(row, defaults)``; built once for all the rows that override
        nothing (nothing sets fields on it: greedy rows share it; sampled ones take a copy
        with their own seed). Raises as it does."""
        if row.sampling:
            return sampling_params_for(row, self.sampling_defaults)
        if self._default_params is None:
            self._default_params = sampling_params_for(
                row, self.sampling_defaults, per_row_seed=False
            )
        return seeded_for_row(self._default_params, row)

    def _text(self, row: InputRow) -> str | None:
        """The text to encode, or None when only the per-row path can tell (no template, a
        template error, neither prompt nor messages)."""
        if row.messages is not None:
            template = self.chat.of(self.tokenizer)
            if not template:
                return None
            try:
                check_tool_calls_rendered(template, row.messages)
                generation, final = self.chat.ending(
                    row.messages, row.add_generation_prompt, row.continue_final_message
                )
                arguments = self._chat_arguments
                if row.chat_template_kwargs:
                    arguments = {**arguments, **row.chat_template_kwargs}
                check_tools_rendered(template, arguments)
                return self.tokenizer.apply_chat_template(
                    list(row.messages),
                    tokenize=False,
                    add_generation_prompt=generation,
                    continue_final_message=final,
                    **arguments,
                )
            except Exception:
                return None
        return row.prompt

    def length_refusal(self, row: InputRow) -> str | None:
        """Why ``row``'s prompt cannot fit by its length alone (``_too_long``), or None: what
        a run refuses before tokenizing, for the dry run to refuse alike."""
        text = self._text(row)
        return None if text is None else self._too_long(text)

    def _too_long(self, text: str) -> str | None:
        """Why ``text`` cannot fit the engine's context whatever its tokens, or None. No
        token of the vocabulary spells more than ``_chars_per_token`` characters, so a text
        longer than that many per position of max_model_len has more tokens than fit:
        tokenizing a 20 MB prompt only to refuse it took 30 s and 5.5 GiB."""
        if self.max_model_len is None:
            return None
        if self._chars_per_token is None:
            self._chars_per_token = _longest_token(self.tokenizer)
        least = len(text) // self._chars_per_token
        if least < self.max_model_len:
            return None
        return (
            f"prompt has {len(text):,} characters, so at least {least:,} tokens (no token of "
            f"the vocabulary is longer than {self._chars_per_token} characters); the engine's "
            f"max_model_len is {self.max_model_len}"
        )

    def _one(self, row: InputRow) -> list[int] | ResultRow:
        try:
            return prompt_ids_for(row, self.tokenizer, self.chat)
        except Exception as exc:  # templating, tokenizing: the row's error
            return error_result(row, row_error_reason(exc), self.model)

    def _encode(
        self, rows: list[InputRow], group: list[tuple[int, str]], special: bool
    ) -> list[tuple[int, list[int] | ResultRow]]:
        """(index, token ids or error) for each (index, text) of ``group``, in one call."""
        if not group:
            return []
        try:
            encoded = encode_texts(self.tokenizer, [t for _, t in group], special)
            return list(zip((i for i, _ in group), encoded, strict=True))
        except Exception:  # some row's text: find which, through the per-row path
            return [(i, self._one(rows[i])) for i, _ in group]


def _longest_token(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer``'s vocabulary spells, as its vocabulary
    writes them (byte-level vocabularies write a character per byte: never fewer than the
    text's own); a very large number when the vocabulary cannot be read."""
    try:
        return max(1, max(len(t) for t in tokenizer.get_vocab()))
    except Exception:
        return 1 << 62
