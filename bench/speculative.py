"""Speculative decoding against none, per workload and batch size, in the same run.

For each workload of bench/spec_workloads.py and each batch size B: ``LLM.chat`` on
``--rounds`` x B prompts (greedy, natural EOS, ``max_num_seqs`` B), once with
``speculative.method`` off and once per method asked for, each on its own engine after a
warm-up on other prompts of the workload. Prints one JSON line per (workload, batch, method):
output tok/s, its ratio to off, the draft acceptance, and whether the tokens equal off's
(greedy: they must). With ``--repeat N`` off and the methods run N times, alternating (off
first in odd rounds, last in even ones: a process's later runs may be slower whatever they
run), and each line gives the medians and every run's ratio to the off run beside it.

    PYTHONPATH=. python bench/speculative.py --device cpu --workloads copy_edit --batches 1,8
    PYTHONPATH=. python bench/speculative.py --device cuda --batches 1,8,64,256
    PYTHONPATH=. python bench/speculative.py --device cuda --workloads records --structured \
        --batches 64 --methods suffix      # issue 13's structured job (>= 2x at batch 64)

With ``--structured`` every row is constrained by the records workload's JSON schema
(``SamplingParams(structured_output=RECORD_SCHEMA)``, the engine's default grammar backend
and processes), off and on alike: a structured job, where the suffix proposer drafts from
the rows finished before and the grammar masks each drafted position.

Where ``auto`` loses to off, ``--auto-never-drafts`` (its policy asked every step, its
answer always plain) and ``--no-learning`` (the suffix proposer's indexing of finished rows
off) split what having a proposer costs a plain step from what its drafted steps cost (on
an H100, random text at 256 rows, session 53: 0.934 as it is, 1.004 / 0.990 never drafting).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.spec_workloads import RECORD_SCHEMA, WORKLOADS  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.engine.core.scheduler_output import draft_summary  # noqa: E402
from tokenmill.engine.spec_decode.policy import SpeculationPolicy  # noqa: E402
from tokenmill.engine.spec_decode.suffix import SuffixProposer  # noqa: E402


def since(before: dict, after: dict) -> dict:
    """The speculative counts of what ran after ``before`` (both from ``speculative()``)."""
    count = {k: after[k] - before[k] for k in ("draft_tokens", "accepted_tokens", "drafted_rows")}
    summary = draft_summary(count["draft_tokens"], count["accepted_tokens"], count["drafted_rows"])
    return {**summary, "drafted_rows": count["drafted_rows"]}


def _proposer_host(stats, before: dict | None = None) -> dict:
    """The proposer's host time (SchedulerStats): calls that asked it for drafts, ms in
    them, and ms learning from samples and finished outputs; since ``before`` if given."""
    now = {"calls": stats.num_propose_calls, "propose_ms": 1e3 * stats.propose_seconds,
           "observe_ms": 1e3 * stats.observe_seconds}  # fmt: skip
    if before is None:
        return now
    return {k: round(v - before[k], 1) for k, v in now.items()}


def compact_profile(profile: dict) -> dict:
    """The step profile's figures that explain a run, small enough to read in a log line:
    per kind of step its count, graph replays, host and device ms; the synchronous steps;
    the policy's estimates (``auto``); the grammars' host ms (structured rows)."""
    out: dict = {"synchronous": profile.get("synchronous_steps")}
    for kind in ("decode", "prefill_or_mixed"):
        if kind in profile:
            p = profile[kind]
            keys = ("steps", "graph_steps", "mean_batch", "cpu_ms", "gpu_ms")
            out[kind] = {k: p[k] for k in keys if k in p}
    policy = profile.get("speculative", {}).get("policy")
    if policy:
        out["policy"] = policy
    if "structured_output" in profile:
        out["structured_output"] = profile["structured_output"]
    return out


class StepClock:
    """Wall ms of each ``LLMEngine.step`` call, summed by the running batch's bucket (powers
    of two) and by whether the call gave drafts, with the bucket's slowest call (a first
    compile or capture shows there); what a run spends at each batch size, to read beside
    the same run without speculation."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.step = engine.step
        self.buckets: dict[int, list[float]] = {}  # bucket: [calls, drafted, wall ms, max ms]
        self.drafted_calls: dict[int, list[float]] = {}  # bucket: each drafted call's ms
        self.policy_samples: dict[int, list[float]] = {}  # bucket: the policy's drafted ms
        self.plain_samples: dict[int, list[float]] = {}  # bucket: the policy's plain ms
        self.slowest: list[tuple[float, int, bool]] = []  # the 5 slowest calls: ms, bucket, drafted
        engine.step = self
        if engine.policy is not None:  # what the policy was told, beside what calls took
            record = self.record = engine.policy.record

            def told(sample):
                bucket = SpeculationPolicy.bucket_of(sample.batch)
                samples = self.policy_samples if sample.drafted else self.plain_samples
                samples.setdefault(bucket, []).append(sample.wall_ms)
                return record(sample)

            engine.policy.record = told

    def __call__(self):
        scheduler = self.engine.scheduler
        running, drafted = scheduler.num_running, scheduler.stats.num_drafted_rows
        start = time.perf_counter()
        out = self.step()
        wall_ms = (time.perf_counter() - start) * 1e3
        bucket = SpeculationPolicy.bucket_of(running)
        gave_drafts = scheduler.stats.num_drafted_rows > drafted
        b = self.buckets.setdefault(bucket, [0, 0, 0.0, 0.0])
        b[0] += 1
        b[1] += gave_drafts
        b[2] += wall_ms
        b[3] = max(b[3], wall_ms)
        if gave_drafts:
            self.drafted_calls.setdefault(bucket, []).append(wall_ms)
        self.slowest = sorted([*self.slowest, (round(wall_ms, 1), bucket, gave_drafts)])[-5:]
        return out

    def run_summary(self, seconds: float) -> dict:
        """The run's wall ms, the ms inside step calls and outside them, its slowest calls."""
        inside = sum(b[2] for b in self.buckets.values())
        wall = seconds * 1e3
        return {"wall_ms": round(wall, 1), "step_ms": round(inside, 1),
                "outside_ms": round(wall - inside, 1), "slowest": self.slowest[::-1]}  # fmt: skip

    def table(self) -> dict[int, list]:
        return {
            k: [c, d, round(ms, 1), round(top, 1)]
            for k, (c, d, ms, top) in sorted(self.buckets.items())
        }

    def drafted_spread(self) -> dict[str, dict[int, list]]:
        """Per bucket, [count, p10, median, mean, p90] ms of the drafted step calls, and of
        the drafted and the plain steps' times the policy recorded (decode-only steps, the
        switch apart)."""

        def spread(times: list[float]) -> list:
            q = statistics.quantiles(times, n=10) if len(times) > 1 else times * 9
            return [len(times), round(q[0], 2), round(statistics.median(times), 2),
                    round(statistics.fmean(times), 2), round(q[-1], 2)]  # fmt: skip

        return {
            "calls": {k: spread(v) for k, v in sorted(self.drafted_calls.items())},
            "policy": {k: spread(v) for k, v in sorted(self.policy_samples.items())},
            "policy_plain": {k: spread(v) for k, v in sorted(self.plain_samples.items())},
        }

    def detach(self) -> None:
        """Give the engine its own ``step`` back: the wrapper and the engine held each other,
        and the next run's engine found the GPU still full (its KV cache not freed)."""
        del self.engine.step
        if self.engine.policy is not None:
            del self.engine.policy.record
        self.engine = self.step = None


def run(
    model: str, device: str, batch: int, method: str, k: int, convs, warm, max_tokens: int,
    profile: bool = False, ahead_below: int | None = None, structured: bool = False,
    fill_draft_masks: bool = False,
):  # fmt: skip
    llm = LLM(
        model,
        device=device,
        max_num_seqs=batch,
        speculative={"method": method, "max_tokens": k},
        profile_steps=profile,
    )
    if ahead_below is not None:
        llm.engine.draft_ahead_below = ahead_below
    llm.engine.leave_draft_masks_open = not fill_draft_masks
    schema = RECORD_SCHEMA if structured else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_output=schema)
    # Warm-up on a full batch of other prompts of the workload, long enough to draft, so the
    # kernel variants and graphs the run's shapes need are built before the clock starts (a
    # 2-prompt warm-up left compiles of 100+ ms inside sub-second runs). Its outputs are
    # earlier rows to the suffix proposer and its ~16 steps the policy's first, as a job's
    # first rows would be; the run's counts below are its own.
    llm.chat(warm, SamplingParams(max_tokens=16, temperature=0.0, structured_output=schema))
    llm.engine.runner.profiler.records.clear()
    before = llm.engine.scheduler.stats.speculative()
    host_before = _proposer_host(llm.engine.scheduler.stats)
    clock = StepClock(llm.engine) if profile else None
    start = time.perf_counter()
    outs = llm.chat(convs, params)
    seconds = time.perf_counter() - start
    stats = since(before, llm.engine.scheduler.stats.speculative())
    if clock is not None:
        clock.detach()
        stats = {**stats, "step_profile": llm.engine.step_profile(), "by_bucket": clock.table(),
                 "drafted_ms": clock.drafted_spread(), "run": clock.run_summary(seconds),
                 "proposer": _proposer_host(llm.engine.scheduler.stats, host_before)}  # fmt: skip
    close_llm(llm)
    del llm
    tokens = sum(o.num_completion_tokens for o in outs)
    return tokens / seconds, [o.token_ids for o in outs], stats, tokens, seconds


def close_llm(llm: LLM) -> None:
    """Close ``llm``'s engine and give its GPU memory back before the next run's engine
    (the caller drops its own reference too)."""
    llm.engine.close()
    llm.engine = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workloads", default=",".join(w for w in WORKLOADS if w != "records"))
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--methods", default="ngram")
    parser.add_argument("--draft-tokens", type=int, default=4, help="k, speculative.max_tokens")
    parser.add_argument("--rounds", type=int, default=4, help="prompts = rounds x batch")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="step profile per run (graph and eager steps, host and GPU ms; adds events) and "
        "each run's step calls by running-batch bucket: [calls, drafted calls, wall ms, "
        "slowest call ms]",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of off and each method, alternating (off first, then last); lines report "
        "medians (short runs on the GPU move 10-30%% from one to the next)",
    )
    parser.add_argument(
        "--ahead-below",
        type=int,
        default=None,
        help="the engine's draft_ahead_below: drafted steps of fewer rows draft ahead (async)",
    )
    parser.add_argument(
        "--structured",
        action="store_true",
        help="every row constrained by the records workload's JSON schema (RECORD_SCHEMA)",
    )
    parser.add_argument(
        "--fill-draft-masks",
        action="store_true",
        help="fill every grammar mask after a draft (the engine leaves a greedy row's open "
        "where it can: grammar_drafts.py)",
    )
    parser.add_argument(
        "--auto-never-drafts",
        action="store_true",
        help="auto's policy is asked every step but never drafts: what having a proposer "
        "costs a plain step, apart from what drafted steps cost (session 53)",
    )
    parser.add_argument(
        "--no-learning",
        action="store_true",
        help="the suffix proposer learns nothing from finished rows (its indexing thread idle)",
    )
    args = parser.parse_args()
    if args.auto_never_drafts:
        SpeculationPolicy.wants_drafts = lambda self, *args: False
    if args.no_learning:
        SuffixProposer.observe = lambda self, outputs: None
    methods = args.methods.split(",")
    for workload in args.workloads.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            convs = WORKLOADS[workload](max(2, args.rounds * batch))
            warm = WORKLOADS[workload](batch, seed=1000)
            runs: dict[str, list] = {m: [] for m in ["off", *methods]}
            for i in range(args.repeat):
                # off first, then last: a process's later runs may differ whatever they run
                for method in list(runs)[:: -1 if i % 2 else 1]:
                    runs[method].append(
                        run(args.model, args.device, batch, method, args.draft_tokens, convs,
                            warm, args.max_tokens, args.profile, args.ahead_below,
                            args.structured, args.fill_draft_masks)
                    )  # fmt: skip
            for method, done in runs.items():
                line = _line(workload, batch, method, args, done, runs["off"])
                print(json.dumps(line), flush=True)


def _line(workload: str, batch: int, method: str, args, done: list, off: list) -> dict:
    """One JSON line for ``method``'s runs ``done`` against ``off``'s, run for run."""
    rates = [d[0] for d in done]
    line = {"workload": workload, "batch": batch, "method": method}
    if args.structured:
        line["structured"] = True
    for flag in ("auto_never_drafts", "no_learning"):
        if getattr(args, flag):
            line[flag] = True
    line["tok_per_s"] = round(statistics.median(rates), 1)
    if method != "off":
        ratios = [d[0] / o[0] for d, o in zip(done, off, strict=True)]
        stats = done[-1][2]
        line |= {
            "k": args.draft_tokens,
            "vs_off": round(statistics.median(ratios), 3),
            "vs_off_runs": [round(r, 3) for r in ratios],
            "acceptance_rate": stats["acceptance_rate"],
            "mean_accepted_per_drafted_row": stats["mean_accepted_per_drafted_row"],
            "same_tokens": all(d[1] == off[0][1] for d in done),
            "output_tokens": done[-1][3],
            "seconds": round(statistics.median(d[4] for d in done), 2),
        }
    if args.profile:
        line["steps"] = compact_profile(done[-1][2]["step_profile"])
        line["by_bucket"] = done[-1][2]["by_bucket"]
        line["drafted_ms"] = done[-1][2]["drafted_ms"]
        line["proposer"] = done[-1][2]["proposer"]
        line["runs"] = [d[2]["run"] for d in done]  # every run's, the slow ones included
    return line


if __name__ == "__main__":
    main()
