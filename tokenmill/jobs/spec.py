"""JobSpec: the job.yaml schema, validated at the boundary.

Every key but ``model.source``, ``input.path`` and ``output.path`` has a default. Unknown keys
are errors that name the key and the file. ``--set key.path=value`` overrides are applied to
the raw YAML before validation, so they are checked the same way.

Scalars are strict: YAML already turns ``8``, ``0.5`` and ``true`` into numbers and booleans,
so ``rows_per_shard: true`` or ``max_tokens: "5"`` is a mistake to report, not to coerce.
Lists stay lists (tuple fields accept them); their items are strict too. The raw value is
measured before validation (``yaml_limits``), so YAML alias bombs are refused at once, and
every error message shows values through a bounded repr. The ``engine`` section is made from
EngineConfig's fields and checked by its rules (``engine_section``).
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import fields
from datetime import date, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import ErrorDetails

from tokenmill.engine.engine_config import EngineConfig, EngineSettingError, UnknownSettingError
from tokenmill.engine.prompts import ChatTemplate
from tokenmill.engine.sampling_params import SamplingParamError, SamplingParams, check_logit_bias
from tokenmill.engine.structured_output_params import structured_output_setting
from tokenmill.engine.value_text import kind_name
from tokenmill.io.readers.openai_sampling import MAX_N, response_format_setting
from tokenmill.io.readers.storage import location_problem
from tokenmill.jobs.chat_template_setting import (
    chat_template_kwargs_setting,
    chat_template_setting,
)
from tokenmill.jobs.engine_section import ELSEWHERE, EngineSection
from tokenmill.jobs.yaml_limits import (
    MAX_FILE_BYTES,
    dotted_key,
    find_oversize,
    show_value,
)
from tokenmill.scheduling.planner_settings import MAX_WINDOW, PlannerSettings

# Output columns a passthrough column may not shadow.
RESERVED_OUTPUT_COLUMNS = {
    "id",
    "text",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "error",
}


_ENGINE_RULES = {f.name: f.metadata["rule"] for f in fields(EngineConfig)}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
MAX_ERROR_LINES = 20


class JobSpecError(ValueError):
    """The spec is invalid; the message names the file and the key."""


def _structured_output_setting(value: Any) -> str | None:
    """``sampling.structured_output`` as SamplingParams takes it: ``json_object``, or a
    one-key mapping ``{json_schema: <a JSON Schema mapping, or its JSON text>}``,
    ``{regex: <pattern>}`` or ``{choice: [<string>, ...]}``; also the canonical text itself
    (what ``to_dict`` writes back). Raises ValueError saying what is expected."""
    try:
        return structured_output_setting(value)
    except ImportError as exc:  # pydantic reports ValueErrors only
        raise ValueError(str(exc)) from None


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError(f"must not be empty or blank, got {show_value(value)}")
    if "\0" in value:
        raise ValueError(f"must not contain a NUL character, got {show_value(value)}")
    return value


def _job_name(value: str) -> str:
    if _NAME.fullmatch(value) is None:
        raise ValueError(
            "must be 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit "
            f"(it names the manifest file), got {show_value(value)}"
        )
    return value


# Scalars: strict, so YAML's numbers and booleans pass and quoted or mistyped ones do not.
Number = Annotated[float, Strict(), AllowInfNan(False)]  # ints pass (and become floats)
NonBlank = Annotated[StrictStr, AfterValidator(_not_blank)]


def _openable(url: str) -> str:
    problem = location_problem(url)
    if problem is not None:
        raise ValueError(problem)
    return url


Location = Annotated[NonBlank, AfterValidator(_openable)]  # input.path, output.path
JobName = Annotated[StrictStr, AfterValidator(_job_name)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    source: NonBlank
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: Literal["none", "fp8", "int4", "int8"] = "none"
    tensor_parallel: StrictInt = Field(1, ge=1, le=1)  # >1 lands with tensor parallelism
    pipeline_parallel: StrictInt = Field(1, ge=1, le=1)  # >1 lands with pipeline parallelism
    # Replaces the model's chat template: Jinja text, or a local file holding it (read at
    # load, so the spec carries the text wherever it goes). See chat_template_setting.
    chat_template: StrictStr | None = None
    # Extra variables the chat template reads, e.g. {enable_thinking: false} for Qwen3.
    chat_template_kwargs: dict[StrictStr, Any] = Field(default_factory=dict)
    # How every conversation ends (an OpenAI Batch body's own win for its row): a new
    # assistant turn, or the last, assistant, message continued (the reply begun in the data).
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False

    @field_validator("continue_final_message")
    @classmethod
    def _one_ending(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt"):  # (validated before this key)
            raise ValueError(
                "true with model.add_generation_prompt true too, which transformers refuses: "
                "the last message is continued, or a new assistant turn is started; set "
                "model.add_generation_prompt: false to continue the last message"
            )
        return value

    @field_validator("tensor_parallel", "pipeline_parallel", mode="before")
    @classmethod
    def _one_device(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            raise ValueError(
                f"{value} is not supported yet: an engine runs on one device; for several "
                "GPUs run several engines, with execution.executor: ray and "
                "execution.replicas"
            )
        return value

    @field_validator("chat_template", mode="before")
    @classmethod
    def _chat_template(cls, value: Any) -> Any:
        return chat_template_setting(value) if isinstance(value, str) else value

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _chat_template_kwargs(cls, value: Any) -> Any:
        return chat_template_kwargs_setting(value)

    def chat(self) -> ChatTemplate:
        """How the job renders its conversations."""
        return ChatTemplate.of_settings(self)


class InputSection(_Section):
    path: Location
    format: Literal["auto", "jsonl", "parquet", "openai-batch"] = "auto"
    id_column: StrictStr | None = "id"
    prompt_column: StrictStr | None = "prompt"
    messages_column: StrictStr | None = None
    passthrough_columns: tuple[StrictStr, ...] = ()
    storage_options: dict[StrictStr, Any] = Field(default_factory=dict)
    # Plain rows: the column holding each row's own output constraint (see plain_rows.py).
    structured_output_column: StrictStr | None = None

    @field_validator("passthrough_columns")
    @classmethod
    def _no_clash(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        # Case too: duckdb and Spark match column names without it (duckdb renamed a
        # passthrough "Text" to "Text_1" and gave the generated text for "Text").
        clash = sorted(c for c in value if c.lower() in RESERVED_OUTPUT_COLUMNS)
        if clash:
            raise ValueError(
                f"{', '.join(clash)} would overwrite the output column(s) of that name (names "
                "are compared without case, as duckdb and Spark read them); rename them in "
                "the input or leave them out"
            )
        for column in value:
            try:
                column.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(
                    f"{column!r} is not valid Unicode (a lone surrogate: write the character "
                    "itself, or its JSON escape as one pair)"
                ) from None
        folded: dict[str, str] = {}
        for column in value:
            other = folded.setdefault(column.lower(), column)
            if other != column:
                raise ValueError(
                    f"{other!r} and {column!r} differ only in case, which duckdb and Spark "
                    "read as one column; pass one of them"
                )
        return value


class SamplingSection(_Section):
    max_tokens: StrictInt = Field(128, ge=1)
    temperature: Number = Field(0.0, ge=0)
    top_p: Number = Field(1.0, gt=0, le=1)
    top_k: StrictInt = Field(-1, ge=-1)
    min_p: Number = Field(0.0, ge=0, le=1)
    presence_penalty: Number = Field(0.0, ge=-2, le=2)
    frequency_penalty: Number = Field(0.0, ge=-2, le=2)
    repetition_penalty: Number = Field(1.0, gt=0)
    seed: StrictInt | None = 0
    stop: tuple[StrictStr, ...] = ()
    ignore_eos: StrictBool = False
    # A constraint for every row: {json_schema: <schema>}, json_object, {regex: <pattern>}
    # or {choice: [...]}; held as SamplingParams.structured_output holds it (canonical
    # text: compact JSON, "json_object", "regex:<pattern>", 'choice:["a","b"]').
    structured_output: StrictStr | None = None
    # Token id -> bias in [-100, 100] for every row (OpenAI's logit_bias): {1234: -100}.
    logit_bias: dict[int, float] | None = None
    # Completions generated a row, of which the n (1, or an OpenAI Batch body's n) with the
    # highest cumulative logprob are written (SamplingParams.best_of; >= every row's n).
    best_of: StrictInt | None = Field(None, ge=1, le=MAX_N)
    # Each prompt token's logprob and this many top alternatives, written in a
    # prompt_logprobs column (SamplingParams.prompt_logprobs).
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    # Each output token's logprob and this many top alternatives, written in a logprobs
    # column (SamplingParams.logprobs; an OpenAI Batch body's own still applies to its row).
    logprobs: StrictInt | None = Field(None, ge=0, le=20)

    @model_validator(mode="before")
    @classmethod
    def _response_format(cls, data: Any) -> Any:
        """OpenAI's spelling, ``response_format: {type: json_schema, json_schema: {name,
        schema}}`` (or json_object, text), read as the structured_output it means: the job
        is the one written with structured_output (one fingerprint)."""
        if not isinstance(data, dict) or "response_format" not in data:
            return data
        data = dict(data)
        value = data.pop("response_format")
        if value is None:  # unset, as structured_output: null
            return data
        if data.get("structured_output") is not None:
            raise ValueError(
                "response_format and structured_output both set: they say the same thing, keep one"
            )
        constraint = response_format_setting(value, "response_format")
        if constraint is not None:
            data["structured_output"] = (
                {"json_schema": constraint} if isinstance(constraint, dict) else constraint
            )
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("structured_output", mode="before")
    @classmethod
    def _structured_output(cls, value: Any) -> Any:
        return _structured_output_setting(value)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, value: Any) -> Any:
        return check_logit_bias(value, "")

    @model_validator(mode="after")
    def _usable(self) -> SamplingSection:
        """What SamplingParams refuses fails here, before the model loads, instead of in
        every row (an empty stop string, a top_k past 2**31 - 1)."""
        names = {f.name for f in fields(SamplingParams)}
        values = {k: v for k, v in self.model_dump().items() if k in names and v is not None}
        try:
            SamplingParams(**values)
        except SamplingParamError as exc:  # named as sampling.<key> in the error list
            value = list(exc.value) if isinstance(exc.value, tuple) else exc.value  # as given
            raise EngineSettingError(f"sampling.{exc.name}", value, exc.expected) from None
        except ValueError as exc:
            raise ValueError(str(exc).replace("SamplingParams.", "")) from None
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Unset, the key is left out: the fingerprints of jobs started before it existed
        # stay the same, so they resume.
        data = handler(self)
        for key in ("structured_output", "logit_bias", "best_of", "prompt_logprobs", "logprobs"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class OutputSection(_Section):
    path: Location
    format: Literal["parquet", "jsonl", "openai-batch"] = "parquet"
    # Left out: as many rows as hold about 64 MiB, 1000 at most (shard_size.py)
    rows_per_shard: StrictInt = Field(1000, ge=1)
    storage_options: dict[StrictStr, Any] = Field(default_factory=dict)

    @property
    def rows_per_shard_given(self) -> bool:
        """Whether the job set ``rows_per_shard`` (else its run picks it: shard_size.py)."""
        return "rows_per_shard" in self.model_fields_set


# execution's keys that only a Ray run reads: set with the local executor, they are refused.
RAY_ONLY = ("replicas", "ray_address", "stall_timeout_s", "replica_failures_in_a_row")


class ExecutionSection(_Section):
    executor: Literal["local", "ray"] = "local"
    replicas: StrictInt = Field(1, ge=1)
    ray_address: StrictStr | None = None
    # Ray: a replica that holds rows and takes no engine step for this long is hung: it is
    # killed and replaced, and its rows run again. null: wait forever
    stall_timeout_s: Number | None = Field(600.0, gt=0)
    # Ray: replica failures in a row, no chunk finishing between them, that end the job (the
    # breaker: ray_chunks.py). null: max(16, 4 x replicas). More for a cluster known to be
    # flaky; fewer to fail fast (1: the first failure, as the local executor's first error)
    replica_failures_in_a_row: StrictInt | None = Field(None, ge=1)

    @field_validator(*RAY_ONLY)
    @classmethod
    def _for_ray(cls, value: Any, info: ValidationInfo) -> Any:
        """Ray's settings with the local executor would be ignored, silently. Each is named
        by its own key (``execution.replicas``), so a ``--set`` of it says so."""
        default = ExecutionSection.model_fields[str(info.field_name)].default
        if info.data.get("executor") == "local" and value != default:  # (validated before)
            raise ValueError(
                f"needs executor: ray, got {show_value(value)} (the local executor runs one "
                "engine in this process); set execution.executor: ray or leave this key out"
            )
        return value


_PLANNER = PlannerSettings()


class PlannerSection(_Section):
    """The dataset planner (tokenmill/scheduling/): PlannerSettings' keys and defaults. It
    changes no row's result, so it is not in the job fingerprint."""

    order: Literal["length", "input"] = _PLANNER.order
    window: StrictInt = Field(_PLANNER.window, ge=1, le=MAX_WINDOW)
    dedup: StrictBool = _PLANNER.dedup
    routing: Literal["prefix", "balance"] = _PLANNER.routing

    def settings(self) -> PlannerSettings:
        return PlannerSettings(self.order, self.window, self.dedup, self.routing)


class JobSpec(_Section):
    name: JobName = "job"
    model: ModelSection
    input: InputSection
    sampling: SamplingSection = SamplingSection()
    output: OutputSection
    engine: EngineSection = EngineSection()
    execution: ExecutionSection = ExecutionSection()
    planner: PlannerSection = PlannerSection()

    @field_validator("engine")
    @classmethod
    def _backend_runs_the_constraint(cls, engine: EngineSection, info: Any) -> EngineSection:
        """A job-wide constraint the chosen grammar library cannot run fails the spec, not
        every row (the sampling section checks it with llguidance, the default)."""
        sampling = info.data.get("sampling")
        spec = None if sampling is None else sampling.structured_output
        if spec is not None and engine.structured_output_backend == "xgrammar":
            from tokenmill.engine.grammar_xgrammar import xgrammar_refusal

            try:
                refusal = xgrammar_refusal(spec)
            except ImportError as exc:
                refusal = str(exc)
            if refusal is not None:
                raise ValueError(
                    "structured_output_backend xgrammar cannot run sampling.structured_output: "
                    + refusal
                )
        return engine

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        overrides: list[str] | None = None,
        settings: Mapping[str, Any] | None = None,
    ) -> JobSpec:
        """Read a job.yaml, set ``settings``, apply ``key.path=value`` overrides, validate.

        ``settings`` map dotted keys to values taken as given, not parsed as YAML (run-job's
        ``--model``, ``--input``, ``--output``: a path is a string whatever it looks like).
        Relative ``input.path``/``output.path`` resolve against the current directory (as a
        cron job or a shell would see them). Raises JobSpecError naming the file and key.
        """
        path = Path(path)
        raw = _read_yaml(path)
        if not isinstance(raw, dict):
            raise JobSpecError(f"{path}: expected a mapping of sections (name, model, input, ...)")
        # An error in a key the command line set says so: the file does not hold it.
        given = [*(settings or {}), *(item.partition("=")[0] for item in overrides or [])]
        return cls._with_changes(raw, settings, overrides, str(path), given)

    @classmethod
    def from_settings(
        cls,
        settings: Mapping[str, Any],
        overrides: list[str] | None = None,
        where: str = "command line",
    ) -> JobSpec:
        """The JobSpec a job.yaml holding just ``settings`` (dotted key -> value, e.g.
        ``{"model.source": ..., "input.path": ..., "output.path": ...}``) would give, with
        ``key.path=value`` overrides applied; validated exactly as ``load`` validates a file.
        Raises JobSpecError starting with ``where`` and naming the key."""
        return cls._with_changes({}, settings, overrides, where)

    @classmethod
    def _with_changes(
        cls,
        raw: dict[str, Any],
        settings: Mapping[str, Any] | None,
        overrides: list[str] | None,
        where: str,
        given: Sequence[str] = (),
    ) -> JobSpec:
        for key, value in (settings or {}).items():
            set_key(raw, key, value, where)
        for item in overrides or []:
            apply_override(raw, item, where)
        return cls._validated(raw, where, given)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "<dict>") -> JobSpec:
        """Validate a dict of sections; ``where`` (a file name) starts every error message.

        Raises JobSpecError listing each bad key, also for values too large to validate
        (over ``yaml_limits.MAX_ITEMS`` once YAML aliases are expanded) or self-referencing.
        """
        return cls._validated(raw, where)

    @classmethod
    def _validated(cls, raw: dict[str, Any], where: str, given: Sequence[str] = ()) -> JobSpec:
        """``from_dict``; an error in one of the ``given`` keys (or below one) says that the
        command line set it, as ``where`` names the job file, which does not hold it."""
        oversize = find_oversize(raw)
        if oversize is not None:
            raise JobSpecError(f"{where}: invalid job spec:\n  {oversize.key}: {oversize.reason}")
        try:
            return cls.model_validate(raw, context={"where": where})
        except ValidationError as exc:
            raise JobSpecError(_format_errors(exc, where, given)) from None

    def to_dict(self) -> dict[str, Any]:
        """The spec as job.yaml's sections; ``output.rows_per_shard`` left out where the job
        left it out, so that a job file written from it still has its run pick one."""
        data = self.model_dump(mode="json")
        if not self.output.rows_per_shard_given:
            del data["output"]["rows_per_shard"]
        return data


def _read_yaml(path: Path) -> Any:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise JobSpecError(f"{path}: no such job file") from None
    except OSError as exc:
        raise JobSpecError(f"{path}: cannot read the job file: {exc.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise JobSpecError(f"{path}: over {MAX_FILE_BYTES >> 20} MiB; is this a job.yaml?")
    try:
        return yaml.safe_load(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise JobSpecError(f"{path}: not valid YAML: the file is not UTF-8 text") from None
    except yaml.YAMLError as exc:
        raise JobSpecError(f"{path}: not valid YAML: {_yaml_problem(exc)}") from None
    except RecursionError:
        raise JobSpecError(f"{path}: not valid YAML: lists or mappings nested too deep") from None
    except ValueError as exc:  # e.g. an integer past Python's 4300-digit limit
        raise JobSpecError(f"{path}: not valid YAML: {str(exc).split(';')[0][:200]}") from None


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong and where, without the quoted lines (which may hold a secret, e.g. a
    storage_options value on the line that broke)."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return type(exc).__name__
    parts = []
    for text, mark in ((exc.context, exc.context_mark), (exc.problem, exc.problem_mark)):
        if text:
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            parts.append(f"{text}{at}")
    return "; ".join(parts) or type(exc).__name__


def parse_override_value(text: str) -> Any:
    """An override's value (``--set key=value``) as YAML reads it; the text itself where
    YAML cannot read it."""
    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, ValueError, RecursionError):
        return text  # validation then reports it, e.g. "expected an integer, got the string"


def apply_override(raw: dict[str, Any], item: str, where: str) -> None:
    """Set ``a.b.c=value`` in ``raw``; the value is parsed as YAML (numbers, bools, lists)."""
    key, sep, value = item.partition("=")
    if not sep or not key:  # the text after the key is not shown: it may be a secret
        shown, _ = split_malformed_override(item)
        missing = "no '='" if not sep else "no key before '='"
        raise JobSpecError(f"{where}: --set {shown!r}...: expected key.path=value ({missing})")
    set_key(raw, key, parse_override_value(value), where)


def split_malformed_override(item: str) -> tuple[str, str]:
    """An override without ``key=`` as (what its error shows: the leading key characters,
    the rest: never shown, it may be a secret)."""
    shown = re.match(r"[\w.-]*", item)[0]
    return shown, item[len(shown) :]


def set_key(raw: dict[str, Any], key: str, value: Any, where: str) -> None:
    """Set the dotted ``key`` (``a.b.c``) in ``raw`` to ``value``, making sections on the way.
    Raises JobSpecError when a part of the path holds a value rather than a section."""
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise JobSpecError(
                f"{where}: {dotted_key(parts)}: {dotted_key([part])} holds a value, not a section"
            )
        node = child
    node[parts[-1]] = value


# What a strict scalar field expected, by pydantic error type.
_EXPECTED = {
    "int_type": "expected an integer",
    "int_parsing": "expected an integer",
    "int_from_float": "expected an integer",
    "float_type": "expected a number",
    "float_parsing": "expected a number",
    "finite_number": "expected a finite number",
    "bool_type": "expected true or false",
    "bool_parsing": "expected true or false",
    "string_type": "expected a string",
    "tuple_type": "expected a list",
    "list_type": "expected a list",
    "dict_type": "expected a mapping",
    "model_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
}


def _shown_with_type(value: Any) -> str:
    """A value for a "got ..." clause; strings say so, since '5' reads like the number 5."""
    shown = show_value(value)
    return f"the string {shown}" if isinstance(value, str) else shown


def _yaml_hint(kind: str, value: Any) -> str:
    """How to write what YAML read as another type: ``1e9`` is text to YAML (it wants a dot
    and a signed exponent, ``1.0e+9``); ``2024-12-01`` a date and ``007`` the number 7 where
    text was meant."""
    if kind.startswith(("float_", "int_")) and isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return ""
        if not math.isfinite(number):
            return ""
        whole = number.is_integer() and abs(number) < 1e18
        if kind.startswith("int_") and whole:
            return f" (YAML reads {value} as text: write {int(number)})"
        written = f"{number!r} or {int(number)}" if whole else repr(number)
        return f" (YAML reads {value} as text: write {written})"
    read_as = {bool: "true or false", int: "a number", float: "a number"}.get(type(value))
    if kind == "string_type" and (read_as or isinstance(value, (date, datetime))):
        return f" (YAML read it as {read_as or 'a date'}: quote it to keep it text)"
    return ""


def _engine_hint(error: EngineSettingError) -> str:
    """``_yaml_hint`` for an engine setting's text that reads as a number, offering only
    what the setting's rule accepts: ``max_num_seqs: 1e3`` is 1000, not "1000.0 or 1000"
    (a float is no batch size), and ``kv_cache_memory: 2e9`` bytes is 2000000000."""
    rule = _ENGINE_RULES.get(error.key)
    hint = _yaml_hint("float_type", error.value)
    if rule is None or not hint:
        return hint
    number = float(error.value)  # _yaml_hint read it as a finite number
    written = [int(number)] if number.is_integer() and abs(number) < 1e18 else []
    written = [v for v in (*written, number) if rule.accepts(v)]
    if not written:  # no spelling of it would do: the expected values say what does
        return ""
    return f" (YAML reads {error.value} as text: write {' or '.join(map(repr, written))})"


def _did_you_mean(loc: tuple[int | str, ...]) -> str:
    """`` (did you mean sampling.max_tokens?)`` for an unknown key close to one of its
    section's (a typo), else ''."""
    section: Any = JobSpec
    for part in loc[:-1]:
        field = section.model_fields.get(str(part))
        section = None if field is None else field.annotation
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            return ""
    close = difflib.get_close_matches(str(loc[-1]), list(section.model_fields), n=1, cutoff=0.75)
    if not close:
        return ""
    return f" (did you mean {'.'.join([*map(str, loc[:-1]), close[0]])}?)"


def _describe(err: ErrorDetails) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        loc = err["loc"]
        if len(loc) == 2 and loc[0] == "engine" and loc[1] in ELSEWHERE:
            return f"unknown key ({ELSEWHERE[str(loc[1])]})"
        return "unknown key" + _did_you_mean(loc)
    if kind == "missing":
        return "required key is missing"
    if kind == "value_error":  # our validators' messages say what they got
        error = err.get("ctx", {}).get("error", err["msg"])
        if isinstance(error, UnknownSettingError):  # in a group: engine.speculative.<key>
            group = _error_key(err).rpartition(".")[0]
            return "unknown key" + (
                f" (did you mean {group}.{error.close}?)" if error.close else ""
            )
        if isinstance(error, EngineSettingError):  # the value as YAML spells it
            hint = _engine_hint(error)
            return f"expected {error.expected}, got {_shown_with_type(error.value)}{hint}"
        return str(error)
    if "storage_options" in err.get("loc", ()):  # may hold credentials: never echoed
        got = f"{kind_name(err.get('input'))} (its value is not shown)"
    else:
        got = _shown_with_type(err.get("input"))
    if kind in _EXPECTED:
        return f"{_EXPECTED[kind]}, got {got}{_yaml_hint(kind, err.get('input'))}"
    what = err["msg"]
    for prefix, instead in (("Input should", "must"), ("String should", "must")):
        if what.startswith(prefix):
            what = instead + what[len(prefix) :]
    return f"{what}, got {got}"


def _error_key(err: ErrorDetails) -> str:
    """The dotted key of an error; a settings group's error names its key inside the group
    (engine.speculative.max_tokens, not engine.speculative)."""
    key = dotted_key(err["loc"])
    error = err.get("ctx", {}).get("error")
    if isinstance(error, EngineSettingError) and error.key.startswith(f"{err['loc'][-1]}."):
        key += error.key[len(str(err["loc"][-1])) :]
    return key


def _format_errors(exc: ValidationError, where: str, given: Sequence[str] = ()) -> str:
    """``<where>: invalid job spec:`` then one ``  <key>: <what>`` line per error (bounded),
    ending ``(set on the command line)`` for a key in ``given`` or below one."""
    errors = exc.errors(include_url=False)
    lines = [f"{where}: invalid job spec:"]
    for err in errors[:MAX_ERROR_LINES]:
        key = _error_key(err)
        origin = " (set on the command line)" if _is_within(key, given) else ""
        lines.append(f"  {key}: {_describe(err)}{origin}")
    if len(errors) > MAX_ERROR_LINES:
        lines.append(f"  ... and {len(errors) - MAX_ERROR_LINES} more")
    return "\n".join(lines)


def _is_within(key: str, given: Sequence[str]) -> bool:
    """Whether ``key`` is one of the dotted keys ``given`` or lies below one."""
    return any(key == g or key.startswith((f"{g}.", f"{g}[")) for g in given if g)


def coerce_spec(spec: JobSpec | str | os.PathLike | dict[str, Any]) -> JobSpec:
    """A JobSpec from a JobSpec, a path to a job.yaml, or a dict of sections."""
    if isinstance(spec, JobSpec):
        return spec
    if isinstance(spec, dict):
        return JobSpec.from_dict(spec)
    return JobSpec.load(spec)
