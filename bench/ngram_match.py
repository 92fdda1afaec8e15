"""N-gram prompt lookup on the device against the host proposer, per proposal.

The host proposer (spec_decode/ngram.py) keeps a hash index per row and indexes each token
once; in steady state a proposal indexes the row's new token and looks its suffix up. The
device kernel (kernels/ngram_match.py) keeps no index and compares every position of a row
with its suffix at each call. This times, for ``--rows`` rows of ``--lengths`` tokens (a
skewed random vocabulary, so suffixes recur), on one device:

- ``kernel``: ``ngram_match`` on the device, CUDA events, the L2 warm (the engine's token
  table is read every step), and the same call replayed from a CUDA graph;
- ``reference``: ``ngram_match_ref`` (PyTorch, the same device);
- ``host step``: ``NgramProposer.predict`` after one new token a row (steady state), and
  ``host catch-up``: the first proposal of rows whose whole prompt is new to the index.

It checks first that the kernel's drafts equal the reference's, and counts the rows where the
host proposer's equal them too.

    python bench/ngram_match.py [--rows 64,256,512] [--lengths 512,2048] [--device cuda]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_timing import time_ms, warm_up_gpu  # noqa: E402
from tokenmill.engine.core.batch_slots import BatchSlots  # noqa: E402
from tokenmill.engine.spec_decode.ngram import NgramProposer  # noqa: E402
from tokenmill.kernels.ngram_match import ngram_match, ngram_match_ref  # noqa: E402

MIN_N, MAX_N, DRAFTS = 2, 4, 4  # the engine's defaults (SpeculativeConfig)


def _slots(rows: int, length: int, rng: np.random.Generator) -> BatchSlots:
    slots = BatchSlots(rows, length + 256, 16)  # room for the host steps
    for r in range(rows):
        slots.token_ids[r, :length] = (rng.zipf(1.3, length) % 2000).astype(np.int32)
        slots.num_tokens[r] = length
        slots.requests[r] = object()
    return slots


def _host_ms(slots: BatchSlots, rows: np.ndarray, steps: int) -> tuple[float, float]:
    """(first proposal, median of ``steps`` proposals each after one new token a row)."""
    proposer = NgramProposer(DRAFTS, MIN_N, MAX_N)
    t0 = time.perf_counter()
    proposer.predict(slots, rows, DRAFTS)
    first = time.perf_counter() - t0
    rng = np.random.default_rng(1)
    times = []
    for _ in range(steps):
        slots.token_ids[rows, slots.num_tokens[rows]] = rng.integers(0, 2000, len(rows))
        slots.num_tokens[rows] += 1
        t0 = time.perf_counter()
        proposer.predict(slots, rows, DRAFTS)
        times.append(time.perf_counter() - t0)
    slots.num_tokens[rows] -= steps
    return 1e3 * first, 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="64,256,512")
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda:
        warm_up_gpu()
    results = []
    for length in (int(x) for x in args.lengths.split(",")):
        for count in (int(x) for x in args.rows.split(",")):
            slots = _slots(count, length, np.random.default_rng(length + count))
            rows = np.arange(count)
            tokens = torch.from_numpy(slots.token_ids).to(args.device)
            order = torch.arange(count, dtype=torch.int32, device=args.device)
            lengths = torch.from_numpy(slots.num_tokens[:count].astype(np.int32)).to(args.device)
            got = ngram_match(tokens, order, lengths, MIN_N, MAX_N, DRAFTS)
            want = ngram_match_ref(tokens, order, lengths, MIN_N, MAX_N, DRAFTS)
            if got.tolist() != want.tolist():
                raise SystemExit(f"kernel and reference differ at {count} rows x {length} tokens")
            # The host index keeps one position an entry: a gram sharing an entry with a later
            # one is forgotten, so a few rows may differ (a wide table: few).
            host = NgramProposer(DRAFTS, MIN_N, MAX_N, table_bits=18).predict(slots, rows, DRAFTS)
            row = {
                "rows": count,
                "length": length,
                "matched": int((want[:, 0] >= 0).sum()),
                "host_rows_equal": int((got.cpu().numpy() == host).all(axis=1).sum()),
            }

            call = (tokens, order, lengths, MIN_N, MAX_N, DRAFTS)
            kernel = functools.partial(ngram_match, *call)
            reference = functools.partial(ngram_match_ref, *call)

            if cuda:
                row["kernel_ms"] = time_ms(kernel, before=None)
                row["kernel_graph_ms"] = time_ms(kernel, before=None, graph=True)
                row["reference_ms"] = time_ms(reference, before=None)
            else:
                row["kernel_ms"] = float("nan")  # the interpreter's time says nothing
                t0 = time.perf_counter()
                reference()
                row["reference_ms"] = 1e3 * (time.perf_counter() - t0)
            row["host_catch_up_ms"], row["host_step_ms"] = _host_ms(slots, rows, args.steps)
            results.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'rows':>5} {'tokens':>6} {'kernel':>8} {'graph':>8} {'torch ref':>9} "
          f"{'host step':>9} {'host first':>10}  (ms a proposal, {args.device})")  # fmt: skip
    for r in results:
        print(f"{r['rows']:5d} {r['length']:6d} {r['kernel_ms']:8.4f} "
              f"{r.get('kernel_graph_ms', float('nan')):8.4f} {r['reference_ms']:9.3f} "
              f"{r['host_step_ms']:9.3f} {r['host_catch_up_ms']:10.2f}")  # fmt: skip
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "ngram_match.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
