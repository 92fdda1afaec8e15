"""``run-job`` with quantized weights and KV cache on CPU: every way a quantized model comes
(FP8 at load from a float checkpoint, an FP8 KV cache, a GPTQ int4 directory, a GGUF file's
Q4_1 and Q8_0 blocks) runs a job end to end, and each row's text is what ``LLM.chat`` gives
with the same model and settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.engine.loader.int4_checkpoints import write_int4_checkpoint
from tests.engine.loader.tiny_gguf import tokenizer_metadata, write_tiny_gguf
from tests.jobs.job_helpers import chat_rows, job_dict, read_jsonl_dir, write_jsonl
from tokenmill import LLM, SamplingParams, run_job

ROWS = 6


def _model(case: str, tiny_model: Path, folder: Path) -> Path:
    if case in ("gptq", "gptq-act-order"):
        act_order = case == "gptq-act-order"
        return write_int4_checkpoint(tiny_model, folder / case, "gptq", 32, act_order=act_order)[0]
    if case in ("q4_1", "q8_0"):
        out = folder / f"tiny.{case}.gguf"
        extra = tokenizer_metadata(tiny_model)
        return write_tiny_gguf(tiny_model, out, extra=extra, linear_type=case.upper())
    return tiny_model


# case: (model section, engine section, the linear layers' method)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    "fp8": ({"quantization": "fp8"}, {}, "Fp8Method"),
    "fp8-kv": ({"quantization": "fp8"}, {"kv_cache_dtype": "fp8"}, "Fp8Method"),
    "gptq": ({}, {}, "Int4Method"),  # a GPTQ checkpoint runs as int4 whatever is asked
    "gptq-act-order": ({}, {}, "Int4Method"),  # desc_act: each layer reorders its input
    "q4_1": ({"quantization": "int4"}, {}, "Int4Method"),
    "q8_0": ({"quantization": "int8"}, {}, "Int8Method"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_quantized_model_runs_a_job_with_llm_chats_text(
    case: str, tiny_model: Path, tmp_path: Path
) -> None:
    model = _model(case, tiny_model, tmp_path)
    model_section, engine_section, method = CASES[case]
    rows = chat_rows(ROWS)
    spec = job_dict(model, write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out")
    spec["model"].update(model_section)
    spec["engine"].update(engine_section)
    report = run_job(spec, show_progress=False)
    assert report.status == "complete" and report.rows_ok == ROWS
    got = {r["id"]: r["text"] for r in read_jsonl_dir(tmp_path / "out" / "shards")}

    engine = {**spec["engine"], **model_section}
    llm = LLM(str(model), dtype="float32", **engine)
    params = SamplingParams(**spec["sampling"])
    want = {
        r["id"]: o.text
        for r, o in zip(rows, llm.chat([r["messages"] for r in rows], params), strict=True)
    }
    assert got == want
    layer = llm.engine.runner.model.model.layers[0].mlp.down_proj
    assert type(layer.quant_method).__name__ == method
