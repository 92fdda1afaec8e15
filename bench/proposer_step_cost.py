"""What a proposer costs the engine thread in a plain decode step, tiny model, CPU.

On an H100 at 256 rows of open chat, ``auto``'s plain (undrafted) decode steps took 2.5-7%
more host time than ``off``'s (BENCHMARKS session 44), with 1-3 drafted steps in ~385: a
cost of having a proposer at all. This runs an ``LLMEngine`` on a random tiny Llama
(tests/tiny_models.py) on CPU with async scheduling and ``max_num_seqs`` 256, under
``speculative`` ``off`` and ``auto`` in alternating runs (a fresh engine each), every run
the same ``--rows`` prompts of random ids (``--prompt`` tokens at most) and output lengths
(``--min-tokens`` .. ``--max-tokens``, ``ignore_eos``): rows finish and are admitted every
few steps, and every finished output goes to auto's suffix proposer, as in a job. ``auto``'s
policy is asked every step as it would be, but its answer is held to plain (``--free``: as
it comes), so both legs run the same plain steps.

Per decode step (steps that schedule no prompt token) it reports the step call's wall time
less the model's forward, logits and sampling (the CPU's stand-in for the GPU's work; the
rest is the engine thread's host time), medians over each leg's runs, and wall-clock
wrappers' time per step of the functions only ``auto`` calls (``--cprofile``: the engine
functions whose time differs most between the legs).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python bench/proposer_step_cost.py --runs 4
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.request_host_cost import Clocks  # noqa: E402
from tokenmill import SamplingParams  # noqa: E402
from tokenmill.engine.engine_config import EngineConfig  # noqa: E402
from tokenmill.engine.frozen_heap import frozen_heap  # noqa: E402
from tokenmill.engine.llm_engine import LLMEngine  # noqa: E402

# Called only where a proposer exists (the policy's, the proposer's and the scheduler's).
AUTO_ONLY = {
    "engine": ("_wants_drafts",),
    "policy": ("wants_drafts", "record"),
    "proposer": ("observe",),
    "scheduler": ("can_draft", "slowest_yield"),
}
# The CPU's stand-in for the device's work: not the engine thread's host time.
MODEL = ("forward", "compute_logits")


def workload(rows: int, prompt: int, min_tokens: int, max_tokens: int, vocab: int, seed: int):
    """[(prompt ids, max_tokens)] of ``rows`` requests, the same for every run."""
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(3, vocab) for _ in range(rng.randint(prompt // 4, prompt))],
            rng.randint(min_tokens, max_tokens),
        )
        for _ in range(rows)
    ]


def run(model: Path, method: str, requests, batch: int, free: bool, profile: bool) -> dict:
    """One run of ``requests`` under ``method``: per decode step us, AUTO_ONLY's us per
    step, and ({function: cumulative s} with ``profile``)."""
    engine = LLMEngine(
        EngineConfig(
            model=str(model),
            device="cpu",
            async_scheduling=True,
            max_num_seqs=batch,
            speculative={"method": method},
        )
    )
    clocks = Clocks()
    owners = {
        "engine": engine,
        "policy": engine.policy,
        "proposer": engine._learner,
        "scheduler": engine.scheduler,
    }
    for owner, names in AUTO_ONLY.items():
        for name in names if owners[owner] is not None else ():
            clocks.wrap(owners[owner], name)
    if engine.policy is not None and not free:
        asked = engine.policy.wants_drafts
        engine.policy.wants_drafts = lambda *a: asked(*a) and False  # asked, held to plain
    for name in MODEL:
        clocks.wrap(engine.runner.model, name)
    clocks.wrap(engine.runner, "sampler")
    scheduled: list = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda *a, **k: scheduled.append(schedule(*a, **k)) or scheduled[-1]

    def model_s() -> float:
        return sum(clocks.seconds[n] for n in (*MODEL, "sampler"))

    def go(tag: str, reqs) -> list[tuple[float, bool]]:
        """(host s, decode-only) of each step call."""
        for i, (prompt, n) in enumerate(reqs):
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            engine.add_request(f"{tag}-{i}", prompt, params)
        steps = []
        while engine.has_unfinished():
            scheduled.clear()
            before = model_s()
            t0 = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - t0
            decode = all(s.decode_only or s.is_empty for s in scheduled)
            steps.append((wall - (model_s() - before), decode and bool(scheduled)))
        return steps

    profiler = cProfile.Profile()
    with frozen_heap():  # as LLM runs it: no full collection lands in a step
        go("warm", requests[:batch])
        clocks.clear()
        if profile:
            profiler.enable()
        steps = go("run", requests)
        profiler.disable()
    decode = [s for s, d in steps if d]
    n = len(decode)
    result = {
        "method": method,
        "steps": len(steps),
        "decode_steps": n,
        "drafted_steps": engine.scheduler.stats.num_propose_calls,
        "decode_host_us": round(statistics.median(decode) * 1e6, 1),
        "decode_host_mean_us": round(sum(decode) / n * 1e6, 1),
        "model_us_per_step": round(model_s() / len(steps) * 1e6, 1),
        "auto_only_us_per_step": {
            name: round(clocks.seconds[name] / len(steps) * 1e6, 2)
            for names in AUTO_ONLY.values()
            for name in names
            if clocks.calls[name]
        },
    }
    if profile:
        stats = pstats.Stats(profiler).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
        result["cumulative_s"] = {
            f"{file.rsplit('/', 2)[-1]}:{name}": ct
            for (file, _, name), (_, _, _, ct, _) in stats.items()
            if "tokenmill" in file
        }
    engine.close()
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4, help="runs of each leg, alternated")
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=96, help="longest prompt (tokens)")
    parser.add_argument("--min-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--free", action="store_true", help="auto drafts as its policy says")
    parser.add_argument("--cprofile", action="store_true", help="profile each run's functions")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        from tests.tiny_models import save_tiny_model, tiny_config

        model = save_tiny_model("llama", Path(tmp) / "tiny-llama", max_position_embeddings=1024)
        vocab = tiny_config("llama").vocab_size
        requests = workload(
            args.rows, args.prompt, args.min_tokens, args.max_tokens, vocab, args.seed
        )
        results: dict[str, list[dict]] = {"off": [], "auto": []}
        for i in range(args.runs):
            order = ("off", "auto") if i % 2 == 0 else ("auto", "off")  # neither always first
            for method in order:
                r = run(model, method, requests, args.batch, args.free, args.cprofile)
                results[method].append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "cumulative_s"}), flush=True)
    summary = {
        m: {
            "decode_host_us": [r["decode_host_us"] for r in rs],
            "median": statistics.median(r["decode_host_us"] for r in rs),
        }
        for m, rs in results.items()
    }
    summary["auto_over_off"] = round(summary["auto"]["median"] / summary["off"]["median"], 3)
    print(json.dumps(summary))
    if args.cprofile:
        totals = {
            m: {
                n: sum(r["cumulative_s"].get(n, 0.0) for r in rs) / len(rs)
                for n in rs[0]["cumulative_s"]
            }
            for m, rs in results.items()
        }
        names = totals["off"].keys() | totals["auto"].keys()
        diff = {n: totals["auto"].get(n, 0.0) - totals["off"].get(n, 0.0) for n in names}
        top = sorted(diff, key=lambda n: -abs(diff[n]))[:20]
        print(json.dumps({"auto_minus_off_s": {n: round(diff[n], 4) for n in top}}))


if __name__ == "__main__":
    main()
