"""Admission batching A/B: the scheduler's ``admit_batch`` on natural-EOS chat prompts.

``LLM.chat`` over ``N`` chat prompts (bench/prompts.py), greedy, ``max_tokens`` 256 by
default, with the engine's default ``admit_batch`` (max_num_seqs / 8 when CUDA graphs are on)
and with 1 (admit whenever a slot frees), alternating twice in one process; prints one JSON
line per run with tok/s and the step profile (graph-replayed decode steps vs eager mixed).

    PYTHONPATH=$PWD python3 bench/admission_batching.py 4096 512 [max_tokens]
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.prompts import chat_prompts  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402


def main() -> None:
    n, seqs = int(sys.argv[1]), int(sys.argv[2])
    max_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 256
    llm = LLM("smollm2-135m-instruct", max_num_seqs=seqs, kv_cache_memory=0.3, profile_steps=True)
    convs = chat_prompts(n)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    llm.chat(convs[:64], params)  # warm-up
    sched = llm.engine.scheduler
    default = sched.config
    for admit in (1, default.admit_batch, 1, default.admit_batch):
        sched.config = dataclasses.replace(default, admit_batch=admit)
        llm.engine.runner.profiler.records.clear()
        start = time.perf_counter()
        outs = llm.chat(convs, params)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for o in outs)
        print(
            json.dumps(
                {
                    "admit_batch": admit,
                    "tok_per_s": round(tokens / seconds, 1),
                    "tokens": tokens,
                    "seconds": round(seconds, 2),
                    "profile": llm.engine.step_profile(),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
