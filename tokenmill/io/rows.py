"""The records that flow between readers, the runner and writers.

Every input row gets a ``row_index``: its position in the whole input (files sorted by name,
then line or row order). Shards cover fixed ranges of row indices, which is what makes
progress resumable: shard k holds the results of rows [k * rows_per_shard, (k+1) * rows_per_shard).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class InputRow:
    """One input row, parsed. ``error`` set means the row is bad and goes to the error file.

    Exactly one of ``prompt`` / ``prompt_token_ids`` / ``messages`` is set on a good row
    (``prompt_token_ids``: an OpenAI completions body that gave its prompt as token ids).
    ``sampling`` holds per-row SamplingParams keyword overrides (OpenAI Batch bodies);
    ``chat_template_kwargs`` the row's own chat template variables and
    ``add_generation_prompt`` / ``continue_final_message`` how its conversation ends (an
    OpenAI Batch chat body's, vLLM's extensions; None: as the job's ``model`` section says,
    see ``ChatTemplate.ending``); ``passthrough`` the columns copied to the
    output as they are. ``custom_id``/``endpoint`` are set for OpenAI Batch rows.
    """

    row_index: int
    row_id: str
    source: str  # "file:line" (1-based line for JSONL, 0-based row for Parquet), for messages
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    passthrough: dict[str, Any] = field(default_factory=dict)
    custom_id: str | None = None
    endpoint: str | None = None  # "/v1/chat/completions" | "/v1/completions"
    error: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None


@dataclass(frozen=True)
class Choice:
    """One completion of a row that asked for several (OpenAI's ``n``)."""

    text: str
    finish_reason: str
    completion_tokens: int
    logprobs: list[dict[str, Any]] | None = None  # per token, when asked (logprobs_column.py)


@dataclass(frozen=True)
class ResultRow:
    """The outcome of one input row: a completion, or an error message.

    A row that asked for several completions (``n > 1``) holds them all in ``choices``;
    ``text``, ``finish_reason`` and ``logprobs`` are then the first one's, and
    ``completion_tokens`` counts every choice's tokens (what OpenAI's ``usage`` bills);
    ``generated_tokens`` every token the engine generated for the row, the samples that
    ``best_of`` left out included (what a run's throughput counts).
    ``logprobs`` holds one entry per completion token when the row asked for them
    (``logprobs_column.py``), ``prompt_logprobs`` one per prompt token
    (``prompt_logprobs_column.py``).
    """

    row_index: int
    row_id: str
    text: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    passthrough: dict[str, Any] = field(default_factory=dict)
    custom_id: str | None = None
    endpoint: str | None = None
    logprobs: list[dict[str, Any]] | None = None  # per token, when asked (logprobs_column.py)
    model: str = ""
    error: str | None = None  # starts with the row's "file:line" location
    source: str = ""  # the input row's "file:line"
    choices: tuple[Choice, ...] = ()  # every completion when the row asked for n > 1
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    generated_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None
