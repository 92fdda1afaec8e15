"""GPTQ and AWQ int4 safetensors checkpoints written from a tiny float model, for tests.

Each linear weight is quantized to 4 bits per group of inputs (asymmetric: a scale and a zero
a group, or GPTQ's symmetric variant), packed by this file's own packers in the GPTQ (v1 and
v2) and AWQ GEMM conventions, and saved with a quantization_config; a float checkpoint of the
same fake-quantized weights is written beside it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

__all__ = [
    "AWQ_NIBBLE_OUTPUTS",
    "LINEAR",
    "edit_config",
    "int32_words",
    "pack_gptq",
    "quantize_act_order",
    "quantize_int4",
    "write_int4_checkpoint",
]

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_NIBBLE_OUTPUTS = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: nibble j <- output


def quantize_int4(
    w: torch.Tensor, group: int, min_zero: int, sym: bool = False
) -> dict[str, torch.Tensor]:
    """Asymmetric 4-bit quantization of ``w`` [out, in] per ``group`` inputs, the GPTQ way
    (the range always holds 0). A few groups are made all-positive and all-negative first so
    the zeros reach their ends (``min_zero``: 1 for GPTQ v1, which cannot store a zero of 0).
    ``sym``: GPTQ's symmetric variant instead, every zero 8 and the range +-max|w|.

    Returns codes [out, in], zeros and fp16 scales [out, in / group], and ``w`` as the
    engine's W4A16 layer holds it: codes * scale + fp16(-zero * scale), in fp32."""
    w = w.float().clone()
    w[0, :group] = w[0, :group].abs()
    w[1, :group] = -w[1, :group].abs()
    out, k = w.shape
    wg = w.reshape(out, k // group, group)
    lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    if sym:
        lo = -torch.maximum(-lo, hi)
        hi = -lo
    scales = ((hi - lo) / 15).half()
    s = scales.float()
    zeros = torch.full_like(s, 8) if sym else torch.round(-lo / s).clamp(min_zero, 15)
    codes = (torch.round(wg / s[..., None]) + zeros[..., None]).clamp(0, 15)
    mins = (-zeros * s).half().float()
    fq = codes * s[..., None] + mins[..., None]
    return {
        "codes": codes.reshape(out, k).long(),
        "zeros": zeros.long(),
        "scales": scales,
        "fq": fq.reshape(out, k),
        "exact": ((codes - zeros[..., None]) * s[..., None]).reshape(out, k),
    }


def int32_words(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> the int32 tensors checkpoints store."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_gptq(
    q: dict[str, torch.Tensor], group: int, v2: bool, g_idx: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """GPTQ's tensors of ``q`` (codes in input order); ``g_idx`` [K] the group of each input,
    k // group unless given (act-order)."""
    codes = q["codes"].t()  # [in, out]: a word packs 8 consecutive inputs of one output
    k, n = codes.shape
    qweight = torch.zeros(k // 8, n, dtype=torch.int64)
    for j in range(8):
        qweight |= codes[j::8] << (4 * j)
    stored = q["zeros"].t() - (0 if v2 else 1)  # [groups, out]
    qzeros = torch.zeros(k // group, n // 8, dtype=torch.int64)
    for j in range(8):
        qzeros |= stored[:, j::8] << (4 * j)
    return {
        "qweight": int32_words(qweight),
        "qzeros": int32_words(qzeros),
        "scales": q["scales"].t().contiguous(),
        "g_idx": torch.arange(k, dtype=torch.int32) // group if g_idx is None else g_idx,
    }


def quantize_act_order(w: torch.Tensor, perm: torch.Tensor, group: int, min_zero: int) -> dict:
    """GPTQ's act-order: the inputs quantized in the order ``perm`` (group i holds inputs
    perm[i * group : (i + 1) * group]); ``quantize_int4``'s dict in input order, plus the
    ``g_idx`` [K] int32 that says each input's group."""
    q = quantize_int4(w[:, perm], group, min_zero)
    inv = torch.argsort(perm)  # input k sits at position inv[k] of the quantized order
    return {
        **q,
        "codes": q["codes"][:, inv],
        "fq": q["fq"][:, inv],
        "exact": q["exact"][:, inv],
        "g_idx": (inv // group).to(torch.int32),
    }


def _input_of(layer: str) -> str:
    """Layers that read one input (q/k/v, gate/up) share a key: act-order shares its order."""
    for proj, key in (("q_proj", "qkv"), ("k_proj", "qkv"), ("v_proj", "qkv"),
                      ("gate_proj", "gate_up"), ("up_proj", "gate_up")):  # fmt: skip
        if layer.endswith(proj):
            return layer.removesuffix(proj) + key
    return layer


def pack_awq(q: dict[str, torch.Tensor], group: int) -> dict[str, torch.Tensor]:
    def pack_outputs(values: torch.Tensor) -> torch.Tensor:  # [rows, out] -> [rows, out / 8]
        words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
        for col in range(words.shape[1]):
            for j, m in enumerate(AWQ_NIBBLE_OUTPUTS):
                words[:, col] |= values[:, 8 * col + m] << (4 * j)
        return int32_words(words)

    return {
        "qweight": pack_outputs(q["codes"].t()),
        "qzeros": pack_outputs(q["zeros"].t()),
        "scales": q["scales"].t().contiguous(),
    }


def write_int4_checkpoint(
    src: Path, dst: Path, fmt: str, group: int, sym: bool = False, act_order: bool = False
) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """``src`` as a ``fmt`` ("gptq", "gptq_v2", "awq") checkpoint at ``dst`` (``sym``: GPTQ's
    symmetric variant; ``act_order``: GPTQ desc_act, each input of a layer quantized in a
    random order shared by the layers that read it), and a float checkpoint of its
    fake-quantized weights beside it; returns both paths and the fake-quantized weights by HF
    name."""
    shutil.copytree(src, dst)
    float_dst = shutil.copytree(src, dst.with_name(dst.name + "-float"))
    packed, plain, fq = {}, {}, {}
    orders: dict[str, torch.Tensor] = {}
    for name, t in load_file(src / "model.safetensors").items():
        layer = name.removesuffix(".weight")
        if not layer.endswith(LINEAR):
            packed[name] = plain[name] = t
            continue
        min_zero = 1 if fmt == "gptq" else 0
        if act_order:
            key = _input_of(layer)
            if key not in orders:
                gen = torch.Generator().manual_seed(len(orders))
                orders[key] = torch.randperm(t.shape[1], generator=gen)
            q = quantize_act_order(t, orders[key], group, min_zero)
            parts = pack_gptq(q, group, v2=fmt == "gptq_v2", g_idx=q["g_idx"])
        else:
            q = quantize_int4(t, group, min_zero=min_zero, sym=sym)
            parts = pack_gptq(q, group, v2=fmt == "gptq_v2") if fmt != "awq" else pack_awq(q, group)
        packed.update({f"{layer}.{leaf}": v for leaf, v in parts.items()})
        plain[name] = fq[name] = q["fq"]
    save_file(packed, dst / "model.safetensors")
    save_file(plain, float_dst / "model.safetensors")
    if fmt == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm",
              "zero_point": True, "modules_to_not_convert": None}  # fmt: skip
    else:
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
              "sym": sym, "checkpoint_format": fmt}  # fmt: skip
    edit_config(dst, quantization_config=qc)
    return dst, float_dst, fq


def edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
