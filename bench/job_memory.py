"""Peak memory of the job path over a 1,000,000-row JSONL input.

Two runs, each in its own `run-job` process whose peak RSS is read from the kernel
(getrusage of the child):
  dry-run:  SmolLM2's tokenizer reads and tokenizes every row (no weights, no output);
  full run: a tiny random Llama (tests/tiny_models.py) generates 1 token per row, so the
            reader, engine, shard tracker and writer all see every row (rows_per_shard 10000).

Wide rows (``--wide-mb 5``): each row also carries a passthrough column of that many MB,
and the full run's shard size and ``max_num_seqs`` come from ``--rows-per-shard`` and
``--max-num-seqs``, so the rows held in the engine and in open shards can be measured.

    .venv/bin/python bench/job_memory.py [--rows 1000000] [--skip-full]
    .venv/bin/python bench/job_memory.py --rows 400 --wide-mb 5 --skip-dry-run
    (``--rows-per-shard 0``: the job picks its shard size, as one that leaves it out)
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


def write_input(path: Path, rows: int, wide_mb: float = 0.0) -> None:
    blob = "x" * int(wide_mb * 2**20)
    with path.open("w") as f:
        for i in range(rows):
            row = {"id": f"row-{i}", "prompt": f"Question {i}: what is {i} plus 1?"}
            if blob:
                row["blob"] = blob
            f.write(json.dumps(row))
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
    parser.add_argument("--skip-dry-run", action="store_true")
    parser.add_argument("--wide-mb", type=float, default=0.0)
    # 0: left out of the job, which picks it from its rows' size (jobs/shard_size.py)
    parser.add_argument("--rows-per-shard", type=int, default=10000)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        data = tmp_path / "rows.jsonl"
        write_input(data, args.rows, args.wide_mb)
        print(f"input: {args.rows} rows, {data.stat().st_size / 2**20:.0f} MiB")
        spec = {
            "name": "memory",
            "model": {"source": "smollm2-135m-instruct"},
            "input": {"path": str(data), "passthrough_columns": ["blob"] if args.wide_mb else []},
            "sampling": {"max_tokens": args.max_tokens},
            "output": {"path": str(tmp_path / "out"), "format": "jsonl"},
            "engine": {"device": "cpu"},
        }
        if args.rows_per_shard:
            spec["output"]["rows_per_shard"] = args.rows_per_shard
        rss = 0.0
        if not args.skip_dry_run:
            job = tmp_path / "dry.yaml"
            job.write_text(yaml.safe_dump(spec))
            rss, secs, out = run(job, "--dry-run")
            print(f"dry-run   peak RSS {rss:7.0f} MiB  {secs:6.1f} s\n{out}")
        if args.skip_full:
            return
        from tests.tiny_models import save_tiny_model

        model = save_tiny_model("llama", tmp_path / "tiny", max_position_embeddings=512)
        spec["model"]["source"] = str(model)
        spec["engine"].update({"max_num_seqs": args.max_num_seqs, "kv_cache_memory": 64 << 20})
        job = tmp_path / "full.yaml"
        job.write_text(yaml.safe_dump(spec))
        rss_full, secs, out = run(job)
        # RUSAGE_CHILDREN keeps the max over all children so far: report the larger one.
        print(f"full run  peak RSS {max(rss, rss_full):7.0f} MiB  {secs:6.1f} s\n{out}")


if __name__ == "__main__":
    main()
