"""What quantization costs in quality (issue 14): perplexity on a fixed text and greedy
agreement with the unquantized model, for each variant of one model, through the engine.

Per variant, one JSON line:

  perplexity     exp(-mean logprob) of every token of bench/data/eval_text.txt but the first
                 of each window, scored by the engine's own prompt logprobs
                 (``SamplingParams(prompt_logprobs=0)``): the text is cut at its sections
                 (lines ``=====``) and each section into windows of ``--window`` tokens
  ppl_vs_base    perplexity / the base variant's (the first one; bf16 by default)
  same_rows      of ``--prompts`` chat prompts, answered greedily for ``--new-tokens`` tokens
                 (EOS ignored), the share whose tokens equal the base variant's exactly
  agree_prefix   the mean share of those tokens before a row's first difference from the base
  agree_tokens   the share of positions with the base's token (positions after a difference
                 compare continuations of different texts, so this reads high)
  seconds        the variant's load, scoring and generation time on this device

Variants (``--variants``, comma-separated; the first is the base):

  fp32           the model's weights in fp32 (for a GGUF file: its blocks dequantized)
  bf16           the same in bf16
  fp8            FP8 W8A8 linear layers (``quantization: fp8``: e4m3 weights quantized at load
                 with a scale per output channel, activations per token), bf16 elsewhere
  fp8-kv         fp8 and an FP8 KV cache (``kv_cache_dtype: fp8``)
  int4           a GGUF file's Q4_0 / Q4_1 blocks run as they are (``quantization: int4``)
  int8           a Q8_0 copy of the GGUF file (bench/gguf_requantize.py: each linear weight
                 dequantized and quantized again), its blocks run as they are
                 (``quantization: int8``)

The embedded model ships as Q4_1 GGUF, so its bf16 is those blocks dequantized: int4 holds
the same weights, and differs from bf16 only where bf16 rounds a dequantized weight and in
the order of the sums.

    python3 bench/quant_quality.py [--device cpu|cuda] [--variants bf16,fp8,fp8-kv,int4]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gguf_requantize import requantize  # noqa: E402
from bench.prompts import chat_prompts  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402

EVAL_TEXT = Path(__file__).resolve().parent / "data" / "eval_text.txt"
SECTION_MARK = "====="

VARIANTS: dict[str, dict[str, Any]] = {  # name -> engine settings
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "fp8": {"dtype": "bfloat16", "quantization": "fp8"},
    "fp8-kv": {"dtype": "bfloat16", "quantization": "fp8", "kv_cache_dtype": "fp8"},
    "int4": {"dtype": "bfloat16", "quantization": "int4"},
    "int8": {"dtype": "bfloat16", "quantization": "int8"},
}
REQUANTIZED = {"int8": "Q8_0"}  # variants that run a copy of the model in another block type


@dataclass(frozen=True)
class Scores:
    nll: float  # summed negative logprob of the scored tokens
    tokens: int  # tokens scored

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)


def sections(path: Path) -> list[str]:
    """The evaluation text's sections (split at lines holding only ``=====``)."""
    text = path.read_text(encoding="utf-8")
    parts, current = [], []
    for line in text.splitlines():
        if line.strip() == SECTION_MARK:
            parts.append("\n".join(current).strip())
            current = []
        else:
            current.append(line)
    parts.append("\n".join(current).strip())
    return [p for p in parts if p]


def windows(llm: LLM, texts: list[str], size: int) -> list[list[int]]:
    """Each text tokenized (with the model's BOS, if it has one) and cut into windows of at
    most ``size`` tokens; a window's first token is scored by nothing, so a short tail
    window (under 16 tokens) joins the window before it instead."""
    tokenizer = llm.tokenizer
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    out = []
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        cuts = list(range(0, len(ids), size))
        if len(cuts) > 1 and len(ids) - cuts[-1] < 16:
            cuts.pop()
        for i, start in enumerate(cuts):
            end = cuts[i + 1] if i + 1 < len(cuts) else len(ids)
            out.append((bos if start == 0 else []) + ids[start:end])
    return out


def score(llm: LLM, token_windows: list[list[int]]) -> Scores:
    """Summed negative logprob of every window's tokens after its first."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    nll, tokens = 0.0, 0
    for out in llm.generate(token_windows, params):
        if out.error:
            raise RuntimeError(f"a scoring window failed: {out.error}")
        entries = out.prompt_logprobs[1:]
        nll -= sum(e.logprob for e in entries)
        tokens += len(entries)
    return Scores(nll, tokens)


def answers(llm: LLM, prompts: list, new_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [list(o.token_ids) for o in llm.chat(prompts, params)]


def agreement(base: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    same_rows, prefix, positions, total = 0, 0, 0, 0
    for a, b in zip(base, other, strict=True):
        pairs = enumerate(zip(a, b, strict=False))
        common = next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))
        same_rows += a == b
        prefix += common
        positions += sum(x == y for x, y in zip(a, b, strict=True))
        total += len(a)
    return {
        "same_rows": round(same_rows / len(base), 4),
        "agree_prefix": round(prefix / total, 4),
        "agree_tokens": round(positions / total, 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--variants", default="bf16,fp8,fp8-kv,int4")
    ap.add_argument("--text", type=Path, default=EVAL_TEXT)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--sections", type=int, default=0, help="score only the first N (0: all)")
    args = ap.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")

    texts = sections(args.text)[: args.sections or None]
    scratch = tempfile.TemporaryDirectory(prefix="quant_quality-")
    prompts = chat_prompts(args.prompts, seed=3)
    base_ppl, base_answers, token_windows = None, None, None
    for name in names:
        started = time.perf_counter()
        model = args.model
        if name in REQUANTIZED:
            model = str(requantize(model, Path(scratch.name) / f"{name}.gguf", REQUANTIZED[name]))
        llm = LLM(
            model,
            device=args.device,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.window + 64,
            enable_prefix_caching=False,
            **VARIANTS[name],
        )
        token_windows = token_windows or windows(llm, texts, args.window)  # one tokenizer
        scores = score(llm, token_windows)
        got = answers(llm, prompts, args.new_tokens)
        llm.engine.close()
        base_ppl = base_ppl or scores.perplexity
        base_answers = base_answers or got
        line = {
            "variant": name,
            "device": args.device,
            "perplexity": round(scores.perplexity, 4),
            "ppl_vs_base": round(scores.perplexity / base_ppl, 4),
            "scored_tokens": scores.tokens,
            **agreement(base_answers, got),
            "prompts": args.prompts,
            "new_tokens": args.new_tokens,
            "seconds": round(time.perf_counter() - started, 1),
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
