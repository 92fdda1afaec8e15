"""Rows to engine requests and engine outputs back to result rows (any executor)."""

from __future__ import annotations

import dataclasses
from dataclasses import fields
from typing import Any

from tokenmill.engine.logprob_texts import logprob_texts, special_token_ids
from tokenmill.engine.outputs import RequestOutput, TokenLogprob
from tokenmill.engine.prompts import ChatTemplate, encode_chat, encode_prompt
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.seeds import input_row_seed
from tokenmill.io.logprobs_column import LogprobEntries
from tokenmill.io.prompt_logprobs_column import PromptLogprobEntries
from tokenmill.io.rows import Choice, InputRow, ResultRow
from tokenmill.jobs.token_bytes import token_bytes

# A job row makes one completion, or n (OpenAI's ``n``), of best_of generated (the executor
# expands them through sample_groups.py), and may ask for its completion's and its prompt's
# logprobs.
_PARAM_NAMES = {f.name for f in fields(SamplingParams)}


def sampling_params_for(
    row: InputRow, defaults: dict[str, Any], per_row_seed: bool = True
) -> SamplingParams:
    """The job's sampling section overlaid with the row's own fields (OpenAI Batch bodies),
    with the job's seed made the row's own (``seeded_for_row``) unless ``per_row_seed`` is
    off or the row gives its own seed.

    Raises ValueError naming the field when a value is out of range, or when the job's
    ``sampling.best_of`` is less than the row's own ``n``.
    """
    merged = {k: v for k, v in defaults.items() if k in _PARAM_NAMES}
    merged.update(row.sampling)
    unknown = sorted(set(merged) - _PARAM_NAMES)
    if unknown:
        raise ValueError(f"unsupported sampling field(s): {', '.join(unknown)}")
    best_of, n = merged.get("best_of"), merged.get("n", 1)
    if "best_of" not in row.sampling and isinstance(best_of, int) and best_of < n:
        raise ValueError(
            f"the row asks for n={n} completions, more than the job's sampling.best_of="
            f"{best_of} generates; raise sampling.best_of to {n} or more, or lower the row's n"
        )
    try:
        params = SamplingParams(**merged)
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    except ValueError as exc:
        raise _named_as_in_the_body(exc, row) from None
    if not per_row_seed or "seed" in row.sampling:
        return params
    return seeded_for_row(params, row)


# The OpenAI Batch body key of a SamplingParams field, where it is spelled otherwise.
_BODY_KEYS = {"structured_output": "response_format"}


def _named_as_in_the_body(exc: ValueError, row: InputRow) -> ValueError:
    """``exc`` naming the OpenAI Batch body key where the row's own value broke the
    engine's rule (a temperature past float32, a schema llguidance cannot compile): the
    engine's ``SamplingParams.<field>`` is no key of the input line. Other rows' as it is."""
    message = str(exc)
    if row.endpoint is None:
        return exc
    for name in row.sampling:
        param = f"SamplingParams.{name}"
        if message.startswith(param):
            return ValueError(f"body.{_BODY_KEYS.get(name, name)}{message[len(param) :]}")
    return exc


def seeded_for_row(params: SamplingParams, row: InputRow) -> SamplingParams:
    """``params`` with the job's seed mixed with the row's index in the input, for a sampled
    row: each row draws from its own stream, so rows sample independently (one shared seed
    gave every row the same noise, and rows with alike distributions the same tokens), and
    a rerun or a resume draws every row again the same. Greedy and unseeded params are
    returned as they are."""
    if params.seed is None or params.greedy:
        return params
    return dataclasses.replace(params, seed=input_row_seed(params.seed, row.row_index))


def check_output_holds(
    params: SamplingParams,
    output_format: str,
    prompt_logprobs_column: bool = False,
    logprobs_column: bool = False,
) -> None:
    """Raise ValueError when the output format cannot hold what ``params`` asks for: several
    completions (``n > 1``) need OpenAI Batch output lines, which have a list of choices;
    prompt or completion logprobs in Parquet output need the job's schema to have their
    column (``prompt_logprobs_column``, ``logprobs_column``: the job's sampling section sets
    ``prompt_logprobs``, ``logprobs``)."""
    if params.n > 1 and output_format != "openai-batch":
        raise ValueError(
            f"n={params.n} asks for {params.n} completions, but output.format {output_format} "
            "holds one text per row; use output.format: openai-batch, or ask for n=1"
        )
    if output_format != "parquet":
        return
    if params.prompt_logprobs is not None and not prompt_logprobs_column:
        raise ValueError(
            f"prompt_logprobs={params.prompt_logprobs} asks for prompt logprobs, but the "
            "job's Parquet schema, fixed before its first shard, has no prompt_logprobs "
            "column; set sampling.prompt_logprobs in the job spec (a row's own value still "
            "applies to it), or use output.format: jsonl"
        )
    if params.logprobs is not None and not logprobs_column:
        raise ValueError(
            f"logprobs={params.logprobs} asks for the completion's logprobs (an OpenAI Batch "
            "body's logprobs/top_logprobs), but the job's Parquet schema, fixed before its "
            "first shard, has no logprobs column; set sampling.logprobs in the job spec (a "
            "row's own value still applies to it), or use output.format: jsonl"
        )


def prompt_ids_for(row: InputRow, tokenizer: Any, chat: ChatTemplate | None = None) -> list[int]:
    """Token ids of the row's prompt or conversation (rendered with ``chat``'s template,
    variables and ending when given, else the model's template; the row's own variables and
    ending over them). Raises ValueError when it has neither, or when its ending cannot be
    (``ChatTemplate.ending``)."""
    if row.prompt_token_ids is not None:
        return list(row.prompt_token_ids)
    if row.messages is not None:
        chat = (chat or ChatTemplate()).with_variables(row.chat_template_kwargs)
        generation, final = chat.ending(
            row.messages, row.add_generation_prompt, row.continue_final_message
        )
        return encode_chat(tokenizer, row.messages, generation, chat.template, chat.kwargs, final)
    if row.prompt is not None:
        return encode_prompt(tokenizer, row.prompt)
    raise ValueError("the row has neither a prompt nor messages")


def check_row_constraint(
    row: InputRow, params: SamplingParams, backend: str, column: str | None
) -> None:
    """Raise ValueError naming where ``row``'s own constraint came from (``column``, or an
    OpenAI Batch body's response_format) when the grammar library ``backend`` cannot run
    it. The reader checks every constraint as llguidance (the default) reads it; what only
    xgrammar refuses was named as the engine's SamplingParams field, not the input's. (A
    job-wide constraint is checked with the spec.)"""
    spec = params.structured_output
    if backend != "xgrammar" or spec is None or "structured_output" not in row.sampling:
        return
    from tokenmill.engine.grammar_xgrammar import xgrammar_refusal

    refusal = xgrammar_refusal(spec)
    if refusal is not None:
        where = "body.response_format" if row.endpoint is not None else f"column {column!r}"
        raise ValueError(f"{where}: {refusal}")


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


def error_result(
    row: InputRow, message: str, model: str = "", generated_tokens: int = 0
) -> ResultRow:
    return ResultRow(
        **_identity(row, model), error=f"{row.source}: {message}", generated_tokens=generated_tokens
    )


def result_from_output(
    row: InputRow,
    out: RequestOutput,
    tokenizer: Any,
    model: str,
    skip_special_tokens: bool = True,
    token_bytes_too: bool = False,
    generated_tokens: int | None = None,
) -> ResultRow:
    """The ResultRow of a finished request (of all its completions, for a row that asked for
    several); an engine-side error becomes a row error. Completion logprob tokens are
    decoded as the text was (``skip_special_tokens``: a special token's text is empty then);
    with ``token_bytes_too`` (OpenAI Batch output) each entry also holds its token's
    ``bytes`` (token_bytes.py). ``generated_tokens``: every token the row's samples generated
    (best_of's left-out ones included); by default the returned completions'."""
    if out.error is not None:
        return error_result(row, out.error, model, generated_tokens or 0)
    choices = tuple(
        Choice(
            text=c.text,
            finish_reason="stop" if c.finish_reason == "stop" else "length",
            completion_tokens=len(c.token_ids),
            logprobs=_logprobs(c.logprobs, tokenizer, skip_special_tokens, token_bytes_too),
        )
        for c in out.outputs
    )
    first = choices[0]
    completion_tokens = sum(c.completion_tokens for c in choices)
    return ResultRow(
        **_identity(row, model),
        text=first.text,
        finish_reason=first.finish_reason,
        prompt_tokens=out.num_prompt_tokens,
        completion_tokens=completion_tokens,
        generated_tokens=completion_tokens if generated_tokens is None else generated_tokens,
        logprobs=first.logprobs,
        choices=choices if len(choices) > 1 else (),
        prompt_logprobs=_prompt_logprobs(out.prompt_logprobs, tokenizer),
    )


def _logprobs(
    logprobs: list[TokenLogprob] | None,
    tokenizer: Any,
    skip_special_tokens: bool,
    with_bytes: bool = False,
) -> LogprobEntries | None:
    """A completion's logprobs as output entries (logprobs_column.py), decoded; each token's
    and alternative's ``bytes`` too when ``with_bytes``."""
    if logprobs is None:
        return None
    text = _texts(logprobs, tokenizer, skip_special_tokens)
    entries = [_entry(lp, text) for lp in logprobs]
    if with_bytes:
        ids = sorted(text)
        raw = token_bytes(tokenizer, ids, skip_special_tokens)
        for e in entries:
            for t in (e, *e["top_logprobs"]):
                t["bytes"] = None if raw[t["token_id"]] is None else list(raw[t["token_id"]])
    return entries


def _prompt_logprobs(
    entries: list[TokenLogprob | None] | None, tokenizer: Any
) -> PromptLogprobEntries | None:
    """The engine's prompt logprobs as output entries (prompt_logprobs_column.py), decoded
    with their special tokens (the chat template's turns: the prompt has them)."""
    if entries is None:
        return None
    text = _texts([e for e in entries if e is not None], tokenizer, False)
    return [None if e is None else _entry(e, text) for e in entries]


def _texts(entries: list[TokenLogprob], tokenizer: Any, skip_special_tokens: bool) -> Any:
    """The entries' token texts: those the engine's output builder decoded (for
    ``Logprob.decoded_token``: special tokens spelled out), with the special tokens' made
    empty under ``skip_special_tokens`` (as decoding skips them: the same texts over the
    embedded model's whole vocabulary); decoded here when the builder did not."""
    texts = entries[0].texts if entries else None
    if texts is None:
        return logprob_texts(entries, tokenizer, skip_special_tokens)
    if not skip_special_tokens:
        return texts
    special = special_token_ids(tokenizer)
    return {t: "" if t in special else text for t, text in texts.items()}


def _entry(lp: TokenLogprob, text: dict[int, str]) -> dict[str, Any]:
    """One position's entry: the token, its logprob and rank, the alternatives most likely
    first."""
    top = sorted(lp.top.items(), key=lambda kv: -kv[1])
    return {
        "token_id": lp.token_id,
        "token": text[lp.token_id],
        "logprob": lp.logprob,
        "rank": lp.rank,
        "top_logprobs": [{"token_id": t, "token": text[t], "logprob": v} for t, v in top],
    }
