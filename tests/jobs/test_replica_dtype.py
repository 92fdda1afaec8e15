"""A Ray run's resolved dtype, decided without a cluster: what the replicas resolve
model.dtype auto to on a GPU or a CPU, and the resume it refuses or records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.jobs.job_helpers import job_dict
from tokenmill.io.storage import OutputStore
from tokenmill.jobs.manifest import FingerprintMismatchError, Manifest
from tokenmill.jobs.replica_dtype import check_replica_dtype, replica_dtype
from tokenmill.jobs.spec import JobSpec


def _spec(model: Path, tmp_path: Path, dtype: str = "auto") -> JobSpec:
    raw = job_dict(model, tmp_path / "in.jsonl", tmp_path / "out")
    raw["model"]["dtype"] = dtype
    return JobSpec.from_dict(raw)


def test_replicas_resolve_auto_by_their_device(tiny_model: Path, tmp_path: Path) -> None:
    stored = json.loads((tiny_model / "config.json").read_text()).get("torch_dtype", "bfloat16")
    on_gpu = "bfloat16" if stored == "float32" else stored  # (resolve_dtype's rule)
    assert replica_dtype(_spec(tiny_model, tmp_path), on_gpu=True) == on_gpu
    assert replica_dtype(_spec(tiny_model, tmp_path), on_gpu=False) == "float32"
    assert replica_dtype(_spec(tiny_model, tmp_path, "float16"), on_gpu=True) is None


def test_another_dtype_is_refused_and_a_missing_one_recorded(tmp_path: Path) -> None:
    store = OutputStore(str(tmp_path / "out"))
    manifest = Manifest("test", "fp", 4, settings={"dtype": "auto", "resolved_dtype": "float32"})
    with pytest.raises(FingerprintMismatchError) as info:
        check_replica_dtype(manifest, "bfloat16", store, lambda: None)
    message = str(info.value)
    assert 'resolved_dtype: "float32" -> "bfloat16" (model.dtype auto on another' in message
    assert "Rerun with --fresh" in message

    held: list[bool] = []
    manifest = Manifest("test", "fp", 4, settings={"dtype": "auto"})
    check_replica_dtype(manifest, "bfloat16", store, lambda: held.append(True))
    assert held and Manifest.load(store, "test").settings["resolved_dtype"] == "bfloat16"
