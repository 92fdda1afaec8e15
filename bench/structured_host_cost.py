"""Engine-thread host time a decode step spends only because its rows are constrained, CPU.

On a GPU at a few hundred rows of a small model the structured decode step is host-bound
(issue 15: 3.0-4.4 ms of engine-thread host a step on an H100 against 1.7-2.5 ms for the
same rows unconstrained). This measures, on CPU, what the engine thread adds per step for
the grammars: an ``LLMEngine`` on a random tiny Llama (tests/tiny_models.py) that carries
the embedded model's tokenizer and vocabulary (49,152 tokens: masks as wide as on the GPU),
async scheduling, ``max_num_seqs`` 256, every row constrained by bench/structured_output.py's
bounded order schema (xgrammar, ``structured_output_processes`` 2 by default), against an
engine of the same model running the same prompts unconstrained, each row as long as its
structured twin (``ignore_eos``, ``max_tokens`` its length: the matched leg of
bench/structured_output.py). Each run queues ``--rounds`` x ``--max-num-seqs`` prompts of
random ids at once (the batch stays full while rows finish and are admitted, a few a step);
the legs alternate, each run on new prompts (no prefix-cache hits), after a warm-up round.

Wall-clock wrappers installed here (instance attributes; a renamed method fails loudly) time
each function inclusively (callees included), per step of the run: ``step`` (the whole call),
``ModelRunner.launch`` (the forward pass runs there on CPU: the same in both legs), within it
``_token_bitmask`` (the wait for the step in flight, the feed, the masks' fill and
``_while_masks_fill``: processing that step and scheduling the next beside the fill), and so
on down to the grammar workers' ``send_step`` / ``finish_consume`` / ``finish_fill``. The
``structured - matched`` column is what the constraint costs the engine thread; medians over
the runs of each leg. The workers share this machine's cores with the engine thread (and
the model's forward pass): a fill the workers finish late shows as ``finish_fill`` time.
So each function is given twice: wall time, and the engine thread's CPU time
(``time.thread_time``: waits for the workers or the output thread not counted). On CPU the
forward pass and the masked sampling are compute on this thread (``launch``, ``sampler``),
which on a GPU are kernels: compare the other rows.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python bench/structured_host_cost.py --runs 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.request_host_cost import Clocks  # noqa: E402
from bench.structured_output import BOUNDED_ORDER_SCHEMA, check_order  # noqa: E402
from tokenmill import SamplingParams  # noqa: E402
from tokenmill.engine.engine_config import EngineConfig  # noqa: E402
from tokenmill.engine.frozen_heap import frozen_heap  # noqa: E402
from tokenmill.engine.llm_engine import LLMEngine  # noqa: E402
from tokenmill.engine.outputs import RequestOutput  # noqa: E402

EMBEDDED = "smollm2-135m-instruct"  # whose tokenizer (and vocabulary size) the model takes

# (owner path from the engine, method): the functions timed, in the table's order
TIMED = (
    ("", "step"),
    ("runner", "launch"),
    ("", "_token_bitmask"),
    ("grammars", "bitmask"),
    ("backend", "send_step"),
    ("", "_while_masks_fill"),
    ("", "_process"),
    ("", "_feed_grammars"),
    ("grammars", "feed"),
    ("grammars", "_finish_feed"),
    ("backend", "finish_consume"),
    ("backend", "finish_fill"),
    ("scheduler", "update_from_output"),
    ("", "_end_grammars"),
    ("grammars", "take_ended"),
    ("scheduler", "finish"),
    ("", "_finish"),
    ("grammars", "drop"),
    ("scheduler", "schedule"),
    ("runner", "prepare"),
    ("runner", "sampler"),
)


def install(engine: LLMEngine, clocks: Clocks) -> None:
    """Wrap every function of ``TIMED`` that ``engine`` has (the matched leg has no
    grammar workers)."""
    grammars = engine._grammars
    owners = {
        "": engine,
        "runner": engine.runner,
        "scheduler": engine.scheduler,
        "grammars": grammars,
        "backend": grammars.backend,
    }
    for owner, name in TIMED:
        label = f"{owner}.{name}" if owner else name
        if owner == "backend" and not hasattr(grammars.backend, name):
            continue  # grammars in the engine's process
        clocks.wrap(owners[owner], name, label)


def build_model(root: Path) -> Path:
    """A random tiny Llama with the embedded model's tokenizer and vocabulary size."""
    from tests.tiny_models import save_tiny_model
    from tokenmill.engine.loader import resolve_model_source

    source = resolve_model_source(EMBEDDED)
    tokenizer = source.load_tokenizer()
    path = save_tiny_model(
        "llama",
        root / "tiny-smollm2-vocab",
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    tokenizer.save_pretrained(str(path))  # over the tiny byte-level one
    return path


def run(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], tag: str
) -> tuple[int, list[RequestOutput]]:
    """Queue every prompt and run them all to the end; (engine steps, outputs by prompt)."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"{tag}-{i}", prompt, p)
    steps, outs = 0, []
    while engine.has_unfinished():
        outs += engine.step()
        steps += 1
    outs.sort(key=lambda o: int(o.request_id.rsplit("-", 1)[1]))
    return steps, outs


def matched(outs: list[RequestOutput]) -> list[SamplingParams]:
    """Unconstrained rows as long as ``outs``' (bench/structured_output.py's matched leg)."""
    return [
        SamplingParams(max_tokens=max(1, len(o.token_ids)), temperature=0.0, ignore_eos=True)
        for o in outs
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each leg, alternating")
    parser.add_argument("--rounds", type=int, default=2, help="prompts a run: rounds x rows")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--backend", choices=("xgrammar", "llguidance"), default="xgrammar")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the per-run numbers here")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    per_run = args.rounds * args.max_num_seqs
    constrained = SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, structured_output=BOUNDED_ORDER_SCHEMA
    )
    results: dict[str, list[dict[str, float]]] = {"structured": [], "matched": []}
    steps_of: dict[str, list[int]] = {"structured": [], "matched": []}
    invalid = 0
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp))
        base = dict(model=str(model), device="cpu", async_scheduling=True,
                    max_num_seqs=args.max_num_seqs)  # fmt: skip
        legs = {
            "structured": LLMEngine(
                EngineConfig(
                    **base,
                    structured_output_backend=args.backend,
                    structured_output_processes=args.processes,
                )
            ),
            "matched": LLMEngine(EngineConfig(**base)),
        }
        vocab = legs["matched"].model_config.vocab_size

        def prompts() -> list[list[int]]:
            return [
                [rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))]
                for _ in range(per_run)
            ]

        clocks = {name: Clocks() for name in legs}
        for name, engine in legs.items():
            install(engine, clocks[name])
        # as LLM runs it: no full collection lands in a timed function
        with frozen_heap():
            for k in range(args.runs + 1):  # the first: warm-up
                batch = prompts()
                outs: list[RequestOutput] = []
                for name, engine in legs.items():
                    params = [constrained] * per_run if name == "structured" else matched(outs)
                    clocks[name].clear()
                    steps, got = run(engine, batch, params, f"{name}{k}")
                    if name == "structured":
                        outs = got
                        invalid += sum(
                            not _valid(o.text) for o in got if o.finish_reason != "length"
                        )
                    if k:
                        c = clocks[name]
                        results[name].append(
                            {f: s * 1e6 / steps for f, s in c.seconds.items()}
                            | {f"cpu:{f}": s * 1e6 / steps for f, s in c.cpu.items()}
                        )
                        steps_of[name].append(steps)
                if k:
                    print(f"run {k}: steps {steps_of['structured'][-1]} / "
                          f"{steps_of['matched'][-1]}", file=sys.stderr, flush=True)  # fmt: skip
        for engine in legs.values():
            engine.close()

    table = []
    for owner, name in TIMED:
        label = f"{owner}.{name}" if owner else name
        row = {"function": label}
        for kind, key in (("wall", label), ("cpu", f"cpu:{label}")):
            s = statistics.median(r.get(key, 0.0) for r in results["structured"])
            m = statistics.median(r.get(key, 0.0) for r in results["matched"])
            row |= {f"{kind}_structured": round(s), f"{kind}_matched": round(m),
                    f"{kind}_diff": round(s - m)}  # fmt: skip
        table.append(row)
    print("| function (us a step, inclusive) | wall: structured | matched | diff "
          "| thread CPU: structured | matched | diff |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for row in table:
        cells = [
            row[f"{k}_{c}"] for k in ("wall", "cpu") for c in ("structured", "matched", "diff")
        ]
        print(f"| `{row['function']}` | " + " | ".join(str(c) for c in cells) + " |")
    summary = {
        "runs": args.runs,
        "rows_a_run": per_run,
        "steps": steps_of,
        "invalid_structured_rows": invalid,
    }
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps({"table": table, "per_run": results, **summary}, indent=2))


def _valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return check_order(value, BOUNDED_ORDER_SCHEMA) is None


if __name__ == "__main__":
    main()
