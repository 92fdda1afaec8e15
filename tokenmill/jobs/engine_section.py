"""The job spec's ``engine`` section, built from EngineConfig's fields.

EngineConfig (``tokenmill/engine/engine_config.py``) declares every engine setting, its
default and its rule; this section is a pydantic model made from those fields, so job.yaml
gets a new setting, a changed default or a tightened rule without its being written twice.
Values are checked by EngineConfig's own rules, strictly (YAML's ``true`` is no batch size),
and an error names ``engine.<key>``. Two job.yaml spellings are translated first:
``max_model_len: auto`` (EngineConfig's None) and old key names (``RENAMED``), which still
load with a warning naming the new key; an old and a new name of one setting together are
refused.
"""

from __future__ import annotations

import logging
from dataclasses import Field, fields
from functools import partial
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    ValidationInfo,
    create_model,
    model_validator,
)

from tokenmill.engine.engine_config import EngineConfig

log = logging.getLogger(__name__)

# EngineConfig fields that job.yaml sets elsewhere or not at all: model, dtype and
# quantization are in the model section (model.source, model.dtype, model.quantization);
# attention_backend, load_format and seed change results but are not in the job fingerprint
# (fingerprint.py), so a resumed job could mix results made under two of them; a job has no
# reader for profile_steps. (The section's settings that change results are fingerprinted:
# fingerprint.RESULT_SETTINGS.)
NOT_IN_SECTION = frozenset(
    {"model", "dtype", "quantization", "attention_backend", "load_format", "profile_steps", "seed"}
)
RENAMED = {"prefix_caching": "enable_prefix_caching"}  # old job.yaml key -> the key now
# An unknown engine.<key> that LLM(...) takes: where a job sets it, if anywhere.
ELSEWHERE = {
    "model": "model.source sets it",
    "dtype": "model.dtype sets it",
    "quantization": "model.quantization sets it",
    "attention_backend": "an LLM(...) setting only",
    "load_format": "an LLM(...) setting only",
    "profile_steps": "an LLM(...) setting only",
    "seed": "an LLM(...) setting only; rows are seeded by sampling.seed",
    "gpu_memory_utilization": "vLLM's name: engine.kv_cache_memory takes the fraction",
    "enforce_eager": "vLLM's name: engine.cuda_graphs: false",
    "tensor_parallel_size": "vLLM's name: model.tensor_parallel",
}


class _EngineSectionBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _job_yaml_spellings(cls, data: Any, info: ValidationInfo) -> Any:
        if not isinstance(data, dict):
            return data  # pydantic reports "expected a mapping"
        data = dict(data)
        for old, new in RENAMED.items():
            if old not in data:
                continue
            if new in data:
                raise ValueError(
                    f"both {old} and {new} are given; {old} is the old name of {new}, "
                    f"keep only {new}"
                )
            where = (info.context or {}).get("where", "job spec")
            log.warning("%s: engine.%s is deprecated; rename it to engine.%s", where, old, new)
            data[new] = data.pop(old)
        if data.get("max_model_len") == "auto":
            data["max_model_len"] = None
        return data


def _section_field(f: Field[Any]) -> tuple[Any, Any]:
    check = partial(f.metadata["rule"].check, f.name)
    return Annotated[Any, BeforeValidator(check)], f.default


EngineSection = create_model(
    "EngineSection",
    __base__=_EngineSectionBase,
    __module__=__name__,
    **{f.name: _section_field(f) for f in fields(EngineConfig) if f.name not in NOT_IN_SECTION},
)
EngineSection.__doc__ = "job.yaml's engine section: EngineConfig's fields a job sets."
