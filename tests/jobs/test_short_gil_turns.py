"""short_gil_turns: a job's engine loop, and LLM's, runs with 0.5 ms GIL turns, and leaves the
interval as it found it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.jobs.job_helpers import chat_rows, job_dict, write_jsonl
from tests.tiny_models import save_tiny_model
from tokenmill import LLM, SamplingParams, run_job
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.short_gil_turns import TURN_S, short_gil_turns


@pytest.fixture
def default_interval() -> Iterator[float]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield 0.005
    sys.setswitchinterval(before)


def test_turns_are_short_inside_and_restored_after(default_interval: float) -> None:
    with short_gil_turns():
        assert sys.getswitchinterval() == pytest.approx(TURN_S)
        with short_gil_turns():  # re-entrant
            assert sys.getswitchinterval() == pytest.approx(TURN_S)
        assert sys.getswitchinterval() == pytest.approx(TURN_S)
    assert sys.getswitchinterval() == pytest.approx(default_interval)


def test_a_shorter_interval_set_by_someone_else_is_kept(default_interval: float) -> None:
    sys.setswitchinterval(TURN_S / 5)
    theirs = sys.getswitchinterval()  # CPython keeps whole microseconds
    with short_gil_turns():
        assert sys.getswitchinterval() == theirs
    assert sys.getswitchinterval() == theirs


def _record_step_intervals(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The switch interval at each engine step, from now on."""
    seen: list[float] = []
    step = LLMEngine.step

    def recording_step(self: LLMEngine):  # type: ignore[no-untyped-def]
        seen.append(sys.getswitchinterval())
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", recording_step)
    return seen


def test_a_job_steps_with_short_turns(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, default_interval: float
) -> None:
    seen = _record_step_intervals(monkeypatch)
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(6))
    report = run_job(job_dict(tiny_model, src, tmp_path / "out"), show_progress=False)
    assert report.status == "complete" and report.rows_ok == 6
    assert seen and all(s == pytest.approx(TURN_S) for s in seen)
    assert sys.getswitchinterval() == pytest.approx(default_interval)


def test_llm_generate_steps_with_short_turns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, default_interval: float
) -> None:
    """LLM runs an output thread beside its engine loop too (async scheduling)."""
    seen = _record_step_intervals(monkeypatch)
    llm = LLM(str(save_tiny_model("llama", tmp_path / "llama")), device="cpu")
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    assert seen and all(s == pytest.approx(TURN_S) for s in seen)
    assert sys.getswitchinterval() == pytest.approx(default_interval)
