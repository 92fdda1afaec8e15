"""Grammar libraries side by side: the host work of structured output per engine step.

Issue 15 asks for structured output at >= 0.9x the unconstrained throughput; on the H200 a
decode step of ~430 rows takes ~2.4 ms on the GPU, and the grammar work of a step (filling
every constrained row's mask, then consuming its sampled token) sits between two steps.
This bench times that work alone, without a model, for each library it can import:

  llguidance  as tokenmill runs it (engine/structured_output.py): one compiled matcher per
              thread ("lexer group"), the rows as copies of them, sorted by group, filled
              with ``fill_next_token_bitmask_par`` and fed with ``consume_token_par``
  xgrammar    one compiled grammar, a ``GrammarMatcher`` per row, filled with
              ``BatchGrammarMatcher.batch_fill_next_token_bitmask`` and fed with
              ``batch_accept_token``

The rows: ``--rows`` order records (bench/structured_output.py's schema fields) written as
compact JSON and tokenized by the model's tokenizer; every step fills all rows' masks, then
gives each row its next token, until the shortest record ends. Per library, schema
(``typical``: types, number bounds, required keys; ``bounded``: every string with
maxLength) and thread count, one JSON line: ms per step for the masks and for the tokens.
A library that is not installed is reported as such, not skipped silently.

    PYTHONPATH=. python bench/grammar_backends.py [--threads 1,2] [--rows 433]
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
from tokenmill.engine.loader import resolve_model_source  # noqa: E402
from tokenmill.engine.structured_output_params import (  # noqa: E402
    check_structured_output,
    grammar_text,
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


def llguidance_leg(
    tokenizer: Any, vocab: int, schema: dict, seqs: list[list[int]], threads: int
) -> tuple[float, float]:
    import llguidance
    import llguidance.numpy
    from llguidance.hf import from_tokenizer

    ll_tokenizer = from_tokenizer(tokenizer, n_vocab=vocab, eos_token=[tokenizer.eos_token_id])
    grammar = grammar_text(check_structured_output(schema))
    fresh = [llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0) for _ in range(threads)]
    matchers = [fresh[i % threads].deep_copy() for i in range(len(seqs))]
    order = sorted(range(len(seqs)), key=lambda i: i % threads)
    executor = llguidance.LLExecutor(num_threads=threads)
    mask = np.zeros((len(seqs), -(-vocab // 32)), dtype=np.int32)
    pairs = [(matchers[i], i) for i in order]

    def fill() -> None:
        llguidance.numpy.fill_next_token_bitmask_par(executor, pairs, mask)

    def consume(tokens: list[int]) -> None:
        accepted = executor.consume_token_par([(matchers[i], tokens[i]) for i in order])
        if not all(accepted):
            raise RuntimeError("llguidance rejected a token of a valid record")

    return time_steps(seqs, fill, consume)


def xgrammar_leg(
    tokenizer: Any, vocab: int, schema: dict, seqs: list[list[int]], threads: int
) -> tuple[float, float]:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info, max_threads=threads)
    compiled = compiler.compile_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(",", ":")
    )
    matchers = [xgrammar.GrammarMatcher(compiled) for _ in seqs]
    batch = xgrammar.BatchGrammarMatcher(max_threads=threads)
    mask = xgrammar.allocate_token_bitmask(len(seqs), vocab)

    def fill() -> None:
        batch.batch_fill_next_token_bitmask(matchers, mask)

    def consume(tokens: list[int]) -> None:
        if not all(batch.batch_accept_token(matchers, tokens)):
            raise RuntimeError("xgrammar rejected a token of a valid record")

    return time_steps(seqs, fill, consume)


LEGS = {"llguidance": llguidance_leg, "xgrammar": xgrammar_leg}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL, help="whose tokenizer")
    parser.add_argument("--rows", type=int, default=433, help="constrained rows a step")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    args = parser.parse_args()
    source = resolve_model_source(args.model)
    tokenizer = source.load_tokenizer()
    vocab = source.load_config().vocab_size
    seqs = records(args.rows, tokenizer)
    for library, leg in LEGS.items():
        for schema_name, schema in SCHEMAS.items():
            for threads in (int(t) for t in args.threads.split(",")):
                line: dict[str, Any] = {
                    "library": library,
                    "schema": schema_name,
                    "threads": threads,
                    "rows": args.rows,
                }
                try:
                    mask_ms, token_ms = leg(tokenizer, vocab, schema, seqs, threads)
                except ImportError as exc:
                    line["not_installed"] = str(exc)
                    print(json.dumps(line), flush=True)
                    break
                line |= {"mask_ms": round(mask_ms, 3), "token_ms": round(token_ms, 3)}
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
