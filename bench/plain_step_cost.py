"""What speculation costs a step that does not draft: ``auto`` with its policy held to plain
steps against ``off``, the same prompts, alternating runs, each under cProfile; prints each
run's seconds, the decode steps' host ms, and the engine functions whose time differs most.

    python bench/plain_step_cost.py [--device cuda] [--rows 1024] [--batch 256] [--runs 2]

On an H100 at 256 rows the decode steps' host time looked 0.5-0.9 ms higher under ``auto``
than under ``off`` in runs where off always ran first (BENCHMARKS session 40); with the
order alternated (``--sequence off,auto,auto,off,off,auto``) auto took 6% longer on average,
inside the 25% one setting moved between runs (session 41). The profiler slows both alike;
compare the two, not either with a plain run.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.spec_workloads import WORKLOADS  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.engine.spec_decode.policy import SpeculationPolicy  # noqa: E402


def run(model: str, device: str, method: str, convs, batch: int) -> tuple[float, dict, dict]:
    """(seconds, decode profile, {function: cumulative s}) of one run."""
    llm = LLM(model, device=device, max_num_seqs=batch, speculative={"method": method},
              profile_steps=True)  # fmt: skip
    llm.chat(convs[:batch], SamplingParams(max_tokens=16, temperature=0.0))  # warm-up
    llm.engine.runner.profiler.records.clear()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    llm.chat(convs, SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True))
    profiler.disable()
    seconds = time.perf_counter() - start
    decode = llm.engine.step_profile().get("decode", {})
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    cumulative = {
        f"{file.rsplit('/', 2)[-1]}:{name}": ct
        for (file, _, name), (_, _, _, ct, _) in stats.items()
        if "tokenmill" in file
    }
    llm.engine.close()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return seconds, decode, cumulative


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workload", default="random_text")
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument(
        "--sequence",
        help="the runs' methods in order, e.g. off,auto,auto,off (default: off,auto --runs "
        "times): a later run in a process may be slower whatever its method",
    )
    args = parser.parse_args()
    SpeculationPolicy.wants_drafts = lambda self, batch: False  # auto, never drafting
    convs = WORKLOADS[args.workload](args.rows)
    sequence = (args.sequence or ",".join(["off,auto"] * args.runs)).split(",")
    if set(sequence) != {"off", "auto"}:
        parser.error(f"--sequence {args.sequence!r}: give off and auto, each at least once")
    totals: dict[str, dict[str, float]] = {"off": {}, "auto": {}}
    for position, method in enumerate(sequence):
        seconds, decode, cumulative = run(args.model, args.device, method, convs, args.batch)
        keys = ("steps", "cpu_ms", "gpu_ms")
        print(json.dumps({"position": position, "method": method, "seconds": round(seconds, 3),
                          "decode": {k: decode.get(k) for k in keys}}), flush=True)  # fmt: skip
        for name, s in cumulative.items():
            share = s / sequence.count(method)
            totals[method][name] = totals[method].get(name, 0.0) + share
    names = totals["off"].keys() | totals["auto"].keys()
    diff = {n: totals["auto"].get(n, 0.0) - totals["off"].get(n, 0.0) for n in names}
    top = sorted(diff, key=lambda n: -abs(diff[n]))[:25]
    print(json.dumps({"auto_minus_off_s": {n: round(diff[n], 4) for n in top},
                      "off_s": {n: round(totals["off"].get(n, 0.0), 4) for n in top}}))  # fmt: skip


if __name__ == "__main__":
    main()
