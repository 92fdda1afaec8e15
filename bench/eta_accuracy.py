"""How true the progress ETA is over a run: a simulated job (no model) through the real
``Progress``, its ETA against the time actually left at points of the run.

    PYTHONPATH=. python bench/eta_accuracy.py [--rows 20000] [--batches 256,1024]

Each step every running row makes one token and a step takes ``--step-ms`` (a GPU-bound
decode step takes about as long whatever its rows); rows start as slots free, in input
order, with lengths drawn from each distribution (capped at ``--max-tokens``). The local
executor's live counts (each row's tokens so far) are given, as a local run gives them.
Prints, per distribution and batch, ETA / time left at 2%, 5%, ... 90% of the run: 1.00
is exact, below 1 too soon.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from tokenmill.jobs.progress import LiveCounts, Progress

POINTS = (0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.9, 0.95, 0.98)


def lengths(dist: str, n: int, max_tokens: int, rng: np.random.Generator) -> np.ndarray:
    if dist == "lognormal":  # chat answers: most short, a long tail, some cut at the cap
        raw = rng.lognormal(4.6, 0.8, n).astype(int)
    elif dist == "bimodal":  # labels and essays in one job
        raw = np.where(rng.random(n) < 0.5, rng.integers(5, 20, n), rng.integers(200, 257, n))
    else:
        raw = rng.integers(1, max_tokens + 1, n)
    return np.clip(raw, 1, max_tokens)


def simulate(
    dist: str, rows: int, batch: int, max_tokens: int, step_s: float, row_s: float = 0.0
) -> list[float]:
    """ETA / time left at each of POINTS; a step takes ``step_s`` + ``row_s`` a row."""
    want = lengths(dist, rows, max_tokens, np.random.default_rng(0))
    now = [0.0]
    live = {"counts": LiveCounts()}
    progress = Progress(rows, 0, enabled=False, live=lambda: live["counts"],
                        clock=lambda: now[0], max_tokens=max_tokens)  # fmt: skip
    made = np.zeros(0, dtype=np.int64)  # tokens so far of the running rows
    need = np.zeros(0, dtype=np.int64)
    started = tokens = 0
    etas: list[tuple[float, float | None]] = []
    while started < rows or len(made):
        room = min(batch - len(made), rows - started)
        made = np.concatenate([made, np.zeros(room, dtype=np.int64)])
        need = np.concatenate([need, want[started : started + room]])
        started += room
        now[0] += step_s + row_s * len(made)
        made += 1
        tokens += len(made)
        ended = made >= need
        running = made[~ended]
        # as the local executor does: the rows a step finished are out of flight, counted
        # as finishing until each is handed on; a sample after the step, then the rows
        finishing = made[ended].tolist()
        row_tokens = tuple(running.tolist())
        live["counts"] = LiveCounts(tokens, len(running), row_tokens=row_tokens,
                                    rows_finishing=len(finishing))  # fmt: skip
        progress.tick()
        for i, length in enumerate(finishing):
            live["counts"] = LiveCounts(tokens, len(running), row_tokens=row_tokens,
                                        rows_finishing=len(finishing) - i - 1)  # fmt: skip
            progress.update(1, length)
        made, need = running, need[~ended]
        etas.append((now[0], progress.eta_seconds))
    total = now[0]
    out = []
    for point in POINTS:
        at = next(e for t, e in etas if t >= point * total)
        out.append(float("nan") if at is None else round(at / (total - point * total), 2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--batches", default="256,1024")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=100.0, help="a step's fixed time")
    parser.add_argument(
        "--row-ms", type=float, default=0.0, help="a step's time a row (a CPU's: most of it)"
    )
    args = parser.parse_args()
    for dist in ("lognormal", "uniform", "bimodal"):
        for batch in (int(b) for b in args.batches.split(",")):
            ratios = simulate(dist, args.rows, batch, args.max_tokens, args.step_ms / 1e3,
                              args.row_ms / 1e3)  # fmt: skip
            ratio_at = dict(zip(POINTS, ratios, strict=True))
            print(json.dumps({"lengths": dist, "batch": batch, "eta_over_left": ratio_at}))


if __name__ == "__main__":
    main()
