"""Structured output against no constraint, same prompts, same command (issue 15).

Goal: on the GPU, the embedded model (smollm2-135m-instruct), 4,096 extraction prompts,
``max_num_seqs`` 512: the run where every row carries a JSON schema
(``SamplingParams(structured_output=...)``) at >= 0.9x the unconstrained run's output tok/s,
and 100% of the constrained rows valid against the schema.

Three legs, greedy, each on a fresh engine (so none finds another's prompts in the prefix
cache) after a warm-up on it of ``--warm-up`` other prompts (a full batch by default: a
shorter one left kernel variants of larger steps to compile inside the timed part):

  plain          the extraction prompts, no constraint, natural EOS
  structured     the same prompts, each row constrained by the order schema (``--schema``
                 typical: ORDER_SCHEMA, or bounded: its strings with maxLength; llguidance);
                 a row ends when its JSON is complete
  plain_matched  no constraint, each row made as long as its structured output (max_tokens
                 = that length, EOS ignored): the same tokens to generate as the structured
                 leg, so this ratio is the grammars' cost alone. It is the one the goal is
                 judged on: the plain leg's ratio also carries the difference in output
                 lengths (the model unconstrained writes 4x longer rows, prose around the
                 JSON: far less of its time goes to prefill), which no grammar can win back.

The prompts (bench/spec_workloads.py ``extraction``: pull an order's fields out of a short
generated report as JSON) are tokenized once, before either leg, so the timed part is the
engine's: adding the requests (a grammar per constrained row), the steps, the outputs.

Per leg one JSON line: rows, output tokens, seconds, tok/s, finish reasons and the step
profile (``profile_steps``: host / wait / GPU ms per decode and per other step, how many
steps ran synchronously, and for the structured leg the grammar host work per step); then
one line with both ratios, the share of constrained rows whose text parses and validates
(``jsonschema`` when importable, else ``check_order`` below, which knows this schema's
shape), and whether the goal holds. ``--json`` also writes them all to a file.

    PYTHONPATH=. python bench/structured_output.py --device cpu --requests 16 --max-tokens 32
    PYTHONPATH=. python bench/structured_output.py --device cuda    # the goal: 4,096 x 512
    PYTHONPATH=. python bench/structured_output.py --device cuda --schema bounded
    PYTHONPATH=. python bench/structured_output.py --device cuda --backend xgrammar
    PYTHONPATH=. python bench/structured_output.py --device cuda --processes 8
    PYTHONPATH=. python bench/structured_output.py --device cuda --schema bounded \
        --backend xgrammar --repeat 3

With ``--repeat N`` the structured leg and its matched twin run N times, alternating (the
plain leg once): the goal is judged on the median of the N pairs' ratios, and every
structured run's rows must validate. One machine's host speed moved the structured leg by
18% between two runs of the same tree (BENCHMARKS.md, session 27).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.spec_workloads import extraction  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.engine.loader import resolve_model_source  # noqa: E402
from tokenmill.engine.outputs import RequestOutput  # noqa: E402
from tokenmill.engine.prompts import encode_chat  # noqa: E402

MODEL = "smollm2-135m-instruct"
GOAL_RATIO = 0.9  # structured tok/s at least this share of the plain run's
GOAL_VALID = 1.0  # every constrained row parses and validates

# The fields the extraction prompts ask for, in their order, as a typical extraction schema
# states them: types, bounds on the numbers, every key required and no others.
ORDER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 0, "maximum": 999999},
        "customer": {"type": "string"},
        "city": {"type": "string"},
        "item": {"type": "string"},
        "quantity": {"type": "integer", "minimum": 0, "maximum": 999999},
        "unit_price": {"type": "number", "minimum": 0, "maximum": 999999},
        "email": {"type": "string"},
    },
    "required": ["order_id", "customer", "city", "item", "quantity", "unit_price", "email"],
    "additionalProperties": False,
}
# The same with every string bounded (maxLength), so each row's longest possible JSON fits
# the default --max-tokens. llguidance computes masks inside a bounded string by walking
# the whole token trie (no precomputed slices for it): about 4x the host time a row
# (22 against 5.5 us a mask on one core here), so both are measured.
BOUNDED_ORDER_SCHEMA: dict[str, Any] = {
    **ORDER_SCHEMA,
    "properties": {
        key: {**rule, "maxLength": 48 if key == "email" else 32}
        if rule["type"] == "string"
        else rule
        for key, rule in ORDER_SCHEMA["properties"].items()
    },
}
SCHEMAS = {"typical": ORDER_SCHEMA, "bounded": BOUNDED_ORDER_SCHEMA}


def check_order(value: Any, schema: dict[str, Any] = ORDER_SCHEMA) -> str | None:
    """Why ``value`` fails ``schema`` (None: it validates), for schemas of this shape only:
    an object of required, typed properties with bounds and no others. Used when the
    ``jsonschema`` package is not importable (the GPU box has no pip)."""
    if not isinstance(value, dict):
        return f"not an object: {type(value).__name__}"
    props = schema["properties"]
    if set(value) - set(props) and schema.get("additionalProperties") is False:
        return f"unexpected keys {sorted(set(value) - set(props))}"
    missing = [k for k in schema.get("required", ()) if k not in value]
    if missing:
        return f"missing keys {missing}"
    for key, item in value.items():
        rule = props[key]
        kind = rule["type"]
        if kind == "string":
            if not isinstance(item, str):
                return f"{key}: not a string"
            if len(item) > rule.get("maxLength", len(item)):
                return f"{key}: longer than {rule['maxLength']}"
            continue
        numeric = (int,) if kind == "integer" else (int, float)
        if isinstance(item, bool) or not isinstance(item, numeric):
            return f"{key}: not {'an integer' if kind == 'integer' else 'a number'}"
        if not rule.get("minimum", item) <= item <= rule.get("maximum", item):
            return f"{key}: {item} out of [{rule.get('minimum')}, {rule.get('maximum')}]"
    return None


def validator(schema: dict[str, Any]) -> tuple[str, Any]:
    """(name, fn(text) -> error or None) against ``schema``: jsonschema when importable,
    else check_order."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None

    def error(text: str) -> str | None:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            return f"not JSON: {exc.msg} at {exc.pos}"
        if jsonschema is None:
            return check_order(value, schema)
        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError as exc:
            return exc.message
        return None

    return ("jsonschema" if jsonschema is not None else "check_order (no jsonschema)"), error


def free_device() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def tokenize(model: str, count: int) -> list[list[int]]:
    """The extraction prompts as chat-templated token ids (the model's own tokenizer)."""
    tokenizer = resolve_model_source(model).load_tokenizer()
    return [encode_chat(tokenizer, conv) for conv in extraction(count)]


def run_leg(
    name: str,
    args: argparse.Namespace,
    prompts: list[list[int]],
    params: list[SamplingParams],
    warm_up: list[list[int]],
) -> tuple[dict[str, Any], list[RequestOutput]]:
    """(result line, outputs) of one leg on its own engine, after ``warm_up`` (other prompts:
    none of the timed ones is in the prefix cache); ``params``: one per prompt."""
    llm = LLM(
        args.model,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        profile_steps=True,
        structured_output_backend=args.backend,
        structured_output_processes=args.processes,
    )
    engine = llm.engine
    # Kernels, and the grammar's tokenizer.
    llm.generate(warm_up, [params[i % len(params)] for i in range(len(warm_up))])
    engine.reset_step_profile()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    profile = engine.step_profile()
    tokens = sum(o.num_completion_tokens for o in outs)
    line = {
        "leg": name,
        "rows": len(outs),
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "tok_per_s": round(tokens / seconds, 1),
        "finish_reasons": dict(collections.Counter(o.finish_reason for o in outs)),
        "profile": profile,
    }
    engine.close()
    del llm, engine
    free_device()
    return line, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL, help="a model alias or path")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument(
        "--schema", choices=sorted(SCHEMAS), default="typical", help="bounded: maxLength strings"
    )
    parser.add_argument(
        "--backend", choices=("llguidance", "xgrammar"), default="llguidance",
        help="the engine's structured_output_backend",
    )  # fmt: skip
    parser.add_argument(
        "--processes", type=int, default=None,
        help="the engine's structured_output_processes (0: grammars in the engine's process; "
        "default: the engine's, on CUDA a worker per two CPU cores up to 8)",
    )  # fmt: skip
    parser.add_argument(
        "--warm-up", type=int, help="prompts each engine runs before it is timed "
        "(default: max_num_seqs)",
    )  # fmt: skip
    parser.add_argument(
        "--repeat", type=int, default=1,
        help="run the structured and matched legs this many times, alternating (the plain "
        "leg once), and judge the goal on the median of the pairs' ratios: one machine's "
        "host speed moves by a fifth from one run to the next",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    warm_rows = args.max_num_seqs if args.warm_up is None else args.warm_up
    schema = SCHEMAS[args.schema]

    prompts = tokenize(args.model, args.requests + warm_rows)
    prompts, warm_up = prompts[: args.requests], prompts[args.requests :]
    n = len(prompts)
    plain = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    structured = SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, structured_output=schema
    )
    plain_line, plain_outs = run_leg("plain", args, prompts, [plain] * n, warm_up)
    print(json.dumps(plain_line), flush=True)
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    runs: list[list[RequestOutput]] = []  # each structured run's outputs
    for _ in range(args.repeat):
        line, run = run_leg("structured", args, prompts, [structured] * n, warm_up)
        print(json.dumps(line), flush=True)
        matched = [
            SamplingParams(max_tokens=max(1, len(o.token_ids)), temperature=0.0, ignore_eos=True)
            for o in run
        ]
        twin, _ = run_leg("plain_matched", args, prompts, matched, warm_up)
        print(json.dumps(twin), flush=True)
        pairs.append((line, twin))
        runs.append(run)

    how, error = validator(schema)
    rows = [o for run in runs for o in run]  # every structured run's rows
    errors = [error(o.text) for o in rows]
    bad = [(i % n, e, rows[i].text) for i, e in enumerate(errors) if e is not None]
    structured_tps = [line["tok_per_s"] for line, _ in pairs]
    ratios_matched = [line["tok_per_s"] / twin["tok_per_s"] for line, twin in pairs]
    ratio = statistics.median(structured_tps) / plain_line["tok_per_s"]
    matched = statistics.median(ratios_matched)
    valid = 1 - len(bad) / len(errors)
    summary = {
        "model": args.model,
        "device": args.device,
        "requests": args.requests,
        "max_num_seqs": args.max_num_seqs,
        "max_tokens": args.max_tokens,
        "schema": args.schema,
        "backend": args.backend,
        "processes": pairs[0][0]["profile"]["structured_output"]["processes"],
        "ratio": round(ratio, 3),
        "ratio_matched": round(matched, 3),  # the median over the pairs
        "ratios_matched": [round(r, 3) for r in ratios_matched],
        "valid_share": round(valid, 4),
        "validated_with": how,
        # The model unconstrained, for contrast: how often it writes valid JSON by itself.
        "plain_rows_valid": sum(error(o.text) is None for o in plain_outs),
        "first_invalid": [{"row": i, "error": e, "text": t[:200]} for i, e, t in bad[:3]],
        "goal": {"ratio": GOAL_RATIO, "valid_share": GOAL_VALID},
        # Judged on the same tokens generated (see the module docstring).
        "goal_met": matched >= GOAL_RATIO and valid >= GOAL_VALID,
    }
    print(json.dumps(summary), flush=True)
    if args.json:
        legs = {
            "plain": plain_line,
            "structured": [line for line, _ in pairs],
            "plain_matched": [twin for _, twin in pairs],
        }
        args.json.write_text(json.dumps({"legs": legs, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
