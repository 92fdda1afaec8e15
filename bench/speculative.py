"""Speculative decoding against none, per workload and batch size, in the same run.

For each workload of bench/spec_workloads.py and each batch size B: ``LLM.chat`` on
``--rounds`` x B prompts (greedy, natural EOS, ``max_num_seqs`` B), once with
``speculative.method`` off and once per method asked for, each on its own engine after a
warm-up. Prints one JSON line per (workload, batch, method): output tok/s, its ratio to off,
the draft acceptance, and whether the tokens equal off's (greedy: they must).

    PYTHONPATH=. python bench/speculative.py --device cpu --workloads copy_edit --batches 1,8
    PYTHONPATH=. python bench/speculative.py --device cuda --batches 1,8,64,256
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.spec_workloads import WORKLOADS  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402


def run(
    model: str, device: str, batch: int, method: str, k: int, convs, max_tokens: int,
    profile: bool = False,
):  # fmt: skip
    llm = LLM(
        model,
        device=device,
        max_num_seqs=batch,
        speculative={"method": method, "max_tokens": k},
        profile_steps=profile,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    llm.chat(convs[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    llm.engine.runner.profiler.records.clear()
    start = time.perf_counter()
    outs = llm.chat(convs, params)
    seconds = time.perf_counter() - start
    stats = llm.engine.scheduler.stats.speculative()
    if profile:
        stats = {**stats, "step_profile": llm.engine.step_profile()}
    llm.engine.close()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    tokens = sum(o.num_completion_tokens for o in outs)
    return tokens / seconds, [o.token_ids for o in outs], stats, tokens, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workloads", default=",".join(w for w in WORKLOADS if w != "records"))
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--methods", default="ngram")
    parser.add_argument("--draft-tokens", type=int, default=4, help="k, speculative.max_tokens")
    parser.add_argument("--rounds", type=int, default=2, help="prompts = rounds x batch")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="step profile per run (graph and eager steps, host and GPU ms; adds events)",
    )
    args = parser.parse_args()
    for workload in args.workloads.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            convs = WORKLOADS[workload](max(2, args.rounds * batch))
            base, want, off_stats, _, _ = run(
                args.model, args.device, batch, "off", args.draft_tokens, convs,
                args.max_tokens, args.profile,
            )  # fmt: skip
            line = {"workload": workload, "batch": batch, "method": "off"}
            line["tok_per_s"] = round(base, 1)
            if args.profile:
                line["step_profile"] = off_stats["step_profile"]
            print(json.dumps(line), flush=True)
            for method in args.methods.split(","):
                rate, got, stats, tokens, seconds = run(
                    args.model, args.device, batch, method, args.draft_tokens, convs,
                    args.max_tokens, args.profile,
                )  # fmt: skip
                line = {
                    "workload": workload,
                    "batch": batch,
                    "method": method,
                    "k": args.draft_tokens,
                    "tok_per_s": round(rate, 1),
                    "vs_off": round(rate / base, 3),
                    "acceptance_rate": stats["acceptance_rate"],
                    "mean_accepted_per_drafted_row": stats["mean_accepted_per_drafted_row"],
                    "same_tokens": got == want,
                    "output_tokens": tokens,
                    "seconds": round(seconds, 2),
                }
                if args.profile:
                    line["step_profile"] = stats["step_profile"]
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
