"""A failed submit() job's handle keeps its error for result(), not the job's engine: the
error's traceback held the frames whose locals were the engine (weights and KV cache)."""

from __future__ import annotations

import gc
import traceback
import weakref
from pathlib import Path

import pytest

from tests.jobs.job_helpers import chat_rows, job_dict, write_jsonl
from tests.tiny_models import save_tiny_model
from tokenmill import submit
from tokenmill.engine import llm_engine
from tokenmill.jobs.spec import JobSpecError


def test_a_failed_handle_does_not_keep_the_engine(tmp_path: Path, monkeypatch) -> None:
    # A context longer than the KV cache holds: the job fails once its engine is loaded.
    model = save_tiny_model("llama", tmp_path / "m", max_position_embeddings=4096)
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(2))
    engines: weakref.WeakSet = weakref.WeakSet()
    init = llm_engine.LLMEngine.__init__

    def tracked(self, *args, **kwargs):
        engines.add(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", tracked)
    spec = job_dict(model, src, tmp_path / "out", engine={"kv_cache_memory": 1 << 20})
    handle = submit(spec)
    assert handle.wait(120) and handle.status() == "failed"
    gc.collect()
    assert len(engines) == 0  # the handle (alive) holds no engine
    with pytest.raises(JobSpecError, match="KV cache holds") as caught:
        handle.result()
    text = "".join(traceback.format_exception(caught.value))
    assert "_load_engine" in text  # the traceback still names where it failed
