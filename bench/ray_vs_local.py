"""One Ray replica against the local executor on the same job (issue 16, item 2).

Goal: a job run with ``executor: ray, replicas: 1`` generates at >= 0.95x the rows/s and
tok/s of the same job with ``executor: local``, and its replica's engine never drains
between chunks. Per step, the rows the engine held: fewer than ``max_num_seqs`` is a batch
below full; ``max_num_seqs`` or fewer is no row queued behind the batch (an executor tops
its engine up to ``2 * max_num_seqs``), so the batch would shrink as rows finish. Both must
happen at the job's tail only, as for the local engine (a replica fed one chunk at a time
held no queued row at any step, and idled between chunks).

Both legs are the same job.yaml through ``tokenmill.run_job`` (reading, templating, engine,
writing, commits), one after the other, each on a fresh output. Rates are over the report's
``generation_seconds``: model load (the local engine's, the Ray replica's whole start) is not
in it. Per-step batches come from each engine's ``on_step`` (rows the engine held at that
step): the local engine through a wrapper around the executor the runner builds, the
replica through the step histogram its chunks carry (RayExecutor.step_batches).

The engine's batch must matter for the comparison to mean anything: the default is the tiny
random Llama of the tests on the CPU (its steps cost about the same at 1 row as at 16, so
a drained batch shows at once) with 16 rows per batch; ``--model smollm2-135m-instruct``
runs the embedded model instead. Both engines use ``--threads`` torch threads (a CPU
replica's Ray worker gets one: the local leg is pinned to the same).

    PYTHONPATH=. .venv/bin/python bench/ray_vs_local.py [--rows 2000] [--max-num-seqs 16]
        [--max-tokens 32] [--model tiny] [--repeat 1] [--json out.json]

Prints one JSON line per leg (rows/s, tok/s, steps, steps below a full batch) and one with
the ratios: each local/ray pair's (run back to back, which leg goes first alternating; on a
machine shared with other work the spread between pairs is the noise), their median, which
the goal is judged on, and best leg against best leg; and whether the goal holds; exit
status 1 when it does not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: Ray's CPU workers get one

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402
import torch  # noqa: E402

from bench.prompts import chat_prompts  # noqa: E402
from tokenmill import run_job  # noqa: E402
from tokenmill.jobs import runner  # noqa: E402
from tokenmill.jobs.step_batches import StepBatches  # noqa: E402

GOAL = 0.95  # Ray's rows/s and tok/s, as a fraction of local's


def write_input(folder: Path, rows: int) -> Path:
    path = folder / "in.jsonl"
    with path.open("w") as f:
        for i, messages in enumerate(chat_prompts(rows)):
            # each prompt its own (the runner runs a repeated prompt once): the same work
            messages[-1]["content"] = f"Question {i}. {messages[-1]['content']}"
            f.write(json.dumps({"id": f"r{i:05d}", "messages": messages}) + "\n")
    return path


def job(model: str, src: Path, out: Path, args: argparse.Namespace, ray_leg: bool) -> dict:
    execution = {"executor": "ray", "replicas": 1, "ray_address": None} if ray_leg else {}
    return {
        "name": "ray-vs-local",
        "model": {"source": model},
        "input": {"path": str(src), "messages_column": "messages", "prompt_column": None},
        "sampling": {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True},
        "output": {"path": str(out), "format": "jsonl", "rows_per_shard": 500},
        "engine": {"device": "cpu", "max_num_seqs": args.max_num_seqs},
        "execution": execution,
    }


class _Batches:
    """Wraps runner._make_executor: records the rows each step held, for either executor."""

    def __init__(self) -> None:
        self.batches = StepBatches()
        self._make = runner._make_executor

    def __enter__(self) -> _Batches:
        runner._make_executor = self._made
        return self

    def __exit__(self, *exc: object) -> None:
        runner._make_executor = self._make

    def _made(self, *args: Any, **kwargs: Any) -> Any:
        executor = self._make(*args, **kwargs)
        if hasattr(executor, "step_batches"):  # Ray: the replicas count their own steps
            close = executor.close

            def close_after_reading() -> None:
                self.batches = executor.step_batches
                close()

            executor.close = close_after_reading
            return executor
        process = executor.process

        def counted(rows: Any, cancel: Any = None, on_step: Any = None) -> Any:
            def step() -> None:
                self.batches.add(executor.live().rows_in_flight)
                if on_step is not None:
                    on_step()

            return process(rows, cancel, step)

        executor.process = counted
        return executor


def run_leg(name: str, spec: dict, max_num_seqs: int) -> dict[str, Any]:
    with _Batches() as counted:
        report = run_job(spec, show_progress=False)
    if report.status != "complete" or report.rows_failed:
        raise SystemExit(f"{name}: the job did not complete cleanly: {report.to_json()}")
    seconds = report.generation_seconds
    batches = counted.batches
    return {
        "leg": name,
        "rows": report.rows_ok,
        "completion_tokens": report.completion_tokens,
        "generation_s": round(seconds, 2),
        "load_s": round(report.model_load_seconds, 2),
        "rows_per_s": round(report.rows_ok / seconds, 2),
        "tok_per_s": round(report.completion_tokens / seconds, 1),
        "steps": batches.steps,
        "mean_rows_per_step": round(batches.mean, 2),
        "steps_below_full_batch": batches.steps_below(max_num_seqs),
        "steps_with_no_row_queued": batches.steps_below(max_num_seqs + 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", default="tiny", help="tiny, or a model.source")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1, help="legs run this often, alternating")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # Ray's workers inherit it

    with tempfile.TemporaryDirectory(prefix="ray-vs-local-") as tmp:
        folder = Path(tmp)
        model = args.model
        if model == "tiny":
            from tests.tiny_models import save_tiny_model

            model = str(save_tiny_model("llama", folder / "tiny", max_position_embeddings=1024))
        src = write_input(folder, args.rows)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        legs: dict[str, list[dict[str, Any]]] = {"local": [], "ray": []}
        try:
            for i in range(args.repeat):
                # alternate which leg goes first, so a drift in the machine's speed
                # falls on both alike
                for name in ("local", "ray") if i % 2 == 0 else ("ray", "local"):
                    out = folder / f"{name}-{i}"
                    spec = job(model, src, out, args, ray_leg=name == "ray")
                    leg = run_leg(name, spec, args.max_num_seqs)
                    legs[name].append(leg)
                    print(json.dumps(leg), flush=True)
        finally:
            ray.shutdown()

    best = {name: max(runs, key=lambda r: r["tok_per_s"]) for name, runs in legs.items()}
    by_pair = sorted(
        ray_leg["tok_per_s"] / local_leg["tok_per_s"]
        for local_leg, ray_leg in zip(legs["local"], legs["ray"], strict=True)
    )
    # Both legs run the same rows and tokens: rows/s and tok/s ratios are the same number.
    # The goal is judged on the median pair (each pair back to back), which one lucky or
    # unlucky leg on a machine shared with other work cannot move; best against best too.
    median = statistics.median(by_pair)
    summary = {
        "ratio_tok_per_s_median_pair": round(median, 3),
        "ratio_tok_per_s_best": round(best["ray"]["tok_per_s"] / best["local"]["tok_per_s"], 3),
        "ratio_tok_per_s_by_pair": [round(x, 3) for x in by_pair],
        "goal": GOAL,
        "goal_met": median >= GOAL,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(json.dumps(summary), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"legs": legs, "summary": summary}, indent=1))
    sys.exit(0 if summary["goal_met"] else 1)


if __name__ == "__main__":
    main()
