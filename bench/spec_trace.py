"""Where a small batch's decode step goes, with and without drafts: a torch.profiler trace.

At batch 1-8 a step's GPU work is ~1 ms, and the host's Python and kernel launches can
outlast it. The engine's own step profile gives host and GPU milliseconds a step; this bench
shows what fills them. For each method it warms an engine on other prompts of the workload
(bench/spec_workloads.py), then runs the workload under torch.profiler and prints, per step
of the timed run (one ``LLMEngine.step`` call, marked with ``record_function``):

    wall_ms        the call's host time
    busy_ms        device time with a kernel or copy running (overlaps merged)
    idle_ms        device time inside the step's span with nothing running
    launches       kernel launches and copies the host enqueued (a CUDA graph replay: one)

then the host operations that cost most (self CPU time over the run, and calls a step) and
the device kernels that cost most. With ``--device cpu`` (a smoke run on a tiny model) only
the host columns mean anything.

    PYTHONPATH=$PWD python3 bench/spec_trace.py [--methods off,ngram] [--batch 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.spec_workloads import WORKLOADS  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402

STEP = "tokenmill.step"


def _merged(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) spans (us)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def trace(llm: LLM, convs, max_tokens: int) -> tuple[list[dict], profile]:
    """Run ``convs`` under the profiler with every engine step marked; per step records."""
    engine = llm.engine
    step = engine.step

    def marked_step():
        with record_function(STEP):
            return step()

    engine.step = marked_step
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available() and engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        llm.chat(convs, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    engine.step = step
    events = prof.events()
    steps = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == STEP)
    device = [
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start
    ]
    launches = sorted(
        e.time_range.start
        for e in events
        if e.name in ("cudaLaunchKernel", "cudaMemcpyAsync", "cudaGraphLaunch", "cuLaunchKernel")
    )
    records = []
    for i, (a, b) in enumerate(steps):
        # A step's device work may run past its host call: take it to the next call's start.
        stop = steps[i + 1][0] if i + 1 < len(steps) else b
        inside = [(max(s, a), min(e, stop)) for s, e in device if e > a and s < stop]
        busy = _merged(inside)
        records.append(
            {
                "wall_ms": (b - a) / 1e3,
                "busy_ms": busy / 1e3,
                "idle_ms": max(stop - a - busy, 0.0) / 1e3 if device else None,
                "launches": sum(1 for t in launches if a <= t < b),
            }
        )
    return records, prof


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workload", default="copy_edit")
    parser.add_argument("--methods", default="off,ngram")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    convs = WORKLOADS[args.workload](args.prompts)
    warm = WORKLOADS[args.workload](args.batch, seed=1000)
    for method in args.methods.split(","):
        llm = LLM(
            args.model,
            device=args.device,
            max_num_seqs=args.batch,
            speculative={"method": method, "max_tokens": args.draft_tokens},
        )
        llm.chat(warm, SamplingParams(max_tokens=16, temperature=0.0))
        records, prof = trace(llm, convs, args.max_tokens)
        llm.engine.close()
        decode = records[1:-1] or records  # without the first (prefill) and the drain
        summary = {"method": method, "batch": args.batch, "steps": len(records)}
        for key in ("wall_ms", "busy_ms", "idle_ms", "launches"):
            values = [r[key] for r in decode if r[key] is not None]
            summary[key] = round(statistics.median(values), 3) if values else None
        print(json.dumps(summary), flush=True)
        table = prof.key_averages()
        host = sorted(table, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
        for e in host:
            per_step = e.count / max(len(records), 1)
            print(f"  host {e.key[:60]:60s} {e.self_cpu_time_total / 1e3:9.2f} ms "
                  f"{per_step:6.1f}/step")  # fmt: skip
        if args.device == "cuda":
            kernels = sorted(table, key=lambda e: e.self_device_time_total, reverse=True)
            for e in kernels[: args.top]:
                print(f"  gpu  {e.key[:60]:60s} {e.self_device_time_total / 1e3:9.2f} ms "
                      f"{e.count / max(len(records), 1):6.1f}/step")  # fmt: skip


if __name__ == "__main__":
    main()
