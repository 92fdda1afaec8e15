"""What the suffix proposer's own n-gram index costs a proposal after plain steps (CPU).

A row's index takes in every token since the row's last proposal when it is next asked for
drafts: every step while drafting, hundreds of steps apart when the speculation policy only
probes (``auto`` at 256 rows). This fills ``--rows`` slots with ``--prompt`` tokens of a
skewed random vocabulary, indexes them, then ``--probes`` times appends ``gap`` tokens to
every row and times the index's catch-up (``NgramProposer.match``) and a whole proposal
after it (``SuffixProposer.predict``, nothing left to catch up), for each gap.

    python bench/proposer_catchup.py [--rows 256] [--gaps 1,10,50,200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenmill.engine.core.batch_slots import BatchSlots  # noqa: E402
from tokenmill.engine.spec_decode.suffix import SuffixProposer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=100)
    parser.add_argument("--gaps", default="1,10,50,200")
    parser.add_argument("--probes", type=int, default=8)
    args = parser.parse_args()
    rng = np.random.default_rng(0)

    def text(n: int) -> np.ndarray:  # Zipf-like: some tokens common, most rare
        return (rng.zipf(1.3, n) % 2000).astype(np.int32)

    rows = np.arange(args.rows)
    for gap in (int(g) for g in args.gaps.split(",")):
        length = args.prompt + gap * (args.probes + 1) + 8
        slots = BatchSlots(args.rows, length, 16)
        for r in rows.tolist():
            slots.token_ids[r, : args.prompt] = text(args.prompt)
            slots.num_tokens[r] = args.prompt
            slots.requests[r] = object()
        proposer = SuffixProposer(4)
        proposer.observe([text(150).tolist() for _ in range(300)])  # earlier rows' outputs
        proposer.predict(slots, rows, 4)
        proposer.predict(slots, rows, 4)  # (the second waits for the outputs' index)
        catch_up, proposal = [], []
        for _ in range(args.probes):
            for _ in range(gap):
                slots.token_ids[rows, slots.num_tokens[rows]] = text(args.rows)
                slots.num_tokens[rows] += 1
            t0 = time.perf_counter()
            proposer.own.match(slots, rows)
            t1 = time.perf_counter()
            proposer.predict(slots, rows, 4)
            catch_up.append(t1 - t0)
            proposal.append(time.perf_counter() - t1)
        proposer.close()
        print(f"gap {gap:4d} tokens: index catch-up {1e3 * statistics.median(catch_up):.2f} ms, "
              f"then a proposal {1e3 * statistics.median(proposal):.2f} ms "
              f"({args.rows} rows, medians of {args.probes})")  # fmt: skip


if __name__ == "__main__":
    main()
