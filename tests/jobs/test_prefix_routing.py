"""planner.routing on the Ray executor, 2 CPU replicas, tiny model: with ``prefix`` every
system prompt's rows run on one replica, with ``balance`` (chunks in input order) each
prompt's rows are spread over both; the rows are identical either way."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.jobs.job_helpers import job_dict, read_jsonl_dir, write_jsonl
from tokenmill import run_job
from tokenmill.io.rows import InputRow
from tokenmill.jobs.cli import main as cli_main
from tokenmill.jobs.fingerprint import job_settings
from tokenmill.jobs.spec import JobSpec, JobSpecError

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.usefixtures("ray_session")

from tokenmill.jobs.ray_executor import RayExecutor  # noqa: E402
from tokenmill.jobs.ray_replica_pool import ReplicaSlot  # noqa: E402

_ROUTE = RayExecutor._route

PROMPTS, ROWS_EACH = 4, 8
# 32 rows, chunks of 8 (max_num_seqs), 2 replicas: every row is routed in the first pull,
# before any result, so the routes are the same in every run
SECTIONS = {
    "engine": {"max_num_seqs": 8},
    "sampling": {"max_tokens": 4},
    "execution": {"executor": "ray", "replicas": 2, "ray_address": None},
}


@pytest.fixture(scope="module")
def prompts_input(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """PROMPTS system prompts x ROWS_EACH rows, interleaved (p0, p1, p2, p3, p0, ...): every
    chunk of input order holds every prompt. A prompt is longer than the router's key (512
    characters), so the key is the system prompt's, not the row's."""
    rule = "Rule {k}: answer in one line. " * 20
    systems = [f"You are assistant {k}. " + rule.format(k=k) for k in range(PROMPTS)]
    rows = [
        {
            "id": f"r{j}-{k}",
            "topic": f"p{k}",
            "messages": [
                {"role": "system", "content": systems[k]},
                {"role": "user", "content": f"item {j} of prompt {k}?"},
            ],
        }
        for j in range(ROWS_EACH)
        for k in range(PROMPTS)
    ]
    return write_jsonl(tmp_path_factory.mktemp("prefix-routing") / "in.jsonl", rows)


def _run(
    tiny_model: Path, src: Path, routing: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[dict[str, Any]], dict[str, set[int]]]:
    """The job's output rows, and each system prompt's replicas as the executor routed it."""
    replicas: dict[str, set[int]] = defaultdict(set)

    def recorded(self: RayExecutor, row: InputRow, run: Any) -> ReplicaSlot:
        slot = _ROUTE(self, row, run)
        replicas[row.passthrough["topic"]].add(slot.index)
        return slot

    monkeypatch.setattr(RayExecutor, "_route", recorded)
    out = src.parent / routing
    planner = {"order": "input", "routing": routing}
    report = run_job(
        job_dict(tiny_model, src, out, planner=planner, **SECTIONS), show_progress=False
    )
    assert report.status == "complete" and report.rows_ok == PROMPTS * ROWS_EACH
    assert report.executor == "ray" and report.prefix_cache_hit_rate > 0
    return read_jsonl_dir(out / "shards"), dict(replicas)


def test_prefix_routing_keeps_each_prompt_on_one_replica(
    tiny_model: Path, prompts_input: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    by_prefix, prefix_routes = _run(tiny_model, prompts_input, "prefix", monkeypatch)
    by_chunk, balance_routes = _run(tiny_model, prompts_input, "balance", monkeypatch)

    assert len(prefix_routes) == len(balance_routes) == PROMPTS
    assert all(len(replicas) == 1 for replicas in prefix_routes.values()), prefix_routes
    assert set().union(*prefix_routes.values()) == {0, 1}  # both replicas get work
    # balance fills a chunk of 8 consecutive rows, then the other replica's: every prompt
    # lands on both, and each replica prefills all 4
    assert all(replicas == {0, 1} for replicas in balance_routes.values()), balance_routes
    assert by_prefix == by_chunk  # same rows, same texts, same shards


def test_routing_key_is_checked_and_not_in_the_fingerprint(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    raw = job_dict(tmp_path / "model", tmp_path / "in.jsonl", tmp_path / "out")
    assert JobSpec.from_dict(raw).planner.settings().routing == "prefix"
    with pytest.raises(JobSpecError, match="planner.routing: must be 'prefix' or 'balance'"):
        JobSpec.from_dict({**raw, "planner": {"routing": "random"}}, "job.yaml")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(raw))
    assert cli_main([str(job), "--set", "planner.routing=hash"]) == 2
    assert "planner.routing" in capsys.readouterr().err

    (tmp_path / "config.json").write_text("{}")
    settings = [
        job_settings(JobSpec.from_dict({**raw, "planner": {"routing": r}}), tmp_path, None, "fp")
        for r in ("prefix", "balance")
    ]
    assert settings[0] == settings[1]  # a resume may switch the policy
