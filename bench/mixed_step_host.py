"""Where a step's host time goes, decode steps against mixed (admitting) ones.

``LLM.chat`` on a workload of bench/spec_workloads.py (greedy, natural EOS: rows finish and
are admitted all run long, as in a job), with the engine's methods wrapped in wall clocks
summed per ``LLMEngine.step`` call. A call is *mixed* when its launch ran the piecewise
graphs (prompt tokens in the step), *decode* when it replayed a decode graph. Per kind:
calls, mean wall ms of the call and of each phase inside it, the prompt rows and tokens
scheduled (under async scheduling a step is scheduled in the call before the one that
launches it, so read these as totals over calls), and the eager attention calls (with
their Triton kernels' launch time split out). Phases nest (``launch`` holds ``upload``,
``pieces`` ...; ``pieces`` holds ``attention``), so they do not sum to the call. Under
async scheduling a call also processes the step launched by the call before it
(``process``).

The clocks are wrappers in this process (a microsecond or two each), not the engine's own
profile; a renamed method fails loudly here.

    PYTHONPATH=$PWD python3 bench/mixed_step_host.py --batch 256 --rounds 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.spec_workloads import WORKLOADS  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.engine import host_batch  # noqa: E402


class Clocks:
    """Wall ms per phase within the current step call."""

    def __init__(self) -> None:
        self.now: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def wrap(self, owner: object, name: str, phase: str) -> None:
        """Replace ``owner.name`` (an instance's or a class's attribute) with a timed call."""
        inner = getattr(owner, name)
        clocks = self

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                clocks.now[phase] += (time.perf_counter() - start) * 1e3
                clocks.counts[phase] += 1

        setattr(owner, name, timed)

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        now, counts = dict(self.now), dict(self.counts)
        self.now.clear()
        self.counts.clear()
        return now, counts


def instrument(llm: LLM, clocks: Clocks) -> None:
    engine = llm.engine
    runner = engine.runner
    clocks.wrap(engine.scheduler, "schedule", "schedule")
    schedule = engine.scheduler.schedule

    def counted(*args, **kwargs):  # the prompt rows and tokens each schedule admits
        sched = schedule(*args, **kwargs)
        prompt = ~sched.decode
        clocks.now["prompt_rows"] += int(prompt.sum())
        clocks.now["prompt_tokens"] += int(sched.num_new[prompt].sum())
        return sched

    engine.scheduler.schedule = counted
    clocks.wrap(engine.scheduler, "_admit", "admit")
    clocks.wrap(engine.scheduler, "update_from_output", "update_from_output")
    clocks.wrap(engine, "_process", "process")
    clocks.wrap(runner, "launch", "launch")
    clocks.wrap(runner, "_upload", "upload")
    clocks.wrap(runner.backend, "build", "attn_meta")
    clocks.wrap(runner.pieces, "run", "pieces")
    clocks.wrap(runner.graphs, "run", "decode_graph")
    clocks.wrap(runner.backend, "forward", "attention")
    for kernel in ("_store_kv", "_decode", "_prefill"):
        clocks.wrap(runner.backend, kernel, "attention" + kernel)
    clocks.wrap(runner.model, "compute_logits", "logits")
    clocks.wrap(runner, "sampler", "sample")
    clocks.wrap(host_batch.HostBatch, "build", "host_batch")


def run(args: argparse.Namespace) -> dict:
    llm = LLM(args.model, max_num_seqs=args.batch, profile_steps=args.profile)
    engine = llm.engine
    if engine.runner.pieces is None or engine.runner.graphs is None:
        raise SystemExit("this bench needs CUDA graphs (a CUDA device and the Triton backend)")
    convs = WORKLOADS[args.workload](args.rounds * args.batch)
    llm.chat(WORKLOADS[args.workload](args.batch, seed=1000), SamplingParams(max_tokens=16))
    engine.reset_step_profile()
    clocks = Clocks()
    instrument(llm, clocks)
    sums: dict[str, dict[str, float]] = {"decode": defaultdict(float), "mixed": defaultdict(float)}
    calls = {"decode": 0, "mixed": 0, "other": 0}
    step = engine.step

    def timed_step():
        start = time.perf_counter()
        out = step()
        wall = (time.perf_counter() - start) * 1e3
        phases, counts = clocks.take()
        kind = "mixed" if "pieces" in phases else "decode" if "decode_graph" in phases else None
        if kind is None:
            calls["other"] += 1
            return out
        calls[kind] += 1
        s = sums[kind]
        s["call"] += wall
        for phase, ms in phases.items():
            s[phase] += ms
        s["attention_calls"] += counts.get("attention", 0)
        return out

    engine.step = timed_step
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    start = time.perf_counter()
    outs = llm.chat(convs, params)
    seconds = time.perf_counter() - start
    del engine.step
    tokens = sum(o.num_completion_tokens for o in outs)
    line: dict = {"workload": args.workload, "batch": args.batch, "rows": len(convs),
                  "tok_per_s": round(tokens / seconds, 1), "seconds": round(seconds, 3),
                  "calls": calls}  # fmt: skip
    for kind, s in sums.items():
        n = max(calls[kind], 1)
        line[kind] = {k: round(v / n, 3) for k, v in sorted(s.items())}
        line[kind]["total_ms"] = round(s["call"], 1)
    if args.profile:  # the engine's own host and GPU ms per kind of step (CUDA events)
        profile = engine.step_profile()
        keys = ("steps", "mean_batch", "cpu_ms", "gpu_ms")
        line["engine_profile"] = {
            kind: {k: profile[kind][k] for k in keys if k in profile[kind]}
            for kind in ("decode", "prefill_or_mixed")
            if kind in profile
        }
    engine.close()
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--workload", default="open_chat", choices=sorted(WORKLOADS))
    parser.add_argument("--batch", type=int, default=256, help="max_num_seqs")
    parser.add_argument("--rounds", type=int, default=8, help="prompts = rounds x batch")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also the engine's step profile (host and GPU ms per kind of step; adds events)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/mixed_step_host.py times CUDA-graph steps: it needs a GPU")
    for _ in range(args.repeat):
        print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
