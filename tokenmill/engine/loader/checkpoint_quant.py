"""What a safetensors checkpoint's ``quantization_config`` says about its weights, and
whether the engine runs them as they are.

    none   no quantization_config: float weights (bf16, fp16, fp32)
    fp8    {"quant_method": "fp8"}: e4m3 ``weight`` tensors with a ``weight_scale`` per
           tensor or per output channel (and an ``input_scale`` under the static activation
           scheme, unused: activations are scaled per token on the fly, models/fp8.py)
    gptq   {"quant_method": "gptq", "bits": 4, "group_size": 32k}: int32-packed 4-bit codes
           with a zero and a scale per group of inputs, g_idx in input order; checkpoint_format
           gptq (zeros stored minus one, most checkpoints) or gptq_v2 (zeros as they are)
    awq    {"quant_method": "awq", "bits": 4, "group_size": 32k, "version": "gemm",
           "zero_point": true}: the same numbers packed along the outputs (AutoAWQ's GEMM layout)

GPTQ and AWQ layers are repacked at load into the W4A16 layer's layout (loader/awq_gptq.py,
models/int4.py); ``ModelConfig.quantization`` then holds ``Int4Checkpoint.name``, e.g.
``gptq-g128`` (act-order GPTQ included: ``gptq-g128-desc_act``). Anything else (other bit
widths, GEMV / Marlin / ExLlama AWQ, block-wise FP8, compressed-tensors, bitsandbytes, ...)
is refused at load, naming the file, the format found and the formats supported: never
dequantized silently, never run wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "SUPPORTED",
    "Int4Checkpoint",
    "checkpoint_quantization",
    "layer_quantization",
]

SUPPORTED = (
    "float safetensors (bf16, fp16, fp32), FP8 safetensors (quant_method fp8, a weight_scale "
    "per tensor or per output channel), GPTQ int4 safetensors (quant_method gptq, bits 4, "
    "group_size a multiple of 32, checkpoint_format gptq or gptq_v2, desc_act (act-order) "
    "with tensor_parallel_size 1), "
    "AWQ int4 safetensors (quant_method awq, bits 4, version gemm, zero_point true, "
    "group_size a multiple of 32), and GGUF files"
)

_GPTQ_FORMATS = ("gptq", "gptq_v2")
_NAME = re.compile(r"(gptq|gptq_v2|awq)-g(\d+)(-desc_act)?")


@dataclass(frozen=True)
class Int4Checkpoint:
    """A GPTQ or AWQ 4-bit checkpoint the engine runs: its packing ``format`` ("gptq",
    "gptq_v2" or "awq"), ``group_size`` (inputs per scale and zero) and, for GPTQ, whether
    ``desc_act`` was set (act-order: every layer's g_idx must be present, and its inputs are
    reordered at load, loader/awq_gptq.py)."""

    format: str
    group_size: int
    desc_act: bool = False

    def __post_init__(self) -> None:
        if self.format not in (*_GPTQ_FORMATS, "awq"):
            raise ValueError(
                f"Int4Checkpoint.format must be gptq, gptq_v2 or awq, got {self.format!r}"
            )
        if self.group_size < 32 or self.group_size % 32:
            raise ValueError(
                f"Int4Checkpoint.group_size must be a multiple of 32, got {self.group_size}"
            )

    @property
    def name(self) -> str:
        """The ``ModelConfig.quantization`` string: ``gptq-g128``, ``gptq_v2-g64``, ``awq-g32``,
        ``gptq-g128-desc_act``."""
        return f"{self.format}-g{self.group_size}" + ("-desc_act" if self.desc_act else "")

    @property
    def zero_offset(self) -> int:
        """What to add to a stored zero point: GPTQ v1 checkpoints store zero - 1."""
        return 1 if self.format == "gptq" else 0

    @classmethod
    def from_name(cls, name: str) -> Int4Checkpoint | None:
        """The checkpoint ``name`` (a ``ModelConfig.quantization``) stands for, or None for
        one that is not GPTQ / AWQ."""
        m = _NAME.fullmatch(name)
        return None if m is None else cls(m[1], int(m[2]), m[3] is not None)


def checkpoint_quantization(cfg: dict[str, Any], config_path: Path) -> str:
    """``none``, ``fp8`` or an ``Int4Checkpoint.name``; raises ValueError naming
    ``config_path``, the format found and ``SUPPORTED`` for a quantization the engine does not
    run."""
    qc = cfg.get("quantization_config")
    if not qc:
        return "none"
    method = str(qc.get("quant_method", "unknown")) if isinstance(qc, dict) else "unknown"
    found = f"{method}-quantized"
    if isinstance(qc, dict):
        if method == "fp8":
            if not qc.get("weight_block_size"):
                return "fp8"
            found = f"fp8 with weight_block_size {qc['weight_block_size']} (block-wise scales)"
        elif method in ("gptq", "awq"):
            problem = _gptq_problem(qc) if method == "gptq" else _awq_problem(qc)
            problem = problem or _groups_misfit(cfg, _first(qc, "group_size", "q_group_size"))
            if problem is None:
                return _int4_checkpoint(method, qc).name
            found = f"{found} with {problem}"
    raise ValueError(
        f"config key 'quantization_config' in {config_path} says the weights are "
        f"{found}; supported are {SUPPORTED}"
    )


def layer_quantization(checkpoint: str, requested: str) -> str:
    """The linear layers' method (models/quant_methods.py) for a checkpoint stored as
    ``checkpoint`` (``ModelConfig.quantization``) when the engine was asked for ``requested``:
    a quantized checkpoint runs as it is, whatever was asked for (an FP8 one as FP8, a GPTQ /
    AWQ one as W4A16 with its group size); a float one as asked."""
    if checkpoint == "fp8":
        return "fp8_checkpoint"
    int4 = Int4Checkpoint.from_name(checkpoint)
    if int4 is not None:
        return f"int4_g{int4.group_size}" + ("_act" if int4.desc_act else "")
    return requested


def _int4_checkpoint(method: str, qc: dict[str, Any]) -> Int4Checkpoint:
    if method == "awq":
        return Int4Checkpoint("awq", int(_first(qc, "group_size", "q_group_size")))
    fmt = str(_first(qc, "checkpoint_format", "format") or "gptq").lower()
    return Int4Checkpoint(fmt, int(qc["group_size"]), bool(qc.get("desc_act")))


def _first(qc: dict[str, Any], *keys: str) -> Any:
    """The value of the first of ``keys`` that ``qc`` holds (AutoAWQ's own quant_config says
    w_bit and q_group_size where transformers says bits and group_size), else None."""
    return next((qc[k] for k in keys if qc.get(k) is not None), None)


def _group_problem(group: Any) -> str | None:
    if group is None:
        return "no group_size"
    if group == -1:
        return "group_size -1 (one group per row; the W4A16 layer needs groups of 32k inputs)"
    if not isinstance(group, int) or isinstance(group, bool) or group < 32 or group % 32:
        return f"group_size {group!r} (the W4A16 layer needs an integer multiple of 32)"
    return None


def _groups_misfit(cfg: dict[str, Any], group: int) -> str | None:
    """A group size that does not divide a layer's inputs (hidden_size for q/k/v and
    gate/up, the heads' width for o, intermediate_size for down), or None."""
    heads = cfg.get("num_attention_heads") or 1
    hidden = cfg.get("hidden_size") or 0
    inputs = {
        "hidden_size": hidden,
        "num_attention_heads x head_dim": heads * (cfg.get("head_dim") or hidden // heads),
        "intermediate_size": cfg.get("intermediate_size") or 0,
    }
    for key, size in inputs.items():
        if isinstance(size, int) and size % group:
            return f"group_size {group}, which does not divide {key} {size}"
    return None


def _gptq_problem(qc: dict[str, Any]) -> str | None:
    """What about a GPTQ config the engine does not run, or None."""
    if qc.get("bits") != 4:
        return f"bits {qc.get('bits')!r}"
    fmt = str(_first(qc, "checkpoint_format", "format") or "gptq").lower()
    if fmt not in _GPTQ_FORMATS:
        return f"checkpoint_format {fmt}"
    if qc.get("is_marlin_format"):
        return "is_marlin_format true (Marlin-repacked weights)"
    if qc.get("lm_head"):
        return "lm_head true (a quantized LM head)"
    if qc.get("dynamic"):
        return "per-module overrides in 'dynamic'"
    return _group_problem(qc.get("group_size"))


def _awq_problem(qc: dict[str, Any]) -> str | None:
    """What about an AWQ config the engine does not run, or None."""
    bits = _first(qc, "bits", "w_bit")
    if bits != 4:
        return f"bits {bits!r}"
    version = str(qc.get("version") or "gemm").lower()
    if version != "gemm":
        return f"version {version} (only the GEMM packing is read)"
    if qc.get("zero_point") is not True:
        return f"zero_point {qc.get('zero_point')}"
    backend = str(qc.get("backend") or "autoawq").lower()
    if backend != "autoawq":
        return f"backend {backend}"
    skipped = [m for m in qc.get("modules_to_not_convert") or () if m != "lm_head"]
    if skipped:
        return f"modules_to_not_convert {skipped} (float layers among int4 ones)"
    return _group_problem(_first(qc, "group_size", "q_group_size"))
