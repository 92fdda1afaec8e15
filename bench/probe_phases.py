"""What a drafted step spends, phase by phase, beside the plain steps of its run.

On an H100 (SmolLM2, open chat / random text, 256 rows, BENCHMARKS sessions 42-53) the
policy's drafting probes took 11-38 ms a step call where a plain one took ~2.75, and a
drafted step at 128+ rows cost ~15 ms more than one at 64. This bench runs ``LLM.chat`` with
``speculative.method`` auto (after a warm-up, as bench/speculative.py does) and times, in
every ``LLMEngine.step`` call, by wrapping the engine's methods in this process:

    switch_in   processing the step in flight before a synchronous drafted step
                (``LLMEngine._process`` called before the step's own schedule)
    schedule    ``Scheduler.schedule`` (``propose``: the proposer's call inside it)
    launch      ``ModelRunner.launch`` (host preparation and enqueueing)
    process     ``LLMEngine._process`` of the step itself or of the one before (async);
                ``wait``: its block on the device's tokens, inside it
    masks       (``--structured``) the grammars' masks of the step, inside ``launch``:
                ``StructuredOutputs.bitmask``, with what runs beside the fill (the step in
                flight processed, the next scheduled) and the wait for the workers' fill

Per running-batch bucket it prints one JSON line a kind of call: ``plain`` (async calls
that ran no draft and followed none), ``drafted`` (synchronous drafted calls) and ``after``
(the call right after a drafted one: the switch back), each with its count and the median
and mean ms of every phase; plus the slowest drafted calls' phases whole. Off runs beside it
on the same prompts for the plain steps' reference. ``--method`` names another method than
auto (suffix drafts every step it can); ``--structured`` constrains every row by the records
workload's JSON schema (bench/speculative.py's structured job).

    PYTHONPATH=$PWD python3 bench/probe_phases.py --workload open_chat --batch 256 --rounds 16
    PYTHONPATH=$PWD python3 bench/probe_phases.py --workload records --batch 64 --rounds 4 \
        --method suffix --structured
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.spec_workloads import RECORD_SCHEMA, WORKLOADS  # noqa: E402
from bench.speculative import close_llm  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.engine.launched_step import LaunchedStep  # noqa: E402
from tokenmill.engine.spec_decode.policy import SpeculationPolicy  # noqa: E402

PHASES = ("call", "switch_in", "schedule", "propose", "launch", "masks", "process", "wait")


class PhaseClock:
    """Wall ms of each phase of each ``step`` call (see the top), one record a call."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.records: list[dict] = []
        self._now: dict[str, float] | None = None
        self._scheduled = False  # the call's own schedule has begun
        scheduler = engine.scheduler
        self._originals = {
            (engine, "step"): engine.step,
            (engine, "_process"): engine._process,
            (scheduler, "schedule"): scheduler.schedule,
            (engine.runner, "launch"): engine.runner.launch,
        }
        if scheduler.proposer is not None:
            # (not ``predict``: the suffix proposer's ``propose`` calls it)
            self._originals[(scheduler.proposer, "propose")] = scheduler.proposer.propose
        if hasattr(engine, "_grammars"):
            self._originals[(engine._grammars, "bitmask")] = engine._grammars.bitmask
        if engine.runner.graphs is not None:  # whether each step replays a CUDA graph
            self._originals[(engine.runner.graphs, "kind")] = engine.runner.graphs.kind
        self._output = LaunchedStep.output
        for (owner, name), original in self._originals.items():
            setattr(owner, name, self._wrap(name, original))
        clock = self

        def output(step):
            t0 = time.perf_counter()
            try:
                return clock._output(step)
            finally:
                clock._add("wait", t0)

        LaunchedStep.output = output

    def _add(self, phase: str, t0: float) -> None:
        if self._now is not None:
            self._now[phase] = self._now.get(phase, 0.0) + (time.perf_counter() - t0) * 1e3

    def _wrap(self, name: str, original):
        phase = {"step": "call", "_process": "process", "bitmask": "masks"}.get(name, name)

        def timed(*args, **kwargs):
            if name == "step":
                return self._call(original)
            if name == "schedule":
                self._scheduled = True
            phase_now = "switch_in" if phase == "process" and not self._scheduled else phase
            t0 = time.perf_counter()
            try:
                out = original(*args, **kwargs)
            finally:
                self._add(phase_now, t0)
            if self._now is not None and name == "schedule":
                self._now["mixed"] = not out.decode_only
            if self._now is not None and name == "kind":
                self._now["graph"] = out is not None
            return out

        return timed

    def _call(self, step):
        engine = self.engine
        stats = engine.scheduler.stats
        running, drafted = engine.scheduler.num_running, stats.num_drafted_rows
        sync = engine._num_sync_steps
        self._now, self._scheduled = {}, False
        t0 = time.perf_counter()
        out = step()
        self._add("call", t0)
        self.records.append(
            {
                "bucket": SpeculationPolicy.bucket_of(running),
                "drafted": stats.num_drafted_rows > drafted,
                "sync": engine._num_sync_steps > sync,
                **self._now,
            }
        )
        self._now = None
        return out

    def detach(self) -> None:
        for owner, name in self._originals:
            delattr(owner, name)  # the instance attribute set above: the class's again
        LaunchedStep.output = self._output
        self.engine = None

    def summary(self) -> list[dict]:
        """One line per (bucket, kind of call), see the top."""
        groups: dict[tuple[int, str], list[dict]] = defaultdict(list)
        after = False
        for r in self.records:
            kind = "drafted" if r["drafted"] else "after" if after else "plain"
            if r.get("mixed"):
                kind += "_mixed"
            elif not r.get("graph", True):
                kind += "_eager"
            groups[(r["bucket"], kind)].append(r)
            after = r["drafted"]
        lines = []
        for (bucket, kind), records in sorted(groups.items()):
            line: dict = {"bucket": bucket, "kind": kind, "calls": len(records)}
            for phase in PHASES:
                values = [float(r.get(phase, 0.0)) for r in records]
                line[phase] = [
                    round(statistics.median(values), 2),
                    round(statistics.fmean(values), 2),
                ]
            lines.append(line)
        return lines

    def slowest_drafted(self, n: int = 5, drafted_only: bool = True) -> list[dict]:
        """The ``n`` slowest calls' records whole (drafted ones, or of any kind)."""
        drafted = [r for r in self.records if r["drafted"] or not drafted_only]
        top = sorted(drafted, key=lambda r: r.get("call", 0.0))[-n:][::-1]
        return [{k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()} for r in top]


class GcClock:
    """The garbage collector's passes during a run (``gc.callbacks``): per generation, how
    many, their total and longest ms. A full pass over an unfrozen heap stalled runs by
    250-560 ms before the engine froze it (engine/frozen_heap.py); a stall of one step call
    (741 ms in one of session 54's runs) may be one."""

    def __init__(self) -> None:
        self.passes: dict[int, list[float]] = {}
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            ms = (time.perf_counter() - self._start) * 1e3
            self.passes.setdefault(info["generation"], []).append(ms)

    def detach(self) -> dict[int, list[float]]:
        """{generation: [passes, total ms, longest ms]}; stops listening."""
        gc.callbacks.remove(self._callback)
        return {
            g: [len(v), round(sum(v), 1), round(max(v), 1)] for g, v in sorted(self.passes.items())
        }


def _triton_kernels() -> set[str]:
    """The kernels in Triton's on-disk cache (one ``<name>.json`` each a compiled variant):
    what appears during a run was compiled in it."""
    root = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    return {str(p.relative_to(root)) for p in root.glob("*/*.json")} if root.is_dir() else set()


def run(args, method: str, convs, warm) -> dict:
    llm = LLM(
        args.model,
        device=args.device,
        max_num_seqs=args.batch,
        speculative={"method": method, "max_tokens": args.draft_tokens},
        structured_output_backend=args.backend,
    )
    llm.engine.leave_draft_masks_open = not args.fill_draft_masks
    schema = RECORD_SCHEMA if args.structured else None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, structured_output=schema)
    warm_params = SamplingParams(max_tokens=16, temperature=0.0, structured_output=schema)
    llm.chat(warm, warm_params)  # see bench/speculative.py
    kernels = _triton_kernels()
    clock = PhaseClock(llm.engine)
    collections = GcClock()
    start = time.perf_counter()
    outs = llm.chat(convs, params)
    seconds = time.perf_counter() - start
    clock.detach()
    gc_passes = collections.detach()
    compiled = sorted(Path(k).stem for k in _triton_kernels() - kernels)
    close_llm(llm)
    del llm
    tokens = sum(o.num_completion_tokens for o in outs)
    return {
        "method": method,
        "tok_per_s": round(tokens / seconds, 1),
        "seconds": round(seconds, 3),
        "tokens": [o.token_ids for o in outs],
        "phases": clock.summary(),
        "slowest_drafted": clock.slowest_drafted(),
        "slowest_calls": clock.slowest_drafted(3, drafted_only=False),
        "compiled_in_run": compiled,
        "gc_passes": gc_passes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workload", default="open_chat")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=16, help="prompts = rounds x batch")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--method", default="auto", help="the speculative method beside off")
    parser.add_argument(
        "--structured", action="store_true", help="every row constrained by RECORD_SCHEMA"
    )
    parser.add_argument(
        "--fill-draft-masks", action="store_true",
        help="fill every grammar mask after a draft (else a greedy row's are left open where "
        "they can be: grammar_drafts.py)",
    )  # fmt: skip
    parser.add_argument(
        "--backend", choices=("llguidance", "xgrammar"), default="llguidance",
        help="the grammar library of --structured (the engine's structured_output_backend)",
    )  # fmt: skip
    args = parser.parse_args()
    convs = WORKLOADS[args.workload](args.rounds * args.batch)
    warm = WORKLOADS[args.workload](args.batch, seed=1000)
    runs = [run(args, method, convs, warm) for method in ("off", args.method)]
    off, auto = runs
    for r in runs:
        head = {"workload": args.workload, "batch": args.batch, "method": r["method"]}
        first = {
            "tok_per_s": r["tok_per_s"],
            "seconds": r["seconds"],
            "compiled_in_run": r["compiled_in_run"],
            "gc_passes": r["gc_passes"],
        }
        print(json.dumps({**head, **first}))
        for line in r["phases"]:
            print(json.dumps({**head, **line}))
    print(
        json.dumps(
            {
                f"{args.method}_vs_off": round(auto["tok_per_s"] / off["tok_per_s"], 3),
                "same_tokens": auto["tokens"] == off["tokens"],
                "slowest_drafted": auto["slowest_drafted"],
                "slowest_calls": {"off": off["slowest_calls"], "auto": auto["slowest_calls"]},
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
