"""How true the progress ETA is on a real job: `run_job` on the embedded model, its Progress
read four times a second, each ETA against the time generation actually had left.

    PYTHONPATH=. python bench/eta_job.py --device cuda [--rows 20000] [--max-num-seqs 256]

Chat prompts (bench/prompts.py), greedy, natural EOS up to ``--max-tokens``: rows end at
their own lengths, the short ones first, and the batch drains at the end, as a user's job
does. Generation ends when the last row is done (the snapshot's rows_done reaches the
input's rows). Prints one JSON line: ETA / time left at points of generation (1.00 exact,
below 1 too soon; None while the ETA was unknown), and the run's seconds and rows.
bench/eta_accuracy.py simulates the same on any length distribution, without a model.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.prompts import chat_prompts, write_chat_jsonl  # noqa: E402
from tokenmill import run_job  # noqa: E402
from tokenmill.jobs.progress import Progress  # noqa: E402

POINTS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        data = write_chat_jsonl(folder / "prompts.jsonl", chat_prompts(args.rows))
        spec = {
            "name": "eta-job",
            "model": {"source": args.model},
            "input": {"path": str(data), "messages_column": "messages", "prompt_column": None},
            "sampling": {"max_tokens": args.max_tokens, "temperature": 0.0},
            "output": {"path": str(folder / "out"), "format": "parquet"},
            "engine": {"device": args.device, "max_num_seqs": args.max_num_seqs},
            "planner": {"dedup": False},  # the prompts repeat: every row generates
        }
        readings: list[tuple[float, float | None]] = []  # (monotonic s, ETA s)
        ended: list[float] = []
        started = threading.Event()

        def watch(progress: Progress) -> None:
            def poll() -> None:
                while not ended:
                    snap = progress.snapshot()
                    now = time.monotonic()
                    if snap.rows_total and snap.rows_done >= snap.rows_total:
                        ended.append(now)
                        return
                    readings.append((now, snap.eta_seconds))
                    time.sleep(0.25)

            started.set()
            threading.Thread(target=poll, daemon=True).start()

        report = run_job(spec, show_progress=False, on_progress=watch)
        if not ended:  # (the poller had not seen the last row yet)
            ended.append(time.monotonic())
    if not started.is_set() or report.status != "complete":
        raise SystemExit(f"the job did not run to completion: {report.summary()}")
    first, end = readings[0][0], ended[0]
    span = end - first
    ratios: dict[str, float | None] = {}
    for point in POINTS:
        at, eta = next((r for r in readings if r[0] >= first + point * span), readings[-1])
        left = end - at
        ratios[str(point)] = None if eta is None or left <= 0 else round(eta / left, 2)
    print(json.dumps({
        "rows": report.rows_ok, "output_tokens": report.completion_tokens,
        "generation_s": round(span, 1), "max_num_seqs": args.max_num_seqs,
        "eta_over_left": ratios,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
