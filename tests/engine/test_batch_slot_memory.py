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


def test_a_full_steps_logits_on_cpu_count_against_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An audit: max_num_seqs and max_num_batched_tokens of 50,000 with a 100,000-token
    vocabulary on CPU loaded the weights, then failed in the first full step
    ("DefaultCPUAllocator: can't allocate memory"); a step's logits take 12 bytes an entry."""
    monkeypatch.setattr(batch_slot_memory, "host_memory", lambda: (8 << 30, 4 << 30))
    row = 1000 * 12 + 1024 * 4  # a 1000-token vocabulary's logits, 1024 token ids
    fits = (4 << 30) // row
    check_slots_fit(fits, 1024, host_logits_vocab=1000, max_num_batched_tokens=10**9)
    said = rf"^max_num_seqs: expected at most {fits} here: .* on CPU a step's logits take 12000 "
    with pytest.raises(EngineSettingError, match=said):
        check_slots_fit(fits + 1, 1024, host_logits_vocab=1000, max_num_batched_tokens=10**9)
    # past max_num_batched_tokens rows the logits stop growing: only the slots do
    check_slots_fit(fits + 1, 1024, host_logits_vocab=1000, max_num_batched_tokens=8192)
    check_slots_fit(fits + 1, 1024, host_logits_vocab=0, max_num_batched_tokens=10**9)  # a GPU
    with pytest.raises(EngineSettingError, match=r"^max_num_batched_tokens: expected at most"):
        check_slots_fit(10**7, 16, host_logits_vocab=10**6, max_num_batched_tokens=10**6)


def test_llm_refuses_cpu_logits_past_the_host_before_the_weights_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = save_tiny_model("llama", tmp_path / "m", vocab_size=100_000)
    monkeypatch.setattr(batch_slot_memory, "host_memory", lambda: (8 << 30, 4 << 30))

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(llm_engine, "build_model", no_load)
    with pytest.raises(EngineSettingError, match=r"^max_num_seqs: .* 100000-token vocabulary"):
        LLM(str(path), device="cpu", max_num_seqs=50_000, max_num_batched_tokens=50_000)


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
