"""Mapping an OpenAI Batch request body's sampling fields to SamplingParams keyword arguments.

Every field is checked here, so a bad value becomes a bad row naming the field instead of
failing later inside the engine. Fields that would change results but that tokenmill does not
implement are refused rather than silently ignored; unknown fields are refused too (a typo like
``temprature`` must not pass unnoticed). Every integer field takes a whole float (``5.0``)
as its integer, as OpenAI's API does; a fraction or a bool is refused (``_integer``).

``response_format`` maps to ``structured_output``: ``{"type": "json_schema", "json_schema":
{"name", "schema", "strict", "description"}}`` to the schema (enforced whatever ``strict``
says), ``{"type": "json_object"}`` to ``"json_object"``, ``{"type": "text"}`` to nothing. The
schema itself is checked when the row's SamplingParams are built (an error of that row).

``n`` (1-128) asks for that many choices in the row's one output line (SamplingParams.n;
each a request of its own in the engine, sharing the prompt's cached KV). ``best_of``
(completions only, as in OpenAI's API: n-128) generates that many and keeps the n with the
highest cumulative logprob (SamplingParams.best_of); a chat body's ``best_of`` is refused
unless it is the no-op 1. ``logit_bias`` maps token ids (as strings, OpenAI's JSON) to a
bias in [-100, 100] (SamplingParams.logit_bias, checked by the same rule).
``prompt_logprobs`` (0-20, vLLM's extension to both endpoints) asks for each prompt token's
logprob and that many alternatives (SamplingParams.prompt_logprobs).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from tokenmill.engine.sampling_params import SEED_RANGE, check_logit_bias, is_int, is_number
from tokenmill.io.readers.row_error import RowError, short_repr

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

_COMMON = frozenset(
    {"max_tokens", "temperature", "top_p", "stop", "seed", "presence_penalty",
     "frequency_penalty", "logprobs", "n", "logit_bias", "prompt_logprobs"}
)  # fmt: skip
MAX_N = 128  # OpenAI's bound on n; tokenmill's on best_of too
# The last three: vLLM's, for the template (openai_batch_rows.py)
_CHAT_ONLY = {"messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs",
              "add_generation_prompt", "continue_final_message"}  # fmt: skip
_SUPPORTED = {
    CHAT: _COMMON | _CHAT_ONLY | {"response_format"},
    # OpenAI's completions take no response_format; vLLM's do, and so does tokenmill.
    COMPLETIONS: _COMMON | {"prompt", "response_format", "best_of"},
}
# Accepted and ignored: they do not change the completion (the job's model always answers;
# service_tier is OpenAI's latency and price class; safety_identifier and prompt_cache_key
# are what OpenAI replaces user with).
_IGNORED = frozenset(
    {"model", "user", "metadata", "store", "stream", "service_tier", "safety_identifier",
     "prompt_cache_key"}
)  # fmt: skip
# Refused unless they hold their no-op value (given here): with no tools, tool_choice
# "none" and parallel_tool_calls true are OpenAI's defaults.
_UNSUPPORTED_UNLESS = {"best_of": 1, "tools": [], "modalities": ["text"], "echo": False,
                       "tool_choice": "none", "parallel_tool_calls": True}  # fmt: skip
# Fields of another endpoint only, which the refusal names.
_ENDPOINT_OF = {"best_of": COMPLETIONS}
# Refused with where the job can say it instead.
_JOB_INSTEAD = {"chat_template": "model.chat_template"}
_JSON_SCHEMA_KEYS = frozenset({"name", "description", "schema", "strict"})


def openai_sampling(body: dict[str, Any], endpoint: str, row_id: str) -> dict[str, Any]:
    """SamplingParams keyword arguments from ``body``; RowError names the first bad field."""
    _refuse_unsupported(body, endpoint, row_id)
    fields = {k: v for k, v in body.items() if v is not None}
    sampling: dict[str, Any] = {}

    max_tokens = _max_tokens(fields, row_id)
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    if "temperature" in fields:
        value = fields["temperature"]
        _expect(is_number(value) and value >= 0, "temperature", value, "a number >= 0", row_id)
        sampling["temperature"] = value
    if "top_p" in fields:
        value = fields["top_p"]
        _expect(is_number(value) and 0 < value <= 1, "top_p", value, "in (0, 1]", row_id)
        sampling["top_p"] = value
    for name in ("presence_penalty", "frequency_penalty"):
        if name in fields:
            value = fields[name]
            _expect(is_number(value) and -2 <= value <= 2, name, value, "in [-2, 2]", row_id)
            sampling[name] = value
    if "seed" in fields:
        sampling["seed"] = _integer("seed", fields["seed"], row_id, *SEED_RANGE)
    # A body's explicit empty value overrides the job's (stop [], logit_bias {}, logprobs
    # false, response_format text): each left the job's own in force.
    if "stop" in fields:
        sampling["stop"] = _stop(fields["stop"], row_id)
    if "n" in fields:
        value = _integer("n", fields["n"], row_id, 1, MAX_N)
        if value > 1:
            sampling["n"] = value
    if "best_of" in fields and endpoint == COMPLETIONS:
        sampling["best_of"] = _best_of(fields["best_of"], sampling.get("n", 1), row_id)
    if "prompt_logprobs" in fields:
        sampling["prompt_logprobs"] = _integer(
            "prompt_logprobs", fields["prompt_logprobs"], row_id, 0, 20
        )
    if "logit_bias" in fields:
        try:
            bias = check_logit_bias(fields["logit_bias"], "body.logit_bias")
        except ValueError as exc:
            raise RowError(str(exc), row_id) from None
        sampling["logit_bias"] = bias
    logprobs = _logprobs(fields, endpoint, row_id)
    if logprobs is not None or "logprobs" in fields:
        sampling["logprobs"] = logprobs
    if "response_format" in fields:
        sampling["structured_output"] = _response_format(fields["response_format"], row_id)
    return sampling


def _refuse_unsupported(body: dict[str, Any], endpoint: str, row_id: str) -> None:
    for name, value in body.items():
        if name in _SUPPORTED[endpoint] or value is None:
            continue
        if name == "stream":
            if value is not False:
                raise RowError(f"body.stream must be false in a batch file, got {value!r}", row_id)
        elif name in _IGNORED:
            continue
        elif name in _UNSUPPORTED_UNLESS:
            noop = _UNSUPPORTED_UNLESS[name]
            given = _whole(value)  # (a chat body's best_of 1.0 is the no-op 1)
            if given != noop or type(given) is not type(noop):  # (True == 1)
                only = _ENDPOINT_OF.get(name)
                where = "by tokenmill" if only is None else f"for {endpoint} (only {only} has it)"
                raise RowError(
                    f"body.{name}={short_repr(value)} is not supported {where}; remove it",
                    row_id,
                )
        elif name in _JOB_INSTEAD:
            raise RowError(
                f"body.{name} is not taken from a batch line; set {_JOB_INSTEAD[name]} in the "
                "job instead (one template for every row)",
                row_id,
            )
        else:
            raise RowError(
                f"body.{name} is not supported by tokenmill for {endpoint}; remove it "
                f"(supported: {', '.join(sorted(_SUPPORTED[endpoint] | _IGNORED))})",
                row_id,
            )


def _response_format(value: Any, row_id: str) -> str | dict[str, Any] | None:
    try:
        return response_format_setting(value, "body.response_format")
    except ValueError as exc:
        raise RowError(str(exc), row_id) from None


def response_format_setting(value: Any, where: str) -> str | dict[str, Any] | None:
    """``structured_output`` for an OpenAI ``response_format`` (a body's, or a job's
    ``sampling.response_format``): None (text), "json_object" or the schema. Raises
    ValueError naming ``where`` and what is wrong."""

    def expect(ok: bool, name: str, got: Any, expected: str) -> None:
        if not ok:
            raise ValueError(f"{where}{name} must be {expected}, got {short_repr(got)}")

    kinds = ("text", "json_object", "json_schema")
    kind = value.get("type") if isinstance(value, dict) else None
    expect(
        kind in kinds, "", value, 'an object whose "type" is "text", "json_object" or "json_schema"'
    )
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    extra = _given_keys(value, allowed)
    if extra:
        raise ValueError(f"{where} of type {kind!r} takes no {', '.join(extra)}; remove it")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object"
    spec = value.get("json_schema")
    expect(
        isinstance(spec, dict) and isinstance(spec.get("schema"), dict),
        ".json_schema",
        spec,
        'an object with "schema" (a JSON Schema object), "name", "strict", "description"',
    )
    extra = _given_keys(spec, _JSON_SCHEMA_KEYS)
    if extra:
        raise ValueError(
            f"{where}.json_schema takes no {', '.join(extra)}; remove it "
            f"(it takes {', '.join(sorted(_JSON_SCHEMA_KEYS))})"
        )
    for key, ok, expected in (
        ("name", isinstance(spec.get("name"), str), "a string"),
        ("description", isinstance(spec.get("description"), str), "a string"),
        ("strict", isinstance(spec.get("strict"), bool), "true or false"),
    ):
        if spec.get(key) is not None:
            expect(ok, f".json_schema.{key}", spec[key], expected)
    return spec["schema"]


def _given_keys(value: dict[str, Any], allowed: Collection[str]) -> list[str]:
    """``value``'s keys outside ``allowed``, sorted; a key set to null reads as absent, as a
    body's own do (serializers of OpenAI's union type write the other kinds' keys as null)."""
    return sorted(k for k, v in value.items() if k not in allowed and v is not None)


def _best_of(value: Any, n: int, row_id: str) -> int:
    """A completions body's best_of (kept when it equals n: it overrides the job's)."""
    value = _integer("best_of", value, row_id, 1, MAX_N)
    if value < n:
        raise RowError(
            f"body.best_of={value} is less than body.n={n}: best_of completions are generated "
            "and the n best returned, so best_of must be >= n; raise best_of or lower n",
            row_id,
        )
    return value


def _max_tokens(fields: dict[str, Any], row_id: str) -> int | None:
    found: dict[str, int] = {}
    for name in ("max_tokens", "max_completion_tokens"):
        if name in fields:
            found[name] = _integer(name, fields[name], row_id, 1)
            _expect(found[name] < 2**31, name, fields[name], "at most 2**31 - 1", row_id)  # int32
    if len(set(found.values())) > 1:
        raise RowError(
            f"body.max_tokens={found['max_tokens']} and body.max_completion_tokens="
            f"{found['max_completion_tokens']} disagree; give one of them",
            row_id,
        )
    return next(iter(found.values()), None)


def _stop(value: Any, row_id: str) -> list[str]:
    stop = [value] if isinstance(value, str) else value
    _expect(
        isinstance(stop, list) and all(isinstance(s, str) and s for s in stop),
        "stop",
        value,
        "a non-empty string or a list of them",
        row_id,
    )
    return list(stop)


def _logprobs(fields: dict[str, Any], endpoint: str, row_id: str) -> int | None:
    value = fields.get("logprobs")
    if endpoint == COMPLETIONS:
        if value is None:
            return None
        return _integer("logprobs", value, row_id, 0, 20)
    top = fields.get("top_logprobs")
    if value is not None:
        _expect(isinstance(value, bool), "logprobs", value, "true or false", row_id)
    if top is not None:
        top = _integer("top_logprobs", top, row_id, 0, 20)
        if not value:
            raise RowError("body.top_logprobs needs body.logprobs: true", row_id)
    return (top or 0) if value else None


def _expect(ok: bool, name: str, value: Any, expected: str, row_id: str) -> None:
    if not ok:
        raise RowError(f"body.{name} must be {expected}, got {short_repr(value)}", row_id)


def _integer(
    name: str, value: Any, row_id: str, low: int | None = None, high: int | None = None
) -> int:
    """``value`` of the body's integer field ``name``, in [low, high] where given. A whole
    float counts as its integer (``5.0``), as JSON Schema's "integer" and OpenAI's and vLLM's
    servers take it: JSON writers give every number of a column holding a null as a float.
    A bool, a fraction or a value out of range is RowError naming the field and the value."""
    whole = _whole(value)
    if isinstance(whole, float) and whole.is_integer():
        raise RowError(
            f"body.{name} must be an integer, got the float {short_repr(value)}: past 2**53 a "
            "float may not be the integer written; write it without a fraction or exponent",
            row_id,
        )
    if low is None:
        expected = "an integer"
    elif high is None:
        expected = f"an integer >= {low}"
    else:
        expected = f"an integer in [{low}, {high}]"
    ok = is_int(whole) and (low is None or whole >= low) and (high is None or whole <= high)
    _expect(ok, name, value, expected, row_id)
    return whole


_EXACT = 2**53  # every integer up to here is a float; past it, floats skip integers


def _whole(value: Any) -> Any:
    """A whole float (up to 2**53) as its int; else ``value``."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= _EXACT:
        return int(value)
    return value
