"""vLLM's spellings of ``LLM(...)`` arguments, so that its users' scripts run as written.

    gpu_memory_utilization=f        kv_cache_memory=f on a GPU: the share of the device's
                                    memory the engine may fill, weights included (memory other
                                    processes hold counts against it here, not in vLLM); on
                                    CPU left unused (it is the GPU's: a fraction of host
                                    memory would be far more than a CPU run needs)
    enforce_eager=True              cuda_graphs=False
    tensor_parallel_size=1,         taken (one device); more is refused, naming it
      pipeline_parallel_size=1
    trust_remote_code=False         taken; True is refused (no model's own code is run)
    tokenizer=<the model>           taken; another tokenizer is refused
    seed=None                       seed 0 (tokenmill is always seeded: runs repeat)
    disable_log_stats, swap_space,  taken and left unused: they change no result here (a
      enable_chunked_prefill=True     preempted request is recomputed, prompts are always
      or None                         chunked); enable_chunked_prefill=False is refused
    quantization=None,              the engine's default, as vLLM's None is its own (scripts
      max_num_seqs=None,              pass argparse's None through)
      max_num_batched_tokens=None,
      enable_prefix_caching=None,
      block_size=None

Any other name goes on to ``EngineConfig.from_settings``, which names what it does not know.
"""

from __future__ import annotations

import os
from typing import Any

from tokenmill.engine.engine_config import auto_device

__all__ = ["engine_settings"]

_UNUSED = ("disable_log_stats", "swap_space")
# vLLM's settings whose None (LLM's quantization, EngineArgs' others) is the engine's default
_NONE_IS_DEFAULT = (
    "quantization",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_prefix_caching",
    "block_size",
)


def engine_settings(model: str, settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with vLLM's names turned into tokenmill's (see the module docstring).
    Raises ValueError for a vLLM value tokenmill cannot honour, naming it."""
    out = dict(settings)
    if "gpu_memory_utilization" in out:
        fraction = out.pop("gpu_memory_utilization")
        if isinstance(fraction, bool) or not isinstance(fraction, int | float):
            raise ValueError(f"gpu_memory_utilization must be a number, got {fraction!r}")
        if not 0 < fraction <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {fraction!r}")
        if _on_gpu(out.get("device", "auto")):  # a float: kv_cache_memory's int is bytes
            _set(out, "kv_cache_memory", float(fraction), "gpu_memory_utilization")
    if "enforce_eager" in out:
        eager = out.pop("enforce_eager")
        if not isinstance(eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {eager!r}")
        if eager:
            _set(out, "cuda_graphs", False, "enforce_eager")
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        size = out.pop(name, None)  # (True == 1: a bool is no size)
        if size is not None and (type(size) is not int or size != 1):
            raise ValueError(f"{name} must be 1: an engine runs on one device here, got {size!r}")
    if out.pop("trust_remote_code", False):
        raise ValueError(
            "trust_remote_code=True is refused: tokenmill runs only the model families it "
            "implements and never a checkpoint's own code"
        )
    tokenizer = out.pop("tokenizer", None)
    if tokenizer is not None and not _same_place(tokenizer, model):
        raise ValueError(
            f"tokenizer={tokenizer!r}: the engine uses the model's own tokenizer ({model!r})"
        )
    if "seed" in out and out["seed"] is None:
        out["seed"] = 0
    chunked = out.pop("enable_chunked_prefill", None)
    if chunked is not None and chunked is not True:  # 0 or "false" meant False too
        raise ValueError(
            f"enable_chunked_prefill={chunked!r} is not supported: prompts are chunked "
            "(True or None)"
        )
    for name in _UNUSED:
        out.pop(name, None)
    for name in _NONE_IS_DEFAULT:
        if name in out and out[name] is None:
            del out[name]
    return out


def _same_place(tokenizer: Any, model: str) -> bool:
    """Whether ``tokenizer`` names the model itself (its alias, or its path however spelled)."""
    if str(tokenizer) == str(model):
        return True
    return os.path.exists(model) and os.path.realpath(tokenizer) == os.path.realpath(model)


def _on_gpu(device: Any) -> bool:
    return str(auto_device() if device == "auto" else device).startswith("cuda")


def _set(out: dict[str, Any], name: str, value: Any, vllm_name: str) -> None:
    if name in out and out[name] != value:
        raise ValueError(f"{vllm_name} and {name} both given: they are one setting, keep one")
    out[name] = value
