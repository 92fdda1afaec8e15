"""job.yaml's planner section: defaults, strict values refused naming the key (exit 2 from
run-job), and no part in the job fingerprint (a resume may change it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tokenmill.jobs.cli import main as cli_main
from tokenmill.jobs.fingerprint import job_settings
from tokenmill.jobs.runner import feed_plan
from tokenmill.jobs.spec import JobSpec, JobSpecError
from tokenmill.scheduling.planner_settings import PlannerSettings


def _raw(**planner: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "model": {"source": "some-model"},
        "input": {"path": "in.jsonl"},
        "output": {"path": "out/"},
    }
    if planner:
        raw["planner"] = planner
    return raw


def test_defaults_order_by_length_and_deduplicate() -> None:
    spec = JobSpec.from_dict(_raw())
    assert spec.planner.settings() == PlannerSettings() == PlannerSettings("length", 2048, True)
    plan = feed_plan(JobSpec.from_dict(_raw(order="input", window=16, dedup=False)))
    assert plan.settings == PlannerSettings("input", 16, False)
    assert plan.prefill_tokens_per_step == spec.engine.max_num_batched_tokens
    assert plan.sampling_defaults["max_tokens"] == spec.sampling.max_tokens


@pytest.mark.parametrize(
    ("planner", "message"),
    [
        ({"order": "shortest"}, "planner.order: must be 'length' or 'input', got the string"),
        ({"window": 0}, "planner.window: must be greater than or equal to 1, got 0"),
        ({"window": 10**7}, "planner.window: must be less than or equal to 1000000"),
        ({"window": "64"}, "planner.window: expected an integer, got the string '64'"),
        ({"window": True}, "planner.window: expected an integer, got true"),
        ({"dedup": "yes"}, "planner.dedup: expected true or false, got the string 'yes'"),
        ({"shuffle": True}, "planner.shuffle: unknown key"),
    ],
)
def test_bad_values_are_refused_naming_the_key(planner: dict[str, Any], message: str) -> None:
    with pytest.raises(JobSpecError) as info:
        JobSpec.from_dict(_raw(**planner), "job.yaml")
    assert message in str(info.value)


def test_run_job_exits_2_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(_raw(window=-3)))
    assert cli_main([str(job)]) == 2
    assert "planner.window" in capsys.readouterr().err
    job.write_text(yaml.safe_dump(_raw()))
    assert cli_main([str(job), "--set", "planner.order=random"]) == 2
    assert "planner.order" in capsys.readouterr().err


def test_the_planner_is_not_in_the_fingerprint(tmp_path: Path) -> None:
    """It changes no result, so a resume may change it."""
    (tmp_path / "config.json").write_text("{}")
    settings = [
        job_settings(JobSpec.from_dict(_raw(**p)), tmp_path, None, "input-fp")
        for p in ({}, {"order": "input", "window": 5, "dedup": False})
    ]
    assert settings[0] == settings[1]
    with pytest.raises(ValueError, match="planner.window"):
        PlannerSettings(window=0)
