"""JobSpec: the job.yaml schema, validated at the boundary.

Every key but ``model.source``, ``input.path`` and ``output.path`` has a default. Unknown keys
are errors that name the key and the file. ``--set key.path=value`` overrides are applied to
the raw YAML before validation, so they are checked the same way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# Output columns a passthrough column may not shadow.
RESERVED_OUTPUT_COLUMNS = {
    "id",
    "text",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "error",
}


class JobSpecError(ValueError):
    """The spec is invalid; the message names the file and the key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    source: str
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: Literal["none"] = "none"
    tensor_parallel: int = Field(1, ge=1, le=1)  # >1 lands with tensor parallelism
    pipeline_parallel: int = Field(1, ge=1, le=1)  # >1 lands with pipeline parallelism


class InputSection(_Section):
    path: str
    format: Literal["auto", "jsonl", "parquet", "openai-batch"] = "auto"
    id_column: str | None = "id"
    prompt_column: str | None = "prompt"
    messages_column: str | None = None
    passthrough_columns: tuple[str, ...] = ()
    storage_options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("passthrough_columns")
    @classmethod
    def _no_clash(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        clash = sorted(set(value) & RESERVED_OUTPUT_COLUMNS)
        if clash:
            raise ValueError(f"{', '.join(clash)} would overwrite output columns; rename them")
        return value


class SamplingSection(_Section):
    max_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    seed: int | None = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class OutputSection(_Section):
    path: str
    format: Literal["parquet", "jsonl", "openai-batch"] = "parquet"
    rows_per_shard: int = Field(1000, ge=1)
    storage_options: dict[str, Any] = Field(default_factory=dict)


class EngineSection(_Section):
    device: str = "auto"
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=16)
    max_model_len: int | Literal["auto"] = "auto"
    block_size: int = Field(16, ge=1)
    prefix_caching: bool = True
    cuda_graphs: bool = True
    async_scheduling: bool | None = None  # None: on with CUDA
    kv_cache_memory: int | float | None = None


class ExecutionSection(_Section):
    executor: Literal["local", "ray"] = "local"
    replicas: int = Field(1, ge=1)
    ray_address: str | None = None


class JobSpec(_Section):
    name: str = Field("job", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    model: ModelSection
    input: InputSection
    sampling: SamplingSection = SamplingSection()
    output: OutputSection
    engine: EngineSection = EngineSection()
    execution: ExecutionSection = ExecutionSection()

    @classmethod
    def load(cls, path: str | os.PathLike, overrides: list[str] | None = None) -> JobSpec:
        """Read a job.yaml, apply ``key.path=value`` overrides, validate.

        Relative ``input.path``/``output.path`` resolve against the current directory (as a
        cron job or a shell would see them). Raises JobSpecError naming the file and key.
        """
        path = Path(path)
        try:
            raw = yaml.safe_load(path.read_text())
        except FileNotFoundError:
            raise JobSpecError(f"{path}: no such job file") from None
        except yaml.YAMLError as exc:
            raise JobSpecError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(raw, dict):
            raise JobSpecError(f"{path}: expected a mapping of sections (name, model, input, ...)")
        for item in overrides or []:
            apply_override(raw, item, str(path))
        return cls.from_dict(raw, str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "<dict>") -> JobSpec:
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise JobSpecError(_format_errors(exc, where)) from None

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def apply_override(raw: dict[str, Any], item: str, where: str) -> None:
    """Set ``a.b.c=value`` in ``raw``; the value is parsed as YAML (numbers, bools, lists)."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise JobSpecError(f"--set {item!r}: expected key.path=value")
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise JobSpecError(f"{where}: --set {key}: {part} is not a section")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(value)
    except yaml.YAMLError:
        node[parts[-1]] = value


def _format_errors(exc: ValidationError, where: str) -> str:
    lines = [f"{where}: invalid job spec:"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        if err["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
        elif err["type"] == "missing":
            lines.append(f"  {key}: required key is missing")
        else:
            lines.append(f"  {key}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)


def coerce_spec(spec: JobSpec | str | os.PathLike | dict[str, Any]) -> JobSpec:
    """A JobSpec from a JobSpec, a path to a job.yaml, or a dict of sections."""
    if isinstance(spec, JobSpec):
        return spec
    if isinstance(spec, dict):
        return JobSpec.from_dict(spec)
    return JobSpec.load(spec)
