"""Prompt logprobs as a job writes them: one entry per prompt token, in every output format.

A row whose sampling asks for ``prompt_logprobs=k`` carries, per prompt token, the token's
logprob under the model, its rank, and the k most likely tokens at its position (the engine's
``RequestOutput.prompt_logprobs``, decoded). Nothing predicts the first token: its entry is
null.

    prompt    t0     t1                                           t2   ...
    entries   null   {"token_id": 71, "token": " cat",            {...}
                      "logprob": -3.2, "rank": 7,
                      "top_logprobs": [{"token_id": 12, "token": " the", "logprob": -0.9},
                                       ... k of them, most likely first]}

JSONL and Parquet output hold these entries as they are, in a ``prompt_logprobs`` column
(Parquet: ``PROMPT_LOGPROBS_FIELD``, in the job's one schema when its sampling section asks
for prompt logprobs). OpenAI Batch output writes them where vLLM's OpenAI server puts its
``prompt_logprobs`` (``vllm_prompt_logprobs``): per position a mapping token id (a string,
as JSON keys are) -> ``{"logprob", "rank", "decoded_token"}`` over the prompt token and the
alternatives, the prompt token first.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

__all__ = [
    "LOGPROB_ENTRY",
    "PROMPT_LOGPROBS",
    "PROMPT_LOGPROBS_FIELD",
    "PromptLogprobEntries",
    "is_prompt_logprobs_field",
    "vllm_prompt_logprobs",
]

PROMPT_LOGPROBS = "prompt_logprobs"

# One entry per prompt token (None for the first); see the module docstring.
PromptLogprobEntries = list[dict[str, Any] | None]

_TOP = pa.struct([("token_id", pa.int64()), ("token", pa.string()), ("logprob", pa.float64())])
# One token's entry, in Arrow: the prompt_logprobs column's and the logprobs column's
# (logprobs_column.py), which hold the same fields.
LOGPROB_ENTRY = pa.struct(
    [
        ("token_id", pa.int64()),
        ("token", pa.string()),
        ("logprob", pa.float64()),
        ("rank", pa.int64()),
        ("top_logprobs", pa.list_(pa.field("element", _TOP))),
    ]
)
# Lists' items are named "element", as Parquet names them: the files then read back in
# exactly this schema. The metadata tells this column from a passthrough column that
# happens to share its name.
PROMPT_LOGPROBS_FIELD = pa.field(
    PROMPT_LOGPROBS,
    pa.list_(pa.field("element", LOGPROB_ENTRY)),
    metadata={b"tokenmill.column": b"prompt_logprobs"},
)


def is_prompt_logprobs_field(field: pa.Field) -> bool:
    """Whether ``field`` is the prompt logprobs column (name, type and metadata)."""
    return field.equals(PROMPT_LOGPROBS_FIELD, check_metadata=True)


def vllm_prompt_logprobs(
    entries: PromptLogprobEntries,
) -> list[dict[str, dict[str, Any]] | None]:
    """``entries`` in the shape of vLLM's OpenAI server: per position (None for the first)
    ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` for the prompt token, then each
    alternative not already named (ranked 1, 2, ... in order)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        position = {str(entry["token_id"]): _logprob(entry, entry["rank"])}
        for rank, top in enumerate(entry["top_logprobs"], start=1):
            position.setdefault(str(top["token_id"]), _logprob(top, rank))
        out.append(position)
    return out


def _logprob(entry: dict[str, Any], rank: int) -> dict[str, Any]:
    return {"logprob": entry["logprob"], "rank": rank, "decoded_token": entry["token"]}
