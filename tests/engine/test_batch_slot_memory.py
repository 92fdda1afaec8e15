"""max_num_seqs whose batch slots cannot fit the host: refused, named, before any loading."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import save_tiny_model
from tokenmill import LLM
from tokenmill.engine import batch_slot_memory, llm_engine
from tokenmill.engine.batch_slot_memory import check_slots_fit
from tokenmill.engine.engine_config import EngineSettingError


def test_slots_past_the_hosts_memory_name_max_num_seqs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_slot_memory, "host_memory", lambda: (8 << 30, 4 << 30))
    check_slots_fit(1 << 20, 1024)  # exactly the 4 GiB available
    said = r"^max_num_seqs: expected at most 1048576 here: each request's batch slot keeps "
    with pytest.raises(EngineSettingError, match=said) as info:
        check_slots_fit((1 << 20) + 1, 1024)
    assert info.value.key == "max_num_seqs"


def test_llm_refuses_huge_max_num_seqs_before_the_weights_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An audit: LLM(max_num_seqs=10**12) loaded the weights and then failed in numpy
    ("Unable to allocate 931. TiB" for the batch slots); in a job, it blamed
    engine.kv_cache_memory for the activations max_num_seqs sizes."""
    path = save_tiny_model("llama", tmp_path / "m")

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(llm_engine, "build_model", no_load)
    with pytest.raises(EngineSettingError, match=r"^max_num_seqs: expected at most \d+ here"):
        LLM(str(path), device="cpu", max_num_seqs=10**12)
