"""Peak memory of the job path over a 1,000,000-row JSONL input.

Two runs, each in its own `run-job` process whose peak RSS is read from the kernel
(getrusage of the child):
  dry-run:  SmolLM2's tokenizer reads and tokenizes every row (no weights, no output);
  full run: a tiny random Llama (tests/tiny_models.py) generates 1 token per row, so the
            reader, engine, shard tracker and writer all see every row (rows_per_shard 10000).

    .venv/bin/python bench/job_memory.py [--rows 1000000] [--skip-full]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def write_input(path: Path, rows: int) -> None:
    with path.open("w") as f:
        for i in range(rows):
            f.write(json.dumps({"id": f"row-{i}", "prompt": f"Question {i}: what is {i} plus 1?"}))
            f.write("\n")


def run(job: Path, *extra: str) -> tuple[float, float, str]:
    """(peak RSS MiB of the child, seconds, last lines of output)."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "tokenmill.jobs.cli", str(job), "--quiet", *extra],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    elapsed = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"run-job failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return peak_kib / 1024, elapsed, proc.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--skip-full", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        data = tmp_path / "rows.jsonl"
        write_input(data, args.rows)
        print(f"input: {args.rows} rows, {data.stat().st_size / 2**20:.0f} MiB")
        spec = {
            "name": "memory",
            "model": {"source": "smollm2-135m-instruct"},
            "input": {"path": str(data)},
            "sampling": {"max_tokens": 1},
            "output": {"path": str(tmp_path / "out"), "format": "jsonl", "rows_per_shard": 10000},
            "engine": {"device": "cpu"},
        }
        job = tmp_path / "dry.yaml"
        job.write_text(yaml.safe_dump(spec))
        rss, secs, out = run(job, "--dry-run")
        print(f"dry-run   peak RSS {rss:7.0f} MiB  {secs:6.1f} s\n{out}")
        if args.skip_full:
            return
        from tests.tiny_models import save_tiny_model

        model = save_tiny_model("llama", tmp_path / "tiny", max_position_embeddings=512)
        spec["model"]["source"] = str(model)
        spec["engine"].update({"max_num_seqs": 512, "kv_cache_memory": 64 << 20})
        job = tmp_path / "full.yaml"
        job.write_text(yaml.safe_dump(spec))
        rss_full, secs, out = run(job)
        # RUSAGE_CHILDREN keeps the max over all children so far: report the larger one.
        print(f"full run  peak RSS {max(rss, rss_full):7.0f} MiB  {secs:6.1f} s\n{out}")


if __name__ == "__main__":
    main()
