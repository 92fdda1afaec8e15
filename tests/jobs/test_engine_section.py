"""job.yaml's engine section: EngineConfig's fields and rules, the ``prefix_caching`` alias."""

from __future__ import annotations

import logging
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tokenmill.engine.engine_config import EngineConfig
from tokenmill.jobs.cli import main as cli_main
from tokenmill.jobs.engine_section import ELSEWHERE, NOT_IN_SECTION, EngineSection
from tokenmill.jobs.fingerprint import fingerprint, job_settings
from tokenmill.jobs.local_executor import engine_config
from tokenmill.jobs.spec import JobSpec, JobSpecError


def _raw(**engine: Any) -> dict[str, Any]:
    return {
        "model": {"source": "some-model", "dtype": "float32"},
        "input": {"path": "in.jsonl"},
        "output": {"path": "out/"},
        "engine": engine,
    }


def _error(raw: dict[str, Any]) -> str:
    with pytest.raises(JobSpecError) as info:
        JobSpec.from_dict(raw, "job.yaml")
    return str(info.value)


def test_the_section_is_engine_configs_fields_and_defaults() -> None:
    declared = {f.name: f.default for f in fields(EngineConfig) if f.name not in NOT_IN_SECTION}
    assert set(EngineSection.model_fields) == set(declared)
    # A nested group (speculative) dumps as the mapping job.yaml spells it.
    dumped = {k: asdict(v) if is_dataclass(v) else v for k, v in declared.items()}
    assert EngineSection().model_dump() == dumped
    spec = JobSpec.from_dict(_raw(max_num_seqs=4, enable_prefix_caching=False))
    assert engine_config(spec) == EngineConfig(
        model="some-model", dtype="float32", max_num_seqs=4, enable_prefix_caching=False
    )


@pytest.mark.parametrize(
    ("key", "value", "what"),
    [
        ("max_num_seqs", 0, "expected a positive integer, got 0"),
        ("max_num_batched_tokens", -8, "expected a positive integer, got -8"),
        ("block_size", 24, "expected a power of two from 1 to 2**30 ("),
        (
            "block_size",
            2**40,
            "the attention kernels count keys in int32; 16 to 128 are usual), got",
        ),
        ("max_model_len", 1, "expected an integer >= 2, or unset for the model's own"),
        ("kv_cache_memory", 0, "a number in (0, 1]), got 0"),
        ("kv_cache_memory", 1.5, "a number in (0, 1]), got 1.5"),
        ("kv_cache_memory", float("inf"), "got inf"),
        ("device", "cuda:128", "expected one of auto, cpu, cuda, cuda:<n>"),
        ("device", "mps", "got the string 'mps'"),
    ],
)
def test_out_of_range_values_name_the_engine_key(key: str, value: Any, what: str) -> None:
    message = _error(_raw(**{key: value}))
    line = message.splitlines()[1]
    assert line.startswith(f"  engine.{key}: expected "), message
    assert what in line, message


def test_keys_outside_the_section_stay_unknown() -> None:
    for key in ("max_num_seq", "attention_backend", "dtype", "model"):
        assert f"  engine.{key}: unknown key" in _error(_raw(**{key: "auto"}))


def test_an_llm_setting_the_section_lacks_says_where_a_job_sets_it() -> None:
    """An audit: engine.dtype (LLM(dtype=...)'s spelling) or vLLM's gpu_memory_utilization
    said "unknown key" alone; LLM takes them, so say where a job sets them, if anywhere."""
    said = {
        "dtype": "model.dtype sets it",
        "quantization": "model.quantization sets it",
        "seed": "an LLM(...) setting only; rows are seeded by sampling.seed",
        "gpu_memory_utilization": "vLLM's name: engine.kv_cache_memory takes the fraction",
        "enforce_eager": "vLLM's name: engine.cuda_graphs: false",
    }
    for key, where in said.items():
        assert f"  engine.{key}: unknown key ({where})\n" in _error(_raw(**{key: 1})) + "\n"
    assert NOT_IN_SECTION <= ELSEWHERE.keys()  # each EngineConfig field a job lacks is said


def test_max_model_len_auto_is_unset() -> None:
    spec = JobSpec.from_dict(_raw(max_model_len="auto"))
    assert spec.engine.max_model_len is None and engine_config(spec).max_model_len is None
    assert JobSpec.from_dict(spec.to_dict()) == spec  # null, as the Ray replicas read it back
    assert JobSpec.from_dict(_raw(max_model_len=512)).engine.max_model_len == 512


def test_old_prefix_caching_key_loads_with_a_warning(caplog, tmp_path: Path) -> None:
    with caplog.at_level(logging.WARNING, logger="tokenmill.jobs.engine_section"):
        old = JobSpec.from_dict(_raw(prefix_caching=False), "jobs/a.yaml")
    assert old.engine.enable_prefix_caching is False
    assert "prefix_caching" not in old.to_dict()["engine"]
    (warning,) = caplog.records
    assert warning.levelno == logging.WARNING
    assert warning.getMessage() == (
        "jobs/a.yaml: engine.prefix_caching is deprecated; "
        "rename it to engine.enable_prefix_caching"
    )
    new = JobSpec.from_dict(_raw(enable_prefix_caching=False))
    assert old == new
    # An output written under the old key resumes under the new one: same fingerprint.
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    settings = [job_settings(spec, model, None, "input") for spec in (old, new)]
    assert fingerprint(settings[0]) == fingerprint(settings[1])


def test_old_and_new_prefix_caching_keys_together_are_refused(tmp_path: Path, capsys) -> None:
    message = _error(_raw(prefix_caching=True, enable_prefix_caching=True))
    assert message.splitlines()[1].startswith("  engine: both prefix_caching and ")
    assert "enable_prefix_caching" in message.splitlines()[1]
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(_raw(enable_prefix_caching=False)))
    assert cli_main([str(job), "--set", "engine.prefix_caching=true"]) == 2
    err = capsys.readouterr().err
    assert str(job) in err and "prefix_caching" in err and "enable_prefix_caching" in err


def test_readme_job_yaml_reference_gives_the_engine_defaults() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("### job.yaml reference", 1)[1].split("```yaml\n", 1)[1]
    raw = yaml.safe_load(block.split("```", 1)[0])
    assert set(raw["engine"]) == set(EngineSection.model_fields)
    assert JobSpec.from_dict(raw, "README.md").engine == EngineSection()


def test_an_unknown_speculative_key_reads_as_every_section_s_unknown_key() -> None:
    """An audit: ``speculative: {max_token: 3}`` said "expected no such key (the keys:
    ...), got 3", where every other section says "unknown key" and suggests the key meant."""
    error = _error(_raw(speculative={"max_token": 3, "method": "ngram"}))
    assert error.splitlines()[1] == (
        "  engine.speculative.max_token: unknown key (did you mean engine.speculative.max_tokens?)"
    )
    assert error.splitlines()[1:] == [error.splitlines()[1]]  # one error line
    assert _error(_raw(speculative={"zzz": 1})).endswith("  engine.speculative.zzz: unknown key")
