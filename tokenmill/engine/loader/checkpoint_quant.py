"""What a safetensors checkpoint's ``quantization_config`` says about its weights, and
whether the engine runs them as they are.

    none   no quantization_config: float weights (bf16, fp16, fp32)
    fp8    {"quant_method": "fp8"}: e4m3 ``weight`` tensors with a ``weight_scale`` per
           tensor or per output channel (and an ``input_scale`` under the static activation
           scheme, unused: activations are scaled per token on the fly, models/fp8.py)

Anything else (GPTQ, AWQ, block-wise FP8, compressed-tensors, bitsandbytes, ...) is refused at
load, naming the file, the format found and the formats supported: never dequantized
silently, never run wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["SUPPORTED", "checkpoint_quantization"]

SUPPORTED = (
    "float safetensors (bf16, fp16, fp32), FP8 safetensors (quant_method fp8, a weight_scale "
    "per tensor or per output channel), and GGUF files"
)


def checkpoint_quantization(cfg: dict[str, Any], config_path: Path) -> str:
    """``none`` or ``fp8``; raises ValueError for a quantization the engine does not run."""
    qc = cfg.get("quantization_config")
    if not qc:
        return "none"
    method = str(qc.get("quant_method", "unknown")) if isinstance(qc, dict) else "unknown"
    if method == "fp8" and isinstance(qc, dict):
        if not qc.get("weight_block_size"):
            return "fp8"
        method = f"fp8 with weight_block_size {qc['weight_block_size']} (block-wise scales)"
    raise ValueError(
        f"config key 'quantization_config' in {config_path} says the weights are "
        f"{method}-quantized; supported are {SUPPORTED}"
    )
