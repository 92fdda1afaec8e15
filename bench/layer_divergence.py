"""Where the triton and torch backends' bf16 forward passes first differ (SmolLM2, GPU).

One prompt, one prefill step, CUDA graphs off. Every sub-module output of every layer (norms,
qkv/o projections, attention, MLP) is recorded for both backends and compared bit for bit:
the first row whose inputs were identical but whose output is not names the op that makes
the backends' greedy outputs drift apart. Then layer 0's own q/k/v go through each attention
implementation directly, so their mismatch rates compare on identical inputs.

    SMOLLM2_GGUF=/path/model.gguf PYTHONPATH=$PWD python3 bench/layer_divergence.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.prompts import chat_prompts  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.kernels.paged_prefill_attention import paged_prefill_attention  # noqa: E402

DEVICE = os.environ.get("DEVICE", "cuda")
_SUBMODULES = (
    "input_layernorm",
    "self_attn.qkv_proj",
    "self_attn",
    "self_attn.o_proj",
    "post_attention_layernorm",
    "mlp.gate_up_proj",
    "mlp",
)


def record(backend: str, prompt: str, model: str) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    """(name, output) of every hooked module in call order, and layer 0's attention inputs."""
    llm = LLM(
        model,
        device=DEVICE,
        dtype="bfloat16",
        attention_backend=backend,
        cuda_graphs=False,
        kv_cache_memory=2 << 30,
    )
    runner = llm.engine.runner
    seen: list[tuple[str, torch.Tensor]] = []
    attn_inputs: dict = {}
    hooks = []
    for i, layer in enumerate(runner.model.model.layers):
        for sub in _SUBMODULES:
            module = layer.get_submodule(sub)

            def hook(_m, _args, out, name=f"L{i}.{sub}") -> None:
                first = out[0] if isinstance(out, tuple) else out
                seen.append((name, first.detach().float().clone()))

            hooks.append(module.register_forward_hook(hook))
    inner = runner.backend.forward

    def forward(q, k, v, kv_cache, meta, scale):
        o = inner(q, k, v, kv_cache, meta, scale)
        seen.append(("attn-out", o.detach().float().clone()))
        if not attn_inputs:
            attn_inputs.update(q=q.clone(), k=k.clone(), v=v.clone(), o=o.clone(), scale=scale)
        return o

    runner.backend.forward = forward
    llm.chat([prompt], SamplingParams(max_tokens=1, temperature=0))
    for h in hooks:
        h.remove()
    del llm
    torch.cuda.empty_cache()
    return seen, attn_inputs


def mismatch(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    diff = (a - b).abs()
    return f"{(diff > 0).float().mean().item() * 100:7.3f}% differ, max {diff.max().item():.2e}"


def attention_variants(x: dict) -> dict[str, torch.Tensor]:
    """Layer 0's prefill attention through each implementation, on the same bf16 q/k/v."""
    q, k, v, scale = x["q"], x["k"], x["v"], x["scale"]
    t, hq, d = q.shape
    hkv = k.shape[1]
    qh, kh, vh = (y.transpose(0, 1).unsqueeze(0) for y in (q, k, v))  # [1, H, T, d]

    def sdpa(a, b, c):
        o = F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1).to(q.dtype).float()

    block = 16
    nblocks = -(-t // block)
    cache = torch.zeros(2, nblocks, block, hkv, d, dtype=q.dtype, device=q.device)
    cache.view(2, -1, hkv, d)[0, :t] = k
    cache.view(2, -1, hkv, d)[1, :t] = v
    bt = torch.arange(nblocks, dtype=torch.int32, device=q.device)[None]
    qsl = torch.tensor([0, t], dtype=torch.int32, device=q.device)
    seq = torch.tensor([t], dtype=torch.int32, device=q.device)
    return {
        "sdpa-bf16": sdpa(qh, kh, vh),
        "sdpa-fp32": sdpa(qh.float(), kh.float(), vh.float()),
        "triton": paged_prefill_attention(q, cache[0], cache[1], bt, qsl, seq, t, scale).float(),
    }


def main() -> None:
    model = os.environ.get("SMOLLM2_GGUF", "smollm2-135m-instruct")
    prompt = chat_prompts(1, seed=3)[0]
    (a, attn), (b, attn_b) = (record(name, prompt, model) for name in ("torch", "triton"))
    print("layer 0, torch vs triton backend, element by element:")
    for key in ("q", "k", "v", "o"):
        print(f"  attention {key:<24} {mismatch(attn[key].float(), attn_b[key].float())}")
    for (name, x), (_, y) in zip(a[: len(_SUBMODULES) + 1], b, strict=False):
        print(f"  {name:<34} {mismatch(x, y)}")
    print("each layer's MLP output:")
    for (name, x), (_, y) in zip(a, b, strict=True):
        if name.endswith(".mlp"):
            print(f"  {name:<34} {mismatch(x, y)}")
    print("layer 0 attention on the torch run's q/k/v:")
    variants = {**attention_variants(attn), "engine-torch": attn["o"].float()}
    names = list(variants)
    for i, x in enumerate(names):
        for y in names[i + 1 :]:
            print(f"  {x:>12} vs {y:<12} {mismatch(variants[x], variants[y])}")


if __name__ == "__main__":
    main()
