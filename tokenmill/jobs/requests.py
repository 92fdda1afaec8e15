"""Rows to engine requests and engine outputs back to result rows (any executor)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.prompts import encode_chat, encode_prompt
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.io.rows import InputRow, ResultRow

# A job row makes one completion: several (n, best_of) and prompt logprobs are the Python
# API's (LLM expands them); a row asking for them gets "unsupported sampling field(s)".
_PARAM_NAMES = {f.name for f in fields(SamplingParams)} - {"n", "best_of", "prompt_logprobs"}


def sampling_params_for(row: InputRow, defaults: dict[str, Any]) -> SamplingParams:
    """The job's sampling section overlaid with the row's own fields (OpenAI Batch bodies).

    Raises ValueError naming the field when a value is out of range.
    """
    merged = {k: v for k, v in defaults.items() if k in _PARAM_NAMES}
    merged.update(row.sampling)
    unknown = sorted(set(merged) - _PARAM_NAMES)
    if unknown:
        raise ValueError(f"unsupported sampling field(s): {', '.join(unknown)}")
    try:
        return SamplingParams(**merged)
    except TypeError as exc:
        raise ValueError(str(exc)) from None


def prompt_ids_for(row: InputRow, tokenizer: Any) -> list[int]:
    """Token ids of the row's prompt or conversation. Raises ValueError when it has neither."""
    if row.messages is not None:
        return encode_chat(tokenizer, row.messages)
    if row.prompt is not None:
        return encode_prompt(tokenizer, row.prompt)
    raise ValueError("the row has neither a prompt nor messages")


def row_error_reason(exc: Exception) -> str:
    """A row error's message: ValueErrors are ours and read as they are; anything else (a
    chat template's TemplateError, a tokenizer's error) is named by its type."""
    return str(exc) if type(exc) is ValueError else f"{type(exc).__name__}: {exc}"


def _identity(row: InputRow, model: str) -> dict[str, Any]:
    """The fields a result carries over from its input row, whether it succeeded or not."""
    return {
        "row_index": row.row_index,
        "row_id": row.row_id,
        "source": row.source,
        "passthrough": row.passthrough,
        "custom_id": row.custom_id,
        "endpoint": row.endpoint,
        "model": model,
    }


def error_result(row: InputRow, message: str, model: str = "") -> ResultRow:
    return ResultRow(**_identity(row, model), error=f"{row.source}: {message}")


def result_from_output(row: InputRow, out: RequestOutput, tokenizer: Any, model: str) -> ResultRow:
    """The ResultRow of a finished request; an engine-side error becomes a row error."""
    if out.error is not None:
        return error_result(row, out.error, model)
    logprobs = None
    if out.logprobs is not None:
        logprobs = [
            {
                "token": tokenizer.decode([lp.token_id]),
                "logprob": lp.logprob,
                "top_logprobs": [
                    {"token": tokenizer.decode([t]), "logprob": v} for t, v in lp.top.items()
                ],
            }
            for lp in out.logprobs
        ]
    return ResultRow(
        **_identity(row, model),
        text=out.text,
        finish_reason="stop" if out.finish_reason == "stop" else "length",
        prompt_tokens=out.num_prompt_tokens,
        completion_tokens=out.num_completion_tokens,
        logprobs=logprobs,
    )
