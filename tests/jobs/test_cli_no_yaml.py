"""run-job without a job.yaml: ``--model``, ``--input``, ``--output`` and ``--set`` build the
JobSpec a job.yaml with those keys would, checked by the same validation."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.jobs.job_helpers import read_jsonl_dir, write_jsonl
from tokenmill.jobs.cli import main as cli_main
from tokenmill.jobs.spec import JobSpec

# Small enough for the tiny model on a CPU; every --set value is read as YAML.
_ENGINE = [
    "--set",
    "engine.device=cpu",
    "--set",
    "engine.max_num_seqs=8",
    "--set",
    f"engine.kv_cache_memory={16 << 20}",
]


def _prompts(tmp_path: Path, n: int = 5) -> Path:
    rows = [{"id": f"p{i}", "prompt": f"count to {i}:"} for i in range(n)]
    return write_jsonl(tmp_path / "in.jsonl", rows)


def test_flags_build_the_spec_a_job_yaml_would(tiny_model: Path, tmp_path: Path) -> None:
    src, out = _prompts(tmp_path), tmp_path / "out"
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "model": {"source": str(tiny_model)},
                "input": {"path": str(src)},
                "output": {"path": str(out), "format": "jsonl"},
                "sampling": {"max_tokens": 3},
                "engine": {"max_num_seqs": 128},
            }
        )
    )
    from_flags = JobSpec.from_settings(
        {"model.source": str(tiny_model), "input.path": str(src), "output.path": str(out)},
        ["output.format=jsonl", "sampling.max_tokens=3", "engine.max_num_seqs=128"],
    )
    assert from_flags == JobSpec.load(job)
    # Flags over a job.yaml: taken as given (a path like "123" stays a string), then --set.
    moved = JobSpec.load(job, ["sampling.max_tokens=9"], {"output.path": "123"})
    assert (moved.output.path, moved.sampling.max_tokens) == ("123", 9)


def test_run_job_from_flags_runs_and_resumes(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, out = _prompts(tmp_path), tmp_path / "out"
    argv = ["--model", str(tiny_model), "--input", str(src), "--output", str(out), "--quiet"]
    argv += [*_ENGINE, "--set", "sampling.max_tokens=3", "--set", "output.format=jsonl"]
    assert cli_main(argv) == 0
    rows = read_jsonl_dir(out / "shards")
    assert sorted(r["id"] for r in rows) == [f"p{i}" for i in range(5)]
    assert all(1 <= r["completion_tokens"] <= 3 for r in rows)
    assert (out / "job.manifest.json").exists()  # a job without a YAML is named "job"
    capsys.readouterr()
    assert cli_main(argv) == 0  # the same command again: already complete
    assert "nothing to do: all 5 rows already committed" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("sampling.bogus=1", "sampling.bogus: unknown key"),
        ("sampling.max_tokens=lots", "sampling.max_tokens: expected an integer"),
        ("engine.max_num_seqs=0", "engine.max_num_seqs"),
        ("bogus_section.x=1", "bogus_section: unknown key"),
    ],
)
def test_bad_keys_and_values_exit_2_naming_the_key(
    tiny_model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    override: str,
    message: str,
) -> None:
    src, out = _prompts(tmp_path), tmp_path / "out"
    argv = ["--model", str(tiny_model), "--input", str(src), "--output", str(out)]
    assert cli_main([*argv, "--set", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("run-job: command line: invalid job spec:") and message in err
    assert not out.exists()


def test_a_missing_flag_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["--model", "m", "--output", str(tmp_path / "out")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: run-job" in err and "(missing: --input)" in err
    # --set of the same key stands in for the flag.
    assert cli_main(["--model", "m", "--output", "o", "--set", "input.path=''"]) == 2
    assert "input.path: must not be empty" in capsys.readouterr().err


def test_help_shows_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "--model M --input PATH --output PATH" in text and "--set KEY.PATH=VALUE" in text
