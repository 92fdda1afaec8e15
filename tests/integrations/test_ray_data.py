"""tokenmill as a Ray Data stage, on a real local Ray cluster: the generated columns equal
LLM.chat's on the same rows, bad rows get an error without failing their batch, and
preprocess / postprocess run around the engine replicas."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import save_tiny_model
from tokenmill import LLM, SamplingParams

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.usefixtures("ray_session")

from tokenmill.integrations.ray_data import (  # noqa: E402
    OUTPUT_COLUMNS,
    EngineReplica,
    ProcessorConfig,
    build_processor,
)

ENGINE = {"device": "cpu", "dtype": "float32", "max_num_seqs": 4}
SAMPLING = {"max_tokens": 6, "temperature": 0.0}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("raydata") / "m")


def _question(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"question number {i}: what is {i} + {i}?"}]


def test_outputs_equal_llm_chat_and_bad_rows_get_errors(model: Path) -> None:
    """Two replicas; preprocess builds each row's conversation, postprocess keeps what the
    test reads (one pipeline, as Ray starts actors slowly)."""
    rows = [{"id": i} for i in range(10)]

    # Ray workers cannot import this test module: the functions use nothing of it (what
    # they need comes as defaults), so they pickle whole.
    def preprocess(row: dict) -> dict:
        i = row["id"]
        question = [{"role": "user", "content": f"question number {i}: what is {i} + {i}?"}]
        out = {"id": i, "messages": question, "sampling_params": {"max_tokens": 6}}
        if i == 3:  # longer than the model's context
            out["messages"] = [{"role": "user", "content": "x" * 3000}]
        if i == 7:
            out["sampling_params"] = {"temperature": -1.0}
        return out

    def postprocess(row: dict, names=OUTPUT_COLUMNS) -> dict:
        return {"id": row["id"], **{name: row[name] for name in names}}

    config = ProcessorConfig(str(model), engine=ENGINE, sampling=SAMPLING, concurrency=2,
                             batch_size=4)  # fmt: skip
    processor = build_processor(config, preprocess=preprocess, postprocess=postprocess)
    out = processor(ray.data.from_items(rows)).take_all()
    got = {r["id"]: r for r in out}
    assert sorted(got) == list(range(10))
    assert all(set(r) == {"id", *OUTPUT_COLUMNS} for r in out)

    llm = LLM(str(model), **ENGINE)
    good = [i for i in range(10) if i not in (3, 7)]
    want = llm.chat([_question(i) for i in good], SamplingParams(**SAMPLING))
    for i, w in zip(good, want, strict=True):
        r = got[i]
        got_tokens = (r["generated_text"], list(r["generated_token_ids"]))
        assert got_tokens == (w.text, w.token_ids), r["error"]
        assert r["error"] is None and r["finish_reason"] == w.finish_reason
        assert r["num_generated_tokens"] == len(w.token_ids) > 0
    assert got[3]["finish_reason"] == "error" and "context" in got[3]["error"]
    assert got[7]["finish_reason"] == "error" and "temperature" in got[7]["error"]


def test_bad_settings_are_refused_when_building() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        ProcessorConfig(concurrency=0)
    with pytest.raises(TypeError, match="max_num_seq"):
        ProcessorConfig(engine={"max_num_seq": 4})
    with pytest.raises(ValueError, match="temperature"):
        ProcessorConfig(sampling={"temperature": -1.0})
    with pytest.raises(ValueError, match="n=2, but a row's generated_text holds one"):
        ProcessorConfig(sampling={"n": 2})


def test_a_row_asking_for_several_completions_is_an_error_not_a_cut(model: Path) -> None:
    """Its columns hold one completion: n=3 used to return the first and drop two."""
    replica = EngineReplica(ProcessorConfig(str(model), engine=ENGINE, sampling=SAMPLING))
    rows = [{"prompt": "a b c", "sampling_params": {"n": n, "best_of": 3}} for n in (3, 1)]
    several, best = replica.run(rows)
    assert several["finish_reason"] == "error" and "n=3" in several["error"]
    assert best["error"] is None and best["num_generated_tokens"] > 0
