"""Replica-kill soak: SIGKILL Ray replicas at random moments during one job (issue 16, item 2);
the job must still exit 0 with every row exactly once, as an uninterrupted run wrote it.

    reference run (local, uninterrupted) ──► ref rows
    run-job (executor: ray, --replicas) ── killer thread, --kills times:
        pick a random replica that is up (its ``ready()`` answers: model loaded), wait a
        random 0..--gap s, SIGKILL its process (the pid it reported)
    exit code, then the output vs ref rows: lost, duplicated, mismatched (whole record),
    rows in the error file (a row wrongly taken for a poison row)

Every kill is a whole replica process lost with the chunks it held; the executor must run
those rows again elsewhere and start a new replica. The job runs in this process through the
CLI's ``main`` (its exit code), on a local Ray started here; the tiny random Llama of the
tests (tests/tiny_models.py) runs on the CPU, greedy, one torch thread per engine (the
reference's too: a Ray CPU worker gets one). When the job ends before all kills landed, the
run fails: raise ``--rows``.

    PYTHONPATH=. .venv/bin/python bench/ray_replica_kills.py [--kills 10] [--rows 4000]
        [--max-tokens 96] [--replicas 2] [--gap 3] [--seed 0]

Prints one JSON line; exit status 1 on any lost, duplicated, mismatched or error row, an
exit code other than 0, or fewer kills than asked.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: as Ray's CPU workers have it

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402

from tests.jobs.job_helpers import chat_rows, job_dict, read_jsonl_dir, write_jsonl  # noqa: E402
from tests.tiny_models import save_tiny_model  # noqa: E402
from tokenmill import run_job  # noqa: E402
from tokenmill.jobs.cli import main as cli_main  # noqa: E402

JOB = "kill-soak"


class Killer(threading.Thread):
    """Kills ``kills`` replicas of the job at random moments until ``done`` is set."""

    def __init__(self, kills: int, gap: float, rng: random.Random, done: threading.Event):
        super().__init__(daemon=True, name="replica-killer")
        self.kills, self.gap, self.rng, self.done = kills, gap, rng, done
        self.killed: list[dict[str, Any]] = []

    def run(self) -> None:
        start = time.monotonic()
        while len(self.killed) < self.kills and not self.done.is_set():
            names = [n for n in ray.util.list_named_actors() if n.startswith(f"tokenmill-{JOB}-")]
            if not names:
                time.sleep(0.1)
                continue
            name = self.rng.choice(sorted(names))
            try:  # waits while it loads; fails if it died meanwhile (pick again)
                pid = ray.get(ray.get_actor(name).ready.remote(), timeout=120).pid
            except Exception:
                time.sleep(0.1)
                continue
            self.done.wait(self.rng.uniform(0.0, self.gap))
            if self.done.is_set():
                return
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it died on its own meanwhile: not ours to count
                continue
            self.killed.append({"replica": name, "pid": pid, "at_s": time.monotonic() - start})


class _Failures(logging.Handler):
    """Counts the executor's "Ray replica N failed" warnings."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Ray replica") and " failed " in record.getMessage():
            self.count += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--gap", type=float, default=3.0, help="max s from up to its kill")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)

    with tempfile.TemporaryDirectory(prefix="ray-kills-") as tmp:
        folder = Path(tmp)
        model = save_tiny_model("llama", folder / "tiny", max_position_embeddings=1024)
        src = write_jsonl(folder / "in.jsonl", chat_rows(args.rows))
        sections = {
            "engine": {"max_num_seqs": 8},
            "sampling": {"max_tokens": args.max_tokens},
            "output": {"rows_per_shard": 50},
        }
        ref_report = run_job(job_dict(model, src, folder / "ref", **sections), show_progress=False)
        assert ref_report.status == "complete"
        ref = {r["id"]: r for r in read_jsonl_dir(folder / "ref" / "shards")}

        execution = {"executor": "ray", "replicas": args.replicas, "ray_address": None}
        spec = job_dict(model, src, folder / "ray", name=JOB, execution=execution, **sections)
        (folder / "job.yaml").write_text(yaml.safe_dump(spec))
        ray.init(num_cpus=args.replicas, include_dashboard=False, log_to_driver=False)
        failures = _Failures()
        logging.getLogger("tokenmill.jobs").addHandler(failures)
        done = threading.Event()
        killer = Killer(args.kills, args.gap, rng, done)
        start = time.monotonic()
        try:
            killer.start()
            code = cli_main([str(folder / "job.yaml"), "--quiet"])
        finally:
            done.set()
            killer.join(10)
            ray.shutdown()
        seconds = time.monotonic() - start

        written = read_jsonl_dir(folder / "ray" / "shards")
        counts = Counter(r["id"] for r in written)
        got = {r["id"]: r for r in written}
        errors = read_jsonl_dir(folder / "ray" / "errors")

    summary = {
        "kills": len(killer.killed),
        "kills_asked": args.kills,
        "replica_failures_seen": failures.count,
        "exit_code": code,
        "rows": args.rows,
        "lost": len(set(ref) - set(got)),
        "duplicated": sum(n - 1 for n in counts.values() if n > 1),
        "mismatched": sum(1 for k, v in got.items() if ref.get(k, v) != v),
        "error_rows": len(errors),
        "seconds": round(seconds, 1),
        "reference_seconds": round(ref_report.wall_seconds, 1),
        "seed": args.seed,
        "kill_times_s": [round(k["at_s"], 1) for k in killer.killed],
    }
    ok = (
        code == 0
        and summary["kills"] == args.kills
        and not (summary["lost"] or summary["duplicated"] or summary["mismatched"])
        and not summary["error_rows"]
    )
    summary["ok"] = ok
    print(json.dumps(summary), flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
