"""Grammar libraries side by side: the host work of structured output per engine step.

Issue 15 asks for structured output at >= 0.9x the unconstrained throughput; on the H200 a
decode step of ~430 rows takes ~2.4 ms on the GPU, and the grammar work of a step (filling
every constrained row's mask, then consuming its sampled token) sits between two steps.
This bench times that work alone, without a model, for each library it can import:

  llguidance  the engine's backend (engine/grammar_llguidance.py): one compiled matcher
              per thread ("lexer group"), the rows as copies of them, sorted by group,
              filled with ``fill_next_token_bitmask_par`` and fed with ``consume_token_par``
  xgrammar    the engine's other backend (engine/grammar_xgrammar.py): one compiled
              grammar, a ``GrammarMatcher`` per row, filled and fed by
              ``BatchGrammarMatcher``

and, with ``--processes``, either library in that many worker processes
(engine/grammar_processes.py, ``structured_output_processes``), each with its share of the
rows and one thread.

Both run exactly as ``structured_output_backend`` runs them in the engine, with the thread
count set here instead of from the CPU count.

The rows: ``--rows`` order records (bench/structured_output.py's schema fields) written as
compact JSON and tokenized by the model's tokenizer; every step fills all rows' masks, then
gives each row its next token, until the shortest record ends. Per library, schema
(``typical``: types, number bounds, required keys; ``bounded``: every string with
maxLength) and thread count, one JSON line: ms per step for the masks and for the tokens.
A library that is not installed is reported as such, not skipped silently.

``--drafts K`` makes every step a drafted one, as speculative decoding's are: each row's
masks after its output and after each of its next K tokens (the record's own, so every
draft is taken), walked as the engine walks them (grammar_drafts.py: advance, fill,
rollback; in worker processes, the walk sent with the fill), 1 + K masks a row. With
``--open`` the masks after drafts are left open where the engine leaves them for greedy
rows (grammar_drafts.py; llguidance only: xgrammar fills them all).

    PYTHONPATH=. python bench/grammar_backends.py [--threads 1,2] [--processes 1,2] [--rows 433]
    PYTHONPATH=. python bench/grammar_backends.py --rows 64 --drafts 3 --processes 8 [--open]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.structured_output import SCHEMAS  # noqa: E402
from tokenmill.engine.grammar_drafts import fill_with_drafts  # noqa: E402
from tokenmill.engine.grammar_llguidance import LlguidanceGrammars  # noqa: E402
from tokenmill.engine.grammar_processes import GrammarProcesses  # noqa: E402
from tokenmill.engine.grammar_xgrammar import XgrammarGrammars  # noqa: E402
from tokenmill.engine.loader import resolve_model_source  # noqa: E402
from tokenmill.engine.structured_output_params import (  # noqa: E402
    REJECTED,
    check_structured_output,
)

MODEL = "smollm2-135m-instruct"
NAMES = ["Bruno Diaz", "Dana Okafor", "Li Wei", "Ana Souza", "Kofi Mensah"]
CITIES = ["Osaka", "Quito", "Lyon", "Pune", "Accra"]
ITEMS = ["lamps", "desk chairs", "mugs"]


def records(n: int, tokenizer: Any) -> list[list[int]]:
    """``n`` order records as compact JSON, tokenized: what a constrained row writes."""
    rng = random.Random(0)
    out = []
    for i in range(n):
        name = rng.choice(NAMES)
        record = {
            "order_id": 1000 + i,
            "customer": name,
            "city": rng.choice(CITIES),
            "item": rng.choice(ITEMS),
            "quantity": i % 400,
            "unit_price": rng.randint(5, 900),
            "email": f"{name.split()[0].lower()}@example.com",
        }
        text = json.dumps(record, separators=(",", ":"))
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def time_steps(
    seqs: list[list[int]], fill: Callable[[], object], consume: Callable[[list[int]], object]
) -> tuple[float, float]:
    """(mask ms, token ms) per step, over every step but the first two (warm-up)."""
    steps = min(len(s) for s in seqs)
    mask_s = token_s = 0.0
    for p in range(steps):
        t0 = time.perf_counter()
        fill()
        t1 = time.perf_counter()
        consume([s[p] for s in seqs])
        t2 = time.perf_counter()
        if p >= 2:
            mask_s += t1 - t0
            token_s += t2 - t1
    return mask_s / (steps - 2) * 1e3, token_s / (steps - 2) * 1e3


def time_backend(
    backend: LlguidanceGrammars | XgrammarGrammars | GrammarProcesses,
    spec: str,
    seqs: list[list[int]],
    drafts: int = 0,
    leave_open: bool = False,
) -> tuple[float, float]:
    """(mask ms, token ms) per step of ``backend`` doing the engine's calls: a matcher per
    row, then every step one ``fill`` of all rows' masks (1 + ``drafts`` a row, walking
    the record's next tokens) and one ``consume``."""
    rows = [backend.matcher(spec) for _ in seqs]
    size = len(seqs) * (1 + drafts)
    if isinstance(backend, GrammarProcesses):  # the engine's buffer: the workers write it
        mask = backend.shared_masks(0, size, pinned=False)
    else:
        mask = np.zeros((size, -(-backend.vocab_size // 32)), dtype=np.int32)
    places = np.arange(len(seqs)) * (1 + drafts)
    counts = np.full(len(seqs), drafts, dtype=np.int64)
    opens = np.full(len(seqs), leave_open and backend.leaves_masks_open)
    step = [0]

    def fill() -> None:
        if not drafts:
            backend.fill(rows, mask)
            return
        at = step[0]
        walk = np.array([s[at + 1 : at + 1 + drafts] for s in seqs], dtype=np.int64)
        if isinstance(backend, GrammarProcesses):
            step_fill = (rows, mask, places, (walk.reshape(-1), counts))
            backend.finish_fill(backend.send_step(fill=step_fill, open_rows=opens))
        else:
            fill_with_drafts(backend, rows, mask, places, walk.reshape(-1), counts, opens)

    def consume(tokens: list[int]) -> None:
        step[0] += 1
        if (np.asarray(backend.consume(rows, tokens)) == REJECTED).any():
            raise RuntimeError(f"{backend.name} rejected a token of a valid record")

    # the last ``drafts`` steps would walk past the shortest record: not timed
    return time_steps([s[: len(s) - drafts] for s in seqs], fill, consume)


LEGS = {"llguidance": LlguidanceGrammars, "xgrammar": XgrammarGrammars}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL, help="whose tokenizer")
    parser.add_argument("--rows", type=int, default=433, help="constrained rows a step")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument(
        "--processes", default="", help="comma-separated worker process counts (also timed: "
        "GrammarProcesses, the engine's structured_output_processes)",
    )  # fmt: skip
    parser.add_argument(
        "--drafts", type=int, default=0, help="draft tokens a row walks each step (k)"
    )
    parser.add_argument(
        "--open", action="store_true", help="leave the masks after drafts open (greedy rows)"
    )
    args = parser.parse_args()
    source = resolve_model_source(args.model)
    tokenizer = source.load_tokenizer()
    vocab = source.load_config().vocab_size
    seqs = records(args.rows, tokenizer)
    for library, leg in LEGS.items():
        for schema_name, schema in SCHEMAS.items():
            spec = check_structured_output(schema)
            counts = [("threads", int(t)) for t in args.threads.split(",") if t]
            counts += [("processes", int(n)) for n in args.processes.split(",") if n]
            for how, count in counts:
                line: dict[str, Any] = {
                    "library": library,
                    "schema": schema_name,
                    how: count,
                    "rows": args.rows,
                    "drafts": args.drafts,
                    "open": args.open,
                }
                eos = [tokenizer.eos_token_id]
                try:
                    if how == "threads":
                        backend = leg(tokenizer, vocab, eos, count)
                    else:
                        backend = GrammarProcesses(library, tokenizer, vocab, eos, count)
                    try:
                        times = time_backend(backend, spec, seqs, args.drafts, args.open)
                        mask_ms, token_ms = times
                    finally:
                        if how == "processes":
                            backend.close()
                except ImportError as exc:
                    line["not_installed"] = str(exc)
                    print(json.dumps(line), flush=True)
                    break
                line |= {"mask_ms": round(mask_ms, 3), "token_ms": round(token_ms, 3)}
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
