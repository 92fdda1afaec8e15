"""Where the GPU waits, step by step: structured output against the same tokens unconstrained.

The two legs of bench/structured_output.py that the issue 15 goal compares (the bounded
order schema on the extraction prompts, and the same prompts forced to the constrained
outputs' lengths), each run with CUDA events and host clocks around the parts of every
launch:

    e_in ─ forward ─► e_logits ─ mask_gap ─► e_samp ─ samp ─► e_out ─ next_gap ─► e_in (next)

``fwd``: from the launch's start to the logits (GPU ms: host preparation the GPU waited
for, then the forward pass); ``mask_gap``: the GPU idle between the logits and the sampling,
waiting for the grammar masks; ``samp``: sampling (and the masks' upload and application);
``next_gap``: idle until the next launch. Host ms per launch (``host_launch``, and
``cpu_launch``: the engine thread's CPU time in it, so the difference is waiting) and per
host phase (scheduling, the step processed, the grammar feed and fill, preparing the next
step, the worker messages; each also as ``<phase>_cpu``, the thread's CPU time in it: wall
well above CPU is a wait, for a worker, the device or the GIL) are summed over each launch.
Means per decode step and per mixed step print as one JSON line a leg; every step's record
goes to ``--json``.

The phases are timed by wrapping the engine's methods in this process (a probe, not the
engine's own profile: ``profile_steps`` is off), so a renamed method fails loudly here.

    PYTHONPATH=$PWD python3 bench/step_timeline.py --backend xgrammar --json $OUT/t.json
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.structured_output import MODEL, SCHEMAS, tokenize  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.engine.core.scheduler import Scheduler  # noqa: E402
from tokenmill.engine.grammar_processes import GrammarProcesses  # noqa: E402
from tokenmill.engine.llm_engine import LLMEngine  # noqa: E402
from tokenmill.engine.model_runner import ModelRunner, PreparedStep  # noqa: E402
from tokenmill.engine.structured_output import StructuredOutputs  # noqa: E402

# (class, method, key): host ms per launch. Scheduling happens between launches, so it is
# counted towards the launch that follows it.
PHASES = [
    (Scheduler, "schedule", "sched_ms"),
    (Scheduler, "update_from_output", "update_ms"),
    (LLMEngine, "_process", "process_ms"),
    (LLMEngine, "_feed_grammars", "feed_ms"),
    (LLMEngine, "_end_grammars", "end_grammars_ms"),
    (LLMEngine, "_token_bitmask", "token_bitmask_ms"),
    (StructuredOutputs, "bitmask", "bitmask_ms"),
    (ModelRunner, "prepare", "prepare_ms"),
    (GrammarProcesses, "send_step", "send_ms"),
    (GrammarProcesses, "finish_consume", "consume_answers_ms"),
    (GrammarProcesses, "finish_fill", "fill_answers_ms"),
]
GAPS = ("fwd", "mask_gap", "samp", "next_gap")


class _HostClock:
    """A CPU stand-in for a CUDA event (the script runs on CPU too, for a dry run)."""

    def __init__(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, later: _HostClock) -> float:
        return (later.t - self.t) * 1e3


def _event() -> Any:
    if not torch.cuda.is_available():
        return _HostClock()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class StepTimeline:
    """Records every launch of the engines made after ``install``."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.gc_pauses: list[tuple[int, float]] = []  # (generation, ms) of each collection
        self._current: dict[str, Any] = {}
        self._before_launch: Counter[str] = Counter()
        self._gc_start = 0.0

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            ms = (time.perf_counter() - self._gc_start) * 1e3
            self.gc_pauses.append((info["generation"], ms))

    def install(self) -> None:
        gc.callbacks.append(self._on_gc)
        for cls, name, key in PHASES:
            setattr(cls, name, self._timed(getattr(cls, name), key, name == "schedule"))
        ModelRunner.launch = self._launch(ModelRunner.launch)

    def watch(self, llm: LLM) -> None:
        """Events around the logits and the sampling of this engine's runner."""
        runner, current = llm.engine.runner, self

        def compute_logits(hidden: torch.Tensor, inner=runner.model.compute_logits) -> Any:
            logits = inner(hidden)
            current._current["e_logits"] = _event()
            return logits

        def sample(logits: torch.Tensor, meta: Any, inner=runner.sampler, **kw: Any) -> Any:
            current._current["e_samp"] = _event()
            return inner(logits, meta, **kw)

        runner.model.compute_logits = compute_logits
        runner.sampler = sample

    def _timed(self, method: Any, key: str, between: bool) -> Any:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0, cpu0 = time.perf_counter(), time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                ms = (time.perf_counter() - t0) * 1e3
                cpu_ms = (time.thread_time() - cpu0) * 1e3
                into = self._before_launch if between else self._current
                into[key] = into.get(key, 0.0) + ms
                into[key + "_cpu"] = into.get(key + "_cpu", 0.0) + cpu_ms

        return timed

    def _launch(self, launch: Any) -> Any:
        @functools.wraps(launch)
        def recorded(runner: ModelRunner, step: Any, *args: Any, **kwargs: Any) -> Any:
            sched = step.sched if isinstance(step, PreparedStep) else step
            self._current = dict(self._before_launch)
            self._before_launch.clear()
            self._current.update(decode=bool(sched.decode_only), rows=int(sched.num_rows))
            t0, cpu0, self._current["e_in"] = time.perf_counter(), time.thread_time(), _event()
            out = launch(runner, step, *args, **kwargs)
            self._current["e_out"] = _event()
            self._current["host_launch"] = (time.perf_counter() - t0) * 1e3
            self._current["cpu_launch"] = (time.thread_time() - cpu0) * 1e3
            self.records.append(self._current)
            return out

        return recorded

    def steps(self) -> list[dict[str, Any]]:
        """Every launch's GPU gaps and host ms (call after the device is idle)."""
        out = []
        for i, rec in enumerate(self.records):
            step = {k: v for k, v in rec.items() if not k.startswith("e_")}
            if "e_logits" in rec:
                step["fwd"] = rec["e_in"].elapsed_time(rec["e_logits"])
                if "e_samp" in rec:
                    step["mask_gap"] = rec["e_logits"].elapsed_time(rec["e_samp"])
                    step["samp"] = rec["e_samp"].elapsed_time(rec["e_out"])
            if i + 1 < len(self.records):
                step["next_gap"] = rec["e_out"].elapsed_time(self.records[i + 1]["e_in"])
            out.append(step)
        return out


def summarize(steps: list[dict[str, Any]], gc_pauses: list[tuple[int, float]]) -> dict[str, Any]:
    """Mean of every field per decode step and per mixed step; the slowest launch; the
    collector's pauses (count, total and longest ms, full collections)."""
    phases = [key for _, _, key in PHASES]
    keys = ("rows", "host_launch", "cpu_launch", *GAPS, *phases, *(k + "_cpu" for k in phases))
    summary: dict[str, Any] = {}
    for kind, decode in (("decode", True), ("mixed", False)):
        chosen = [s for s in steps if s["decode"] is decode]
        means = {"steps": len(chosen)}
        for key in keys:
            values = [s[key] for s in chosen if key in s]
            if values:
                means[key] = round(float(np.mean(values)), 3)
        summary[kind] = means
    if steps:
        slowest = max(steps, key=lambda s: s["host_launch"])
        summary["slowest"] = {
            k: round(v, 2) if isinstance(v, float) else v for k, v in slowest.items()
        }
    pauses = [ms for _, ms in gc_pauses]
    summary["gc"] = {
        "collections": len(pauses),
        "total_ms": round(sum(pauses), 1),
        "longest_ms": round(max(pauses, default=0.0), 1),
        "full": sum(1 for generation, _ in gc_pauses if generation == 2),
    }
    return summary


def run_leg(
    name: str, args: argparse.Namespace, timeline: StepTimeline, prompts, params, warm_up
) -> tuple[dict[str, Any], list[Any], list[dict[str, Any]]]:
    llm = LLM(
        args.model,
        max_num_seqs=args.max_num_seqs,
        structured_output_backend=args.backend,
        structured_output_processes=args.processes,
    )
    timeline.watch(llm)
    llm.generate(warm_up, [params[i % len(params)] for i in range(len(warm_up))])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    timeline.records.clear()
    timeline.gc_pauses.clear()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    steps = timeline.steps()
    tokens = sum(o.num_completion_tokens for o in outs)
    line = {"leg": name, "tokens": tokens, "seconds": round(seconds, 3)}
    line.update(tok_per_s=round(tokens / seconds, 1), **summarize(steps, timeline.gc_pauses))
    llm.engine.close()
    return line, outs, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--requests", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--backend", choices=("llguidance", "xgrammar"), default="llguidance")
    parser.add_argument("--processes", type=int, default=None)
    parser.add_argument("--json", type=Path, help="also write every step's record here")
    args = parser.parse_args()

    prompts = tokenize(args.model, args.requests + args.max_num_seqs)
    prompts, warm_up = prompts[: args.requests], prompts[args.requests :]
    timeline = StepTimeline()
    timeline.install()
    constrained = SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, structured_output=SCHEMAS["bounded"]
    )
    n = len(prompts)
    line, outs, steps = run_leg("structured", args, timeline, prompts, [constrained] * n, warm_up)
    print(json.dumps(line), flush=True)
    results = {"structured": {"summary": line, "steps": steps}}
    matched = [
        SamplingParams(max_tokens=max(1, len(o.token_ids)), temperature=0.0, ignore_eos=True)
        for o in outs
    ]
    line, _, steps = run_leg("plain_matched", args, timeline, prompts, matched, warm_up)
    print(json.dumps(line), flush=True)
    results["plain_matched"] = {"summary": line, "steps": steps}
    if args.json:
        args.json.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
