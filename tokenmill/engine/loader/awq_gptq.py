"""GPTQ and AWQ int4 layers repacked, on the CPU at load, into the W4A16 layer's q4 rows
(models/int4.py, kernels/w4a16_gemm.py), so the kernel that runs GGUF Q4 blocks runs them.

Both store, for a linear layer of K inputs and N outputs, 4-bit codes q, and per group of G
inputs a zero z (4 bits) and a scale s (fp16): w[n, k] = (q[n, k] - z[n, k/G]) * s[n, k/G].
They pack eight 4-bit values into each int32 word, lowest nibble first, but not along the same
axis (ShiftRight(word, 4j) & 0xF is nibble j):

    GPTQ  qweight [K/8, N]   word [r, n], nibble j  ->  q[n, 8r + j]          (along inputs)
          qzeros  [K/G, N/8] word [g, c], nibble j  ->  z[8c + j, g] - 1      (v1; v2: no -1)
          scales  [K/G, N]   g_idx [K]: the group of each input (k // G, or act-order)
    AWQ   qweight [K, N/8]   word [k, c], nibble j  ->  q[8c + ORDER[j], k]   (along outputs)
          qzeros  [K/G, N/8] word [g, c], nibble j  ->  z[8c + ORDER[j], g]
          scales  [K/G, N]   ORDER = [0, 2, 4, 6, 1, 3, 5, 7]: outputs 0..7 sit in nibbles
                             0, 4, 1, 5, 2, 6, 3, 7 of their word

GPTQ v1 (AutoGPTQ) writes z - 1 and its readers add 1 back without wrapping: a stored 15 (a
zero of 0 that its packer wrapped) reads as 16, as in AutoGPTQ's dequantization. Repacked:

    qweight [N, K/2] uint8   q in the q4-rows byte order (two inputs a byte, in chunks of 32)
    scales  [N, K/G] fp16    s
    mins    [N, K/G] fp16    -z * s, rounded once to fp16   ->   w = q * s + mins

Act-order GPTQ (desc_act true) quantizes the inputs in another order, so a group's G inputs
are scattered: g_idx[k] is input k's group. Repacking sorts the inputs by group (a stable
sort: perm = argsort(g_idx)), so that the q4 rows' groups are contiguous again, and yields
``<layer>.perm`` [K] int32 beside them; the layer multiplies x[:, perm] by those rows
(models/int4.py), which is x times the checkpoint's weight:

    g_idx  [1 0 1 0]  (G = 2)   ->   perm [1 3 0 2]   rows' inputs: 1 3 | 0 2   groups: 0 | 1

Tensors arrive one at a time in any order (a layer may straddle two shard files): a layer's
qweight, qzeros and scales are held until all three came, then repacked and yielded as
``<layer>.qweight``, ``<layer>.scales``, ``<layer>.mins``; the model's loaders put each part of a
merged layer (q/k/v, gate/up) in its rows and shard them like any weight. With desc_act false
a g_idx must be k // G and is checked on its own; with desc_act true it is the layer's fourth
part. Everything else (embeddings, norms, biases, the LM head) passes through as it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from tokenmill.engine.loader.checkpoint_quant import SUPPORTED, Int4Checkpoint

__all__ = ["AWQ_ORDER", "act_order_perm", "awq_q4_rows", "gptq_q4_rows", "repack_int4_layers"]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an AWQ word holds output 8c + AWQ_ORDER[j]
_NIBBLE_OF_OUTPUT = tuple(AWQ_ORDER.index(m) for m in range(8))  # (0, 4, 1, 5, 2, 6, 3, 7)
_PACKED = ("qweight", "qzeros", "scales")
_CHUNK = 32  # inputs per q4-rows chunk: 16 bytes, two nibbles each (K is whole groups of 32k)


def gptq_q4_rows(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    zero_offset: int,
    perm: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight, scales, mins) in q4 rows of a GPTQ layer's int32 ``qweight`` [K/8, N],
    ``qzeros`` [K/G, N/8] and ``scales`` [K/G, N]; ``zero_offset`` is added to each stored zero
    (1 for checkpoint_format gptq, 0 for gptq_v2). ``perm`` (act-order, ``act_order_perm``):
    the rows' inputs in that order. Shapes are the caller's to check."""
    k8, n = qweight.shape
    codes = _nibbles(qweight).permute(0, 2, 1).reshape(k8 * 8, n)  # [K, N]
    if perm is not None:
        codes = codes[perm.long()]
    zeros = _nibbles(qzeros).reshape(qzeros.shape[0], n)  # [K/G, N]
    return _q4_rows(codes.t(), zeros.t().to(torch.int32) + zero_offset, scales.t())


def act_order_perm(name: str, g_idx: torch.Tensor, file: Path, k: int, group: int) -> torch.Tensor:
    """The inputs of an act-order layer sorted by group (int32 [K]), after checking that its
    ``g_idx`` (tensor ``name`` in ``file``) gives each of the K / ``group`` groups ``group``
    inputs. Raises ValueError naming the tensor."""
    if g_idx.dim() != 1 or g_idx.numel() != k or g_idx.is_floating_point():
        raise ValueError(
            f"tensor {name} in {file} is {g_idx.dtype} {list(g_idx.shape)}; a g_idx holds one "
            f"integer group index per input ({k})"
        )
    g = g_idx.to(torch.int64)
    groups = k // group
    if int(g.min()) < 0 or int(g.max()) >= groups:
        raise ValueError(
            f"tensor {name} in {file} holds group indices {int(g.min())}..{int(g.max())}; a "
            f"{k}-input layer with group_size {group} has groups 0..{groups - 1}"
        )
    counts = torch.bincount(g, minlength=groups)
    wrong = (counts != group).nonzero()
    if len(wrong):
        bad = int(wrong[0])
        raise ValueError(
            f"tensor {name} in {file} puts {int(counts[bad])} inputs in group {bad}; each of "
            f"the {groups} groups must hold group_size ({group}) inputs"
        )
    return torch.argsort(g, stable=True).to(torch.int32)


def awq_q4_rows(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight, scales, mins) in q4 rows of an AWQ GEMM layer's int32 ``qweight`` [K, N/8],
    ``qzeros`` [K/G, N/8] and ``scales`` [K/G, N]. Shapes are the caller's to check."""
    order = list(_NIBBLE_OF_OUTPUT)
    codes = _nibbles(qweight)[:, :, order].reshape(qweight.shape[0], -1)  # [K, N]
    zeros = _nibbles(qzeros)[:, :, order].reshape(qzeros.shape[0], -1)  # [K/G, N]
    return _q4_rows(codes.t(), zeros.t().to(torch.int32), scales.t())


def repack_int4_layers(
    tensors: Iterable[tuple[str, torch.Tensor, Path]],
    ckpt: Int4Checkpoint,
    shapes: dict[str, tuple[int, ...]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for a GPTQ / AWQ checkpoint's ``(name, tensor, file)``:
    each linear layer as q4 rows (see the module docstring), every other tensor as it is.

    ``shapes`` (hf_layout.expected_shapes) gives each layer's ``.weight`` shape [N, K]. Raises
    ValueError naming the tensor and its file for a dtype or shape that is not the format's, a
    g_idx out of input order without desc_act (or with groups of the wrong size with it), a
    float weight among the int4 layers, or a layer missing a part.
    """
    pending: dict[str, dict[str, tuple[torch.Tensor, Path]]] = {}
    needed = (*_PACKED, "g_idx") if ckpt.desc_act else _PACKED
    for name, tensor, file in tensors:
        layer, _, leaf = name.rpartition(".")
        if leaf == "g_idx" and not ckpt.desc_act:
            _check_g_idx(name, tensor, file, ckpt.group_size)
        elif leaf in needed:
            parts = pending.setdefault(layer, {})
            parts[leaf] = (tensor, file)
            if len(parts) == len(needed):
                del pending[layer]
                yield from _repack(layer, parts, ckpt, shapes)
        elif leaf == "weight" and layer.endswith("_proj"):
            raise ValueError(
                f"tensor {name} in {file} is a float weight, but config.json says the linear "
                f"layers are {ckpt.format} int4 (qweight, qzeros, scales); checkpoints with "
                f"some layers left unquantized are not supported; supported are {SUPPORTED}"
            )
        else:
            yield name, tensor
    for layer, parts in pending.items():
        missing = [f"{layer}.{leaf}" for leaf in needed if leaf not in parts]
        file = next(iter(parts.values()))[1]
        if missing == [f"{layer}.g_idx"]:
            raise ValueError(
                f"config.json says desc_act true, but layer {layer} ({file}) has no g_idx: "
                "the group of each of its inputs (act-order) is unknown; the checkpoint is "
                "incomplete, or its config is wrong"
            )
        raise ValueError(
            f"{file} holds {layer}'s {', '.join(parts)} but no checkpoint file holds "
            f"{', '.join(missing)}; the checkpoint is incomplete: re-download it"
        )


def _repack(
    layer: str,
    parts: dict[str, tuple[torch.Tensor, Path]],
    ckpt: Int4Checkpoint,
    shapes: dict[str, tuple[int, ...]],
) -> Iterator[tuple[str, torch.Tensor]]:
    (qweight, qw_file), (qzeros, qz_file), (scales, s_file) = (parts[k] for k in _PACKED)
    perm = None
    for leaf, t, file in (("qweight", qweight, qw_file), ("qzeros", qzeros, qz_file)):
        if t.dtype != torch.int32 or t.dim() != 2:
            raise ValueError(
                f"tensor {layer}.{leaf} in {file} is {t.dtype} {list(t.shape)}; "
                f"{ckpt.format} packs 4-bit values in 2-D int32 words"
            )
    if scales.dim() != 2:
        raise ValueError(
            f"tensor {layer}.scales in {s_file} has shape {list(scales.shape)}; {ckpt.format} "
            "keeps a 2-D [groups, outputs] table of scales"
        )
    scales = _fp16_scales(f"{layer}.scales", scales, s_file)
    g = ckpt.group_size
    expected = shapes.get(f"{layer}.weight")
    if expected is not None:  # the layer the model config gives, [outputs, inputs]
        n, k = expected
    else:
        n = scales.shape[1]
        k = qweight.shape[0] * 8 if ckpt.format != "awq" else qweight.shape[0]
    want = {
        "qweight": [k // 8, n] if ckpt.format != "awq" else [k, n // 8],
        "qzeros": [k // g, n // 8],
        "scales": [k // g, n],
    }
    for leaf, t, file in (("qweight", qweight, qw_file), ("qzeros", qzeros, qz_file),
                          ("scales", scales, s_file)):  # fmt: skip
        if list(t.shape) != want[leaf] or k % g or n % 8:
            raise ValueError(
                f"tensor {layer}.{leaf} in {file} has shape {list(t.shape)}, expected "
                f"{want[leaf]} for {ckpt.format} with group_size {g} (config.json) and a "
                f"{k}-input, {n}-output layer (GPTQ and AWQ pack qweight along different "
                f"axes: a config naming the other format shows this way); supported are "
                f"{SUPPORTED}"
            )
    if "g_idx" in parts:
        g_idx, g_file = parts["g_idx"]
        perm = act_order_perm(f"{layer}.g_idx", g_idx, g_file, k, g)
    if ckpt.format == "awq":
        rows = awq_q4_rows(qweight, qzeros, scales)
    else:
        rows = gptq_q4_rows(qweight, qzeros, scales, ckpt.zero_offset, perm)
    for leaf, t in zip(("qweight", "scales", "mins"), rows, strict=True):
        yield f"{layer}.{leaf}", t
    if perm is not None:
        yield f"{layer}.perm", perm


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 ``words`` [R, C] -> their eight 4-bit values [R, C, 8] uint8, lowest first."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)


def _q4_rows(
    codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes [N, K] (0..15), zeros [N, K/G] int, scales [N, K/G] fp16 -> q4 rows."""
    n, k = codes.shape
    chunks = codes.reshape(n, k // _CHUNK, _CHUNK)  # byte i of a chunk: inputs i and i + 16
    qweight = (chunks[:, :, :16] | (chunks[:, :, 16:] << 4)).reshape(n, k // 2)
    mins = (-zeros.float() * scales.float()).half()  # exact in fp32, one rounding to fp16
    return qweight.contiguous(), scales.contiguous(), mins.contiguous()


def _fp16_scales(name: str, scales: torch.Tensor, file: Path) -> torch.Tensor:
    """``scales`` as fp16, the W4A16 layer's; other float dtypes only where fp16 holds them
    exactly."""
    if scales.dtype == torch.float16:
        return scales
    half = scales.half() if scales.is_floating_point() else None
    if half is None or not torch.equal(half.to(scales.dtype), scales):
        raise ValueError(
            f"tensor {name} in {file} is {scales.dtype} with values fp16 cannot hold; the "
            "W4A16 layer keeps its scales in fp16 (GPTQ and AWQ store them so)"
        )
    return half


def _check_g_idx(name: str, g_idx: torch.Tensor, file: Path, group: int) -> None:
    """Raise ValueError unless ``g_idx`` puts input k in group k // ``group``."""
    trivial = torch.arange(g_idx.numel(), dtype=torch.int64) // group
    if g_idx.dim() != 1 or not torch.equal(g_idx.to(torch.int64), trivial):
        raise ValueError(
            f"tensor {name} in {file} puts the inputs in groups out of order (act-order), "
            "but config.json says desc_act false, which needs g_idx[k] = k // group_size "
            f"({group}): the config and the weights disagree; if the model was quantized "
            "with act-order, set desc_act true in its quantization_config"
        )
