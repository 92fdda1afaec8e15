"""Prefix-cache hit rate of Ray replicas under each routing policy (issue 16).

Goal: 4 replicas on Ray, a dataset of 2,000 rows over 16 distinct ~1,000-token system
prompts, shuffled: the prefix-cache hit rate with ``planner.routing: prefix`` is at least
90% of a single replica's, against the measured rate of ``routing: balance`` (the replica
with the fewest rows queued, a chunk at a time: what input-order sharding gives).

The dataset: ``--prompts`` system prompts of synthetic words, each grown until the model's
own tokenizer counts ``--prompt-tokens`` tokens (the tiny model's byte-level tokenizer: one
a byte), and ``--rows`` chat rows, each one of them plus a short user message of its own,
shuffled with ``--seed``. The same job.yaml runs three times through ``tokenmill.run_job``,
one after the other, each on a fresh output, with ``planner.order: input`` (length ordering
would group a prompt's rows, which is not the shuffled stream the goal is about):

  single   execution.replicas: 1
  balance  execution.replicas: --replicas, planner.routing: balance
  prefix   execution.replicas: --replicas, planner.routing: prefix

Each leg prints its report's ``prefix_cache_hit_rate`` (prompt tokens found in a replica's
prefix cache over prompt tokens looked up, summed over replicas), rows, and wall and
generation seconds; a last line gives balance's and prefix's hit rates over single's and
whether the goal holds (exit 1 when it does not). Every leg's rows must be identical.

The engine's KV cache is its default (2 GiB on CPU) unless ``--kv-cache-memory`` says
otherwise: a cache that holds every prompt lets each replica keep all 16, and then routing
saves only the first prefill of each prompt on each replica; a smaller one makes a replica
that sees every prompt evict them.

    PYTHONPATH=. .venv/bin/python bench/prefix_routing.py              # tiny model, CPU
    PYTHONPATH=. .venv/bin/python bench/prefix_routing.py --rows 400   # a quicker look
    PYTHONPATH=. python bench/prefix_routing.py --model smollm2-135m-instruct --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: Ray's CPU workers get one

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402

from tokenmill import run_job  # noqa: E402
from tokenmill.engine.loader import resolve_model_source  # noqa: E402

GOAL = 0.9  # prefix routing's hit rate, as a fraction of a single replica's
_SYLLABLES = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "ve", "do", "xu", "ba", "ge"]


def system_prompts(tokenizer: Any, count: int, tokens: int, seed: int) -> list[str]:
    """``count`` distinct system prompts of synthetic words, each the shortest run of words
    that ``tokenizer`` encodes to at least ``tokens`` tokens. They differ from their first
    words on, as distinct instructions do."""
    rng = random.Random(seed)
    prompts = []
    for k in range(count):
        words = [f"Instruction set {k}."]
        while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < tokens:
            # grow a sentence at a time: encoding the whole text per word would be quadratic
            sentence = ["".join(rng.choices(_SYLLABLES, k=rng.randint(1, 4))) for _ in range(12)]
            words.append(" ".join(sentence).capitalize() + ".")
        text = " ".join(words)
        while len(tokenizer.encode(text.rsplit(" ", 1)[0], add_special_tokens=False)) >= tokens:
            text = text.rsplit(" ", 1)[0]  # trim the last sentence back to the target
        prompts.append(text)
    return prompts


def write_input(path: Path, prompts: list[str], rows: int, seed: int) -> list[int]:
    """``rows`` chat rows, row i with system prompt ``i % len(prompts)``, shuffled; returns
    each line's prompt number."""
    which = [i % len(prompts) for i in range(rows)]
    order = list(range(rows))
    random.Random(seed).shuffle(order)
    with path.open("w") as f:
        for i in order:
            messages = [
                {"role": "system", "content": prompts[which[i]]},
                {"role": "user", "content": f"Request {i}: summarise rule {i % 97} in a line."},
            ]
            f.write(json.dumps({"id": f"r{i:05d}", "messages": messages}) + "\n")
    return [which[i] for i in order]


def job(model: str, src: Path, out: Path, args: argparse.Namespace, leg: str) -> dict:
    replicas = 1 if leg == "single" else args.replicas
    engine: dict[str, Any] = {"device": args.device, "max_num_seqs": args.max_num_seqs}
    if args.kv_cache_memory is not None:
        engine["kv_cache_memory"] = args.kv_cache_memory
    return {
        "name": f"prefix-routing-{leg}",
        "model": {"source": model},
        "input": {"path": str(src), "messages_column": "messages", "prompt_column": None},
        "sampling": {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True},
        "output": {"path": str(out), "format": "jsonl", "rows_per_shard": 500},
        "engine": engine,
        "execution": {"executor": "ray", "replicas": replicas, "ray_address": None},
        "planner": {"order": "input", "routing": "balance" if leg == "balance" else "prefix"},
    }


def read_rows(out: Path) -> dict[str, str]:
    rows = {}
    for path in sorted((out / "shards").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            rows[row["id"]] = row["text"]
    return rows


def run_leg(leg: str, spec: dict, rows: int) -> tuple[dict[str, Any], dict[str, str]]:
    start = time.monotonic()
    report = run_job(spec, show_progress=False)
    wall = time.monotonic() - start
    if report.status != "complete" or report.rows_ok != rows:
        raise SystemExit(f"{leg}: the job did not complete cleanly: {report.to_json()}")
    line = {
        "leg": leg,
        "replicas": spec["execution"]["replicas"],
        "routing": spec["planner"]["routing"],
        "rows": report.rows_ok,
        "prefix_cache_hit_rate": report.prefix_cache_hit_rate,
        "prompt_tokens": report.prompt_tokens,
        "wall_s": round(wall, 1),
        "generation_s": round(report.generation_seconds, 1),
        "load_s": round(report.model_load_seconds, 1),
    }
    return line, read_rows(Path(spec["output"]["path"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--model", default="tiny", help="tiny, an alias or a model.source")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=int, default=16, help="distinct system prompts")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes a replica")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the lines to this file")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="prefix-routing-") as tmp:
        folder = Path(tmp)
        model = args.model
        if model == "tiny":
            from tests.tiny_models import save_tiny_model

            context = args.prompt_tokens + 256  # the prompt, its user message and output
            model = str(save_tiny_model("llama", folder / "tiny", max_position_embeddings=context))
        tokenizer = resolve_model_source(model).load_tokenizer()
        prompts = system_prompts(tokenizer, args.prompts, args.prompt_tokens, args.seed)
        sizes = [len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts]
        src = folder / "in.jsonl"
        write_input(src, prompts, args.rows, args.seed)
        print(json.dumps({"system_prompt_tokens": [min(sizes), max(sizes)]}), flush=True)
        cpus = args.replicas if args.device == "cpu" else None
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
        lines, outputs = [], {}
        try:
            for leg in ("single", "balance", "prefix"):
                spec = job(model, src, folder / leg, args, leg)
                line, outputs[leg] = run_leg(leg, spec, args.rows)
                lines.append(line)
                print(json.dumps(line), flush=True)
        finally:
            ray.shutdown()

    rate = {line["leg"]: line["prefix_cache_hit_rate"] for line in lines}
    single = max(rate["single"], 1e-9)
    summary = {
        "rows": args.rows,
        "replicas": args.replicas,
        "balance_over_single": round(rate["balance"] / single, 3),
        "prefix_over_single": round(rate["prefix"] / single, 3),
        "same_rows": outputs["single"] == outputs["balance"] == outputs["prefix"],
        "goal": GOAL,
        "goal_met": rate["prefix"] / single >= GOAL,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    lines.append(summary)
    print(json.dumps(summary), flush=True)
    if args.json is not None:
        args.json.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return 0 if summary["goal_met"] and summary["same_rows"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
