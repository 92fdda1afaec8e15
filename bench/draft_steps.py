"""Multi-token steps at full acceptance: what drafts can buy, eager and in CUDA graphs.

The ceiling of draft-token speculation on this engine, before any real proposer: a first
run without drafts records every request's greedy output; an oracle proposer then drafts the
true next k tokens, so every draft is accepted and each decode step appends 1 + k tokens.
Three legs on the same prompts (chat prompts, EOS ignored, greedy), each on its own engine:

    plain      no drafts (decode steps in CUDA graphs where the device has them)
    drafts     the oracle's k drafts, decode steps in CUDA graphs captured for 1 + k tokens
    eager      the same drafts with CUDA graphs off (what drafted steps cost before graphs
               covered them)

Each leg prints tok/s, decode steps, and mean host / GPU ms per decode step, and the drafted
legs check that their tokens equal the plain leg's. A real proposer's gain is this ceiling
scaled by its acceptance, less its own host cost.

    PYTHONPATH=. python bench/draft_steps.py --device cuda --requests 2048 --max-num-seqs 256
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.prompts import chat_prompts  # noqa: E402
from tokenmill import SamplingParams  # noqa: E402
from tokenmill.engine.core.batch_slots import BatchSlots  # noqa: E402
from tokenmill.engine.engine_config import EngineConfig  # noqa: E402
from tokenmill.engine.llm_engine import LLMEngine  # noqa: E402
from tokenmill.engine.prompts import encode_chat  # noqa: E402


class OracleProposer:
    """Drafts the true next ``max_drafts`` tokens of each request's recorded output.

    ``outputs`` [N, max_tokens] holds request ``r{i}``'s tokens in row i; the request's
    index is read from its id once per slot, the rest is numpy over the rows."""

    def __init__(self, outputs: np.ndarray, max_drafts: int) -> None:
        self.outputs = outputs
        self.max_drafts = max_drafts

    def propose(self, slots: BatchSlots, rows: np.ndarray) -> np.ndarray:
        index = np.fromiter(
            (int(slots.requests[s].request_id[1:]) for s in rows.tolist()), np.int64, len(rows)
        )
        done = (slots.num_tokens[rows] - slots.num_prompt[rows]).astype(np.int64)
        cols = done[:, None] + np.arange(self.max_drafts)  # [R, k]
        inside = cols < self.outputs.shape[1]
        drafts = self.outputs[index[:, None], np.minimum(cols, self.outputs.shape[1] - 1)]
        return np.where(inside, drafts, -1)


def run_leg(
    name: str, config: EngineConfig, prompts: list[list[int]], max_tokens: int, proposer=None
) -> tuple[dict, np.ndarray]:
    engine = LLMEngine(config, proposer)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts[:4]):  # compile kernels outside the timing
        engine.add_request(f"w{i}", prompt, warm)
    while engine.has_unfinished():
        engine.step()
    engine.runner.profiler.records.clear()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    outputs = np.zeros((len(prompts), max_tokens), dtype=np.int64)
    while engine.has_unfinished():
        for out in engine.step():
            outputs[int(out.request_id[1:])] = out.token_ids
    seconds = time.perf_counter() - start
    decode = engine.step_profile().get("decode", {})
    engine.close()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    line = {
        "leg": name,
        "tok_per_s": round(outputs.size / seconds, 1),
        "seconds": round(seconds, 3),
        "decode_steps": decode.get("steps"),
        "graph_steps": decode.get("graph_steps"),
        "mean_batch": decode.get("mean_batch"),
        "mean_tokens": decode.get("mean_tokens"),
        "host_ms": decode.get("cpu_ms"),
        "gpu_ms": decode.get("gpu_ms"),
    }
    return line, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--drafts", type=int, default=3, help="k, draft tokens a step")
    args = parser.parse_args()

    def config(graphs: bool) -> EngineConfig:
        return EngineConfig(
            model=args.model,
            device=args.device,
            max_num_seqs=args.max_num_seqs,
            cuda_graphs=graphs and args.device.startswith("cuda"),
            profile_steps=True,
        )

    from tokenmill.engine.loader import resolve_model_source

    tok = resolve_model_source(args.model).load_tokenizer()
    prompts = [encode_chat(tok, c) for c in chat_prompts(args.requests)]
    plain, want = run_leg("plain", config(True), prompts, args.max_tokens)
    print(json.dumps(plain), flush=True)
    for name, graphs in (("drafts", True), ("eager", False)):
        oracle = OracleProposer(want, args.drafts)
        line, got = run_leg(name, config(graphs), prompts, args.max_tokens, oracle)
        line["drafts"] = args.drafts
        line["same_tokens"] = bool((got == want).all())
        line["vs_plain"] = round(line["tok_per_s"] / plain["tok_per_s"], 2)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
