"""tokenmill: batch/offline LLM inference.

Heavy modules (torch, transformers) load on first use, so ``import tokenmill`` stays cheap
and the pure-Python parts (scheduler, job spec) import without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "EngineConfig",
    "JobSpec",
    "submit",
    "run_job",
    "StructuredOutputsParams",
    "GuidedDecodingParams",
    "TextPrompt",
    "TokensPrompt",
    "RequestOutputKind",
]
__version__ = "0.1.0"

_LAZY = {
    "LLM": "tokenmill.engine.llm",
    "SamplingParams": "tokenmill.engine.sampling_params",
    "RequestOutput": "tokenmill.engine.outputs",
    "EngineConfig": "tokenmill.engine.engine_config",
    "JobSpec": "tokenmill.jobs.spec",
    "submit": "tokenmill.jobs.submit",
    "run_job": "tokenmill.jobs.runner",
    # vLLM's names, so its scripts import them from here
    "StructuredOutputsParams": "tokenmill.engine.structured_output_params",
    "GuidedDecodingParams": "tokenmill.engine.structured_output_params",
    "TextPrompt": "tokenmill.engine.prompt_dicts",
    "TokensPrompt": "tokenmill.engine.prompt_dicts",
    "RequestOutputKind": "tokenmill.engine.vllm_sampling_fields",
}

if TYPE_CHECKING:
    from tokenmill.engine.engine_config import EngineConfig
    from tokenmill.engine.llm import LLM
    from tokenmill.engine.outputs import RequestOutput
    from tokenmill.engine.prompt_dicts import TextPrompt, TokensPrompt
    from tokenmill.engine.sampling_params import SamplingParams
    from tokenmill.engine.structured_output_params import (
        GuidedDecodingParams,
        StructuredOutputsParams,
    )
    from tokenmill.engine.vllm_sampling_fields import RequestOutputKind
    from tokenmill.jobs.runner import run_job
    from tokenmill.jobs.spec import JobSpec
    from tokenmill.jobs.submit import submit


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
