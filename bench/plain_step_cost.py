"""What speculation costs a step that does not draft: a proposer beside the engine, held to
plain steps, against ``off``, the same prompts, alternating runs; prints each run's seconds
and the decode steps' host and GPU ms, and (``--cprofile``) the engine functions whose time
differs most from ``off``'s.

    python bench/plain_step_cost.py [--device cuda] [--rows 1024] [--batch 256] [--runs 2]

The variants (``--sequence``), each never drafting:
    off             no proposer
    auto            the suffix proposer and its policy, held to plain steps
    auto-unindexed  auto, the finished outputs not handed to the proposer (no indexing)
    ngram           the n-gram proposer (no output corpus, no indexing worker)

On an H100 at 256 rows the decode steps' host time looked 0.5-0.9 ms higher under ``auto``
than under ``off`` in runs where off always ran first (BENCHMARKS session 40); with the
order alternated (``--sequence off,auto,auto,off,off,auto``) auto took 6% longer on average,
inside the 25% one setting moved between runs (session 41). The profiler slows every run:
compare the variants, not any of them with a plain run.
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

VARIANTS = ("off", "auto", "auto-unindexed", "ngram")


def _engine(model: str, device: str, variant: str, batch: int) -> LLM:
    """An LLM for ``variant`` whose engine never drafts."""
    method = variant.split("-")[0]
    llm = LLM(model, device=device, max_num_seqs=batch, speculative={"method": method},
              profile_steps=True)  # fmt: skip
    engine = llm.engine
    if variant == "auto-unindexed":
        engine._learner.close()
        engine._learner = None  # finished outputs go nowhere
    if variant == "ngram":
        engine._wants_drafts = lambda: False  # (no policy: it would draft every step)
    return llm


def run(
    model: str, device: str, variant: str, convs, batch: int, natural_eos: bool, profile: bool
) -> tuple[float, dict, dict]:
    """(seconds, decode profile, {function: cumulative s}, empty without ``profile``) of one
    run."""
    llm = _engine(model, device, variant, batch)
    llm.chat(convs[:batch], SamplingParams(max_tokens=16, temperature=0.0))  # warm-up
    llm.engine.runner.profiler.records.clear()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    if profile:
        profiler.enable()
    llm.chat(convs, SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=not natural_eos))
    profiler.disable()
    seconds = time.perf_counter() - start
    decode = llm.engine.step_profile().get("decode", {})
    cumulative = {}
    if profile:
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
        "--natural-eos",
        action="store_true",
        help="rows end at EOS (up to 128 tokens), finishing and admitting rows every few "
        "steps as a job does; default: every row makes 128 tokens",
    )
    parser.add_argument(
        "--sequence",
        help=f"the runs' variants in order, of {', '.join(VARIANTS)}, e.g. off,auto,auto,off "
        "(default: off,auto --runs times): a later run in a process may be slower whatever "
        "its variant",
    )
    parser.add_argument("--cprofile", action="store_true", help="profile each run's functions")
    args = parser.parse_args()
    SpeculationPolicy.wants_drafts = lambda self, *args: False  # auto, never drafting
    convs = WORKLOADS[args.workload](args.rows)
    sequence = (args.sequence or ",".join(["off,auto"] * args.runs)).split(",")
    if "off" not in sequence or not set(sequence) <= set(VARIANTS) or len(set(sequence)) < 2:
        parser.error(f"--sequence {args.sequence!r}: give off and another of {VARIANTS}")
    totals: dict[str, dict[str, float]] = {v: {} for v in sequence}
    seconds_by: dict[str, list[float]] = {v: [] for v in sequence}
    for position, variant in enumerate(sequence):
        seconds, decode, cumulative = run(
            args.model, args.device, variant, convs, args.batch, args.natural_eos, args.cprofile
        )
        seconds_by[variant].append(seconds)
        keys = ("steps", "cpu_ms", "gpu_ms")
        print(json.dumps({"position": position, "variant": variant, "seconds": round(seconds, 3),
                          "decode": {k: decode.get(k) for k in keys}}), flush=True)  # fmt: skip
        for name, s in cumulative.items():
            share = s / sequence.count(variant)
            totals[variant][name] = totals[variant].get(name, 0.0) + share
    off = sum(seconds_by["off"]) / len(seconds_by["off"])
    print(json.dumps({v: round(sum(s) / len(s) / off, 3) for v, s in seconds_by.items()}),
          "(mean seconds / off's)")  # fmt: skip
    for variant in sorted(set(totals) - {"off"}) if args.cprofile else []:
        mine, base = totals[variant], totals["off"]
        diff = {n: mine.get(n, 0.0) - base.get(n, 0.0) for n in mine.keys() | base.keys()}
        top = sorted(diff, key=lambda n: -abs(diff[n]))[:15]
        print(json.dumps({f"{variant}_minus_off_s": {n: round(diff[n], 4) for n in top},
                          "off_s": {n: round(base.get(n, 0.0), 4) for n in top}}))  # fmt: skip


if __name__ == "__main__":
    main()
