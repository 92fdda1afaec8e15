"""`run-job` against `LLM.chat` and HF `generate` on the same chat prompts (issue 12, item 3).

Goal: the embedded SmolLM2 (smollm2-135m-instruct), natural EOS, 20,000 chat prompts through
`run-job` with Parquet output at >= 5x HF `generate` (static batches of 512, same prompts),
and `run-job` within 10% of `LLM.chat` on the same prompts, in the same run.

Three systems, one after the other, each on its own engine (or model), greedy, same
max_tokens, EOS ends a row:

  run-job   the prompts as a JSONL input (id, messages) and a job.yaml with Parquet output,
            run through the runner API (`tokenmill.run_job`, what the CLI calls) in this
            process: spec checks, fingerprint, row count, model load, reading, templating,
            tokenizing, generation, Parquet encoding and commits, report. Its time for the
            ratio is the job's wall time less the model load (both reported).
  LLM.chat  the same engine settings; `llm.chat(conversations, params)` (templating and
            tokenizing included); model load reported apart.
  hf        transformers `generate` on the same model file (GGUF dequantized by
            transformers), the same prompt token ids left-padded, static batches of
            --peer-batch; a batch runs until its last row ends.

A warm-up `LLM.chat` runs first (its engine freed), so that no system pays for kernel
compilation: on the first 4 x max_num_seqs prompts at the run's max_tokens, which reach the
run's shapes (mixed steps with cached prefixes, long decode contexts). A warm-up of 8 short
prompts left ~2.7 s of Triton compiles inside the first timed leg on a fresh H200 (session
19). One JSON line per system (output tokens, seconds, tok/s), then one
with the ratios and whether the goals hold; ``--json`` also writes them all to a file.

    PYTHONPATH=. python bench/job_throughput.py --requests 64 --max-tokens 16 --device cpu
    PYTHONPATH=. python bench/job_throughput.py --device cuda --max-num-seqs 512   # the goal

HF on 20,000 prompts takes minutes; ``--legs`` runs a subset (HF needs LLM.chat's prompt
token ids, so ``chat`` runs whenever ``hf`` does), for machines that limit one command's time.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.hf_peer import left_padded, load_hf_model  # noqa: E402
from bench.prompts import chat_prompts, write_chat_jsonl  # noqa: E402
from tokenmill.engine.engine_config import EngineConfig  # noqa: E402

MODEL = "smollm2-135m-instruct"
GOAL_VS_HF = 5.0  # run-job at least this many times HF generate's tok/s
GOAL_VS_CHAT = 0.9  # run-job within 10% of LLM.chat


def _require_job_dependencies() -> None:
    """run-job reads and writes through pyarrow, pyyaml, pydantic and fsspec: name the one
    missing instead of failing deep inside an import."""
    missing = []
    for module in ("pyarrow", "yaml", "pydantic", "fsspec"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise SystemExit(
            f"job_throughput: run-job needs {', '.join(missing)} (not importable here): "
            "install them (pip install pyarrow pyyaml pydantic fsspec), or run "
            "bench/host_overhead.py for the engine alone"
        )


def _free_device() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def write_job(
    folder: Path, convs: list[list[dict[str, str]]], engine: dict[str, Any], args: Any
) -> dict[str, Any]:
    """The JSONL input and the job spec (also saved as job.yaml, for rerunning by hand)."""
    import yaml

    data = write_chat_jsonl(folder / "prompts.jsonl", convs)
    spec = {
        "name": "job-throughput",
        "model": {"source": args.model},
        "input": {"path": str(data), "messages_column": "messages", "prompt_column": None},
        "sampling": {"max_tokens": args.max_tokens, "temperature": 0.0},
        "output": {
            "path": str(folder / "out"),
            "format": "parquet",
            "rows_per_shard": args.rows_per_shard,
        },
        "engine": engine,
        # bench/prompts.py repeats its conversations (20,000 of them hold 432 distinct ones):
        # dedup would run each once, and this bench compares the same work on every leg
        "planner": {"dedup": False},
    }
    (folder / "job.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return spec


def run_job_leg(spec: dict[str, Any], folder: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """(result line, {id: text}) of one run-job run."""
    import pyarrow.parquet as pq

    from tokenmill import run_job

    start = time.perf_counter()
    report = run_job(spec, show_progress=False)
    wall = time.perf_counter() - start
    if report.status != "complete" or report.rows_failed:
        raise SystemExit(f"run-job did not complete cleanly: {report.summary()}")
    seconds = wall - report.model_load_seconds
    texts: dict[str, str] = {}
    for path in sorted((folder / "out" / "shards").glob("*.parquet")):
        table = pq.read_table(path, columns=["id", "text"])
        ids, text = table.column("id").to_pylist(), table.column("text").to_pylist()
        texts.update(zip(ids, text, strict=True))
    line = {
        "system": "run-job",
        "requests": report.rows_ok,
        "output_tokens": report.completion_tokens,
        "seconds": round(seconds, 3),
        "tok_per_s": round(report.completion_tokens / seconds, 1),
        "model_load_s": round(report.model_load_seconds, 3),
        "end_to_end_s": round(wall, 3),
        "shards": report.shards_committed,
    }
    return line, texts


def chat_leg(
    convs: list[list[dict[str, str]]], engine: dict[str, Any], max_tokens: int, model: str
) -> tuple[dict[str, Any], dict[str, str], list[list[int]], tuple[int, ...]]:
    """(result line, {id: text}, prompt token ids, EOS ids) of LLM.chat on ``convs``."""
    from tokenmill import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model, **engine)
    load = time.perf_counter() - start
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    start = time.perf_counter()
    outs = llm.chat(convs, params)
    seconds = time.perf_counter() - start
    tokens = sum(o.num_completion_tokens for o in outs)
    prompts = [list(o.prompt_token_ids) for o in outs]
    texts = {f"p{i:06d}": o.text for i, o in enumerate(outs)}  # the ids write_job gives
    eos = llm.engine.eos_token_ids
    llm.engine.close()  # its output worker; then its KV cache goes before the next one loads
    del llm, outs
    line = {
        "system": "LLM.chat",
        "requests": len(convs),
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "tok_per_s": round(tokens / seconds, 1),
        "model_load_s": round(load, 3),
        "end_to_end_s": round(load + seconds, 3),
    }
    return line, texts, prompts, eos


def hf_leg(
    model: str,
    prompts: list[list[int]],
    eos: tuple[int, ...],
    batch: int,
    max_tokens: int,
    device: str,
) -> dict[str, Any]:
    """HF generate over static batches of ``batch`` left-padded prompts, greedy, stopping a
    row at its first EOS (a batch runs until every row has stopped or hit ``max_tokens``)."""
    from tokenmill.engine.loader import resolve_model_source

    start = time.perf_counter()
    hf = load_hf_model(resolve_model_source(model).path, device)
    load = time.perf_counter() - start
    pad = eos[0]
    eos_set = set(eos)
    tokens = 0
    with torch.inference_mode():
        warm = torch.tensor([prompts[0]], device=device)
        hf.generate(warm, max_new_tokens=2, do_sample=False, pad_token_id=pad)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        for at in range(0, len(prompts), batch):
            ids, mask = left_padded(prompts[at : at + batch], pad)
            width = ids.shape[1]
            out = hf.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=list(eos),
            )
            for row in out[:, width:].tolist():  # up to and including the first EOS
                ended = next((i for i, t in enumerate(row) if t in eos_set), None)
                tokens += len(row) if ended is None else ended + 1
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    del hf
    return {
        "system": "hf-generate",
        "batch": batch,
        "requests": len(prompts),
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "tok_per_s": round(tokens / seconds, 1),
        "model_load_s": round(load, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL, help="alias, HF directory or .gguf file")
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: the engine's")
    parser.add_argument(
        "--kv-cache-memory", type=float, default=None, help="bytes, or a fraction of the GPU"
    )
    parser.add_argument("--rows-per-shard", type=int, default=1000)
    parser.add_argument("--peer-batch", type=int, default=512, help="HF generate's batch")
    parser.add_argument("--no-peer", action="store_true", help="skip HF generate")
    parser.add_argument(
        "--legs", default="chat,run-job,hf", help="which of chat, run-job, hf to run"
    )
    parser.add_argument("--json", type=Path, help="also write every result line here")
    args = parser.parse_args()
    legs = set(args.legs.split(","))
    if args.no_peer:
        legs.discard("hf")
    if legs - {"chat", "run-job", "hf"} or "chat" not in legs:
        parser.error(f"--legs {args.legs!r}: a subset of chat,run-job,hf that includes chat")
    if "run-job" in legs:
        _require_job_dependencies()

    engine: dict[str, Any] = {"device": args.device}
    if args.max_num_seqs is not None:
        engine["max_num_seqs"] = args.max_num_seqs
    if args.kv_cache_memory is not None:
        kv = args.kv_cache_memory
        engine["kv_cache_memory"] = int(kv) if kv > 1 else kv
    convs = chat_prompts(args.requests)
    lines: list[dict[str, Any]] = []

    def emit(line: dict[str, Any]) -> None:
        lines.append(line)
        print(json.dumps(line), flush=True)

    warm_rows = 4 * engine.get("max_num_seqs", EngineConfig.max_num_seqs)
    chat_leg(convs[:warm_rows], engine, args.max_tokens, args.model)  # warm-up
    _free_device()
    chat, chat_texts, prompts, eos = chat_leg(convs, engine, args.max_tokens, args.model)
    _free_device()
    emit(chat)
    summary: dict[str, Any] = {
        "model": args.model,
        "device": args.device,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "engine": engine,
    }
    job = None
    if "run-job" in legs:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            job, job_texts = run_job_leg(write_job(folder, convs, engine, args), folder)
        _free_device()
        emit(job)
        same = sum(job_texts.get(k) == v for k, v in chat_texts.items())
        summary["run_job_vs_chat"] = round(job["tok_per_s"] / chat["tok_per_s"], 3)
        summary["same_output_tokens"] = job["output_tokens"] == chat["output_tokens"]
        summary["same_text_share"] = round(same / len(chat_texts), 4)  # greedy: 1.0 barring ties
        summary["goal_vs_chat_met"] = summary["run_job_vs_chat"] >= GOAL_VS_CHAT
    if "hf" in legs:
        hf = hf_leg(args.model, prompts, eos, args.peer_batch, args.max_tokens, args.device)
        emit(hf)
        summary["chat_vs_hf"] = round(chat["tok_per_s"] / hf["tok_per_s"], 2)
        if job is not None:
            summary["run_job_vs_hf"] = round(job["tok_per_s"] / hf["tok_per_s"], 2)
            summary["goal_vs_hf_met"] = summary["run_job_vs_hf"] >= GOAL_VS_HF
    emit(summary)
    if args.json:
        args.json.write_text(json.dumps(lines, indent=1))


if __name__ == "__main__":
    main()
