"""A job's tail with and without length ordering (issue 16, item 1: the dataset planner).

Goal: on a dataset whose output lengths vary widely, ``planner.order: length`` makes the
tail (from 95% of the rows done to 100%) at most half of ``order: input``'s, with the whole
generation no longer.

The dataset: OpenAI Batch chat lines, ``--rows`` of them; ``--long-share`` ask for
``--long`` tokens, the rest for 4 to 16, at random places in the file (seeded); EOS is
ignored, so every row makes exactly its max_tokens. Each system is one ``run_job`` of the
same file on the same model (greedy), one after the other:

  input     planner.order: input (rows reach the engine in file order)
  length    planner.order: length, planner.window: --window (default: the planner's)
  length-w  planner.order: length, planner.window: --small-window (a window much smaller
            than the job: the bound at work)

Times: each result's arrival is stamped (wall clock and engine steps so far) by wrapping
the runner's shard tracker and ``LLMEngine.step``, in this process. Engine steps are the
measure that does not depend on the machine's load (a decode step on a GPU costs about the
same whatever its batch); seconds are given too. One JSON line per system, then one with
the ratios and whether the goal holds (judged on steps); ``--json`` writes them to a file.

    PYTHONPATH=. python bench/planner_tail.py                     # tiny random model, CPU
    PYTHONPATH=. python bench/planner_tail.py --model smollm2-135m-instruct --device cuda \\
        --rows 20000 --max-num-seqs 256 --long 1024
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tokenmill import run_job  # noqa: E402
from tokenmill.engine.llm_engine import LLMEngine  # noqa: E402
from tokenmill.jobs import runner  # noqa: E402
from tokenmill.jobs.shard_tracker import ShardTracker  # noqa: E402

GOAL_TAIL = 0.5  # length order's tail at most half of input order's
GOAL_TOTAL = 1.0  # and its whole generation no longer (in engine steps)


class _Clock:
    """Engine steps so far, and each result's (seconds, steps) when it reached the tracker."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.arrivals: list[tuple[float, int]] = []


def _instrument(clock: _Clock) -> None:
    """Count engine steps and stamp results into ``clock``: wraps LLMEngine.step and the
    runner's shard tracker (once; ``clock.reset`` between runs)."""
    step = LLMEngine.step

    def counting_step(self: LLMEngine) -> Any:
        clock.steps += 1
        return step(self)

    class StampingTracker(ShardTracker):
        def add_result(self, result: Any) -> None:
            clock.arrivals.append((time.monotonic(), clock.steps))
            super().add_result(result)

    LLMEngine.step = counting_step  # type: ignore[method-assign]
    runner.ShardTracker = StampingTracker  # type: ignore[misc]


def write_batch(path: Path, rows: int, long_share: float, long: int, seed: int) -> list[int]:
    """The dataset (see the module docstring); returns each row's max_tokens."""
    rng = random.Random(seed)
    n_long = round(rows * long_share)
    lengths = [long] * n_long + [rng.randint(4, 16) for _ in range(rows - n_long)]
    rng.shuffle(lengths)
    with path.open("w") as f:
        for i, max_tokens in enumerate(lengths):
            body = {
                "messages": [{"role": "user", "content": f"Tell me about item {i}."}],
                "max_tokens": max_tokens,
            }
            line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions"}
            f.write(json.dumps(line | {"body": body}) + "\n")
    return lengths


def _tail(arrivals: list[tuple[float, int]], start: float) -> dict[str, float]:
    """Seconds and steps from the 95%-th result to the last, and to the last from the start."""
    n = len(arrivals)
    at95 = arrivals[math.ceil(0.95 * n) - 1]
    last = arrivals[-1]
    return {
        "tail_s": round(last[0] - at95[0], 3),
        "tail_steps": last[1] - at95[1],
        "total_s": round(last[0] - start, 3),
        "total_steps": last[1],
    }


def run_system(
    name: str,
    planner: dict[str, Any],
    args: argparse.Namespace,
    src: Path,
    work: Path,
    clock: _Clock,
) -> dict[str, Any]:
    clock.reset()
    spec = {
        "name": f"tail-{name}",
        "model": {"source": str(args.model)},
        "input": {"path": str(src), "format": "openai-batch"},
        "sampling": {"temperature": 0.0, "ignore_eos": True},
        "output": {"path": str(work / name), "format": "openai-batch", "rows_per_shard": 500},
        "engine": {"device": args.device, "max_num_seqs": args.max_num_seqs},
        "planner": planner,
    }
    if args.device == "cpu":
        spec["engine"]["kv_cache_memory"] = 256 << 20
    report = run_job(spec, show_progress=False)
    if report.status != "complete" or report.rows_ok != args.rows:
        raise SystemExit(f"{name}: {report.status}, {report.rows_ok} of {args.rows} rows ok")
    # generation starts after the model load and ends at the last result (wall_seconds runs
    # on to the reports: it says nothing of where generation began)
    generation_start = clock.arrivals[-1][0] - report.generation_seconds
    generation_start = min(generation_start, clock.arrivals[0][0])
    return {"system": name, "planner": planner, **_tail(clock.arrivals, generation_start)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model source (default: a tiny random Llama)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=600)
    parser.add_argument("--long-share", type=float, default=0.05)
    parser.add_argument("--long", type=int, default=160, help="max_tokens of the long rows")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--small-window", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the lines to this file")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="planner-tail-") as tmp:
        work = Path(tmp)
        if args.model is None:
            from tests.tiny_models import save_tiny_model

            args.model = save_tiny_model("llama", work / "tiny", max_position_embeddings=1024)
        src = work / "batch.jsonl"
        write_batch(src, args.rows, args.long_share, args.long, args.seed)
        length = {"order": "length"} | ({"window": args.window} if args.window else {})
        systems = {
            "input": {"order": "input", "dedup": False},
            "length": length | {"dedup": False},
            "length-w": {"order": "length", "window": args.small_window, "dedup": False},
        }
        clock = _Clock()
        _instrument(clock)
        lines = [run_system(name, p, args, src, work, clock) for name, p in systems.items()]
    by = {line["system"]: line for line in lines}
    tail_ratio = by["length"]["tail_steps"] / max(1, by["input"]["tail_steps"])
    total_ratio = by["length"]["total_steps"] / max(1, by["input"]["total_steps"])
    summary = {
        "tail_ratio_steps": round(tail_ratio, 3),
        "tail_ratio_s": round(by["length"]["tail_s"] / max(1e-9, by["input"]["tail_s"]), 3),
        "total_ratio_steps": round(total_ratio, 3),
        "total_ratio_s": round(by["length"]["total_s"] / max(1e-9, by["input"]["total_s"]), 3),
        "small_window_tail_ratio_steps": round(
            by["length-w"]["tail_steps"] / max(1, by["input"]["tail_steps"]), 3
        ),
        "goal_met": tail_ratio <= GOAL_TAIL and total_ratio <= GOAL_TOTAL,
    }
    lines.append(summary)
    text = "\n".join(json.dumps(line) for line in lines)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if summary["goal_met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
