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


def test_vllm_engine_names_are_taken_as_llm_takes_them() -> None:
    config = ProcessorConfig(engine={"enforce_eager": True, "gpu_memory_utilization": 0.5})
    assert config.engine["enforce_eager"] is True  # the replica's LLM translates them


def test_bad_settings_are_refused_when_building() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        ProcessorConfig(concurrency=0)
    with pytest.raises(TypeError, match="max_num_seq"):
        ProcessorConfig(engine={"max_num_seq": 4})
    with pytest.raises(ValueError, match="temperature"):
        ProcessorConfig(sampling={"temperature": -1.0})
    with pytest.raises(ValueError, match="n=2, but a row's generated_text holds one"):
        ProcessorConfig(sampling={"n": 2})
    for engine in (None, [("max_num_seqs", 4)], "max_num_seqs=4"):
        with pytest.raises(TypeError, match=r"^ProcessorConfig.engine must be a mapping of Eng"):
            ProcessorConfig(engine=engine)
    with pytest.raises(TypeError, match=r"^ProcessorConfig.sampling must be a mapping of Sam"):
        ProcessorConfig(sampling=None)


def test_replica_resources_are_refused_when_building_naming_the_key() -> None:
    """num_cpus / num_gpus were taken as given: Ray refused a negative one only once the
    dataset ran ("The quantity of resource num_cpus cannot be negative", no
    ProcessorConfig key), and num_cpus="1" was a TypeError comparing str and float."""
    for name in ("num_cpus", "num_gpus"):
        for bad in (-1, "1", True, float("nan"), float("inf")):
            with pytest.raises(ValueError, match=rf"^ProcessorConfig.{name} must be a finite"):
                ProcessorConfig(**{name: bad})
    assert ProcessorConfig(num_cpus=0, num_gpus=0.5).gpus_per_replica() == 0.5
    assert ProcessorConfig(num_cpus=2.5, num_gpus=None).num_cpus == 2.5


def test_a_row_asking_for_several_completions_is_an_error_not_a_cut(model: Path) -> None:
    """Its columns hold one completion: n=3 used to return the first and drop two."""
    replica = EngineReplica(ProcessorConfig(str(model), engine=ENGINE, sampling=SAMPLING))
    rows = [{"prompt": "a b c", "sampling_params": {"n": n, "best_of": 3}} for n in (3, 1)]
    several, best = replica.run(rows)
    assert several["finish_reason"] == "error" and "n=3" in several["error"]
    assert best["error"] is None and best["num_generated_tokens"] > 0


def test_a_rows_error_names_no_place_in_a_batch_the_user_never_sees(model: Path) -> None:
    """A row that failed before the engine had its error prefixed "row i of the batch", i
    its place in one of Ray Data's batches (the dataset's row 7 read "row 3 of the batch"
    with batch_size 4), a row the user cannot find; one the engine refused had none. The
    error is on the row itself, among its own columns: both read the same way now."""
    replica = EngineReplica(ProcessorConfig(str(model), engine=ENGINE, sampling=SAMPLING))
    rows = [
        {"prompt": "a b"},
        {"prompt": "x " * 3000},  # longer than the context: the engine's error
        {"prompt": "a", "sampling_params": {"temperature": -1.0}},
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": 5}]},
    ]
    good, long, sampling, messages = (r["error"] for r in replica.run(rows))
    assert good is None and long.startswith("prompt has 6000 tokens"), long
    assert sampling.startswith("SamplingParams.temperature must be a number >= 0"), sampling
    assert messages.startswith("messages[1].content must be a string"), messages


def test_a_null_prompt_is_named_null_not_missing(model: Path) -> None:
    """A row whose prompt cell is null was told it "needs a ... 'prompt' ... column; it has
    ['id', 'prompt']" (an audit)."""
    replica = EngineReplica(ProcessorConfig(str(model), engine=ENGINE, sampling=SAMPLING))
    prompt, both, other = replica.run(
        [{"id": 1, "prompt": None}, {"messages": None, "prompt": None}, {"id": 3}]
    )
    assert prompt["error"].endswith("its 'prompt' is null")
    assert both["error"].endswith("its 'messages' and 'prompt' are null")
    assert "needs a 'messages', 'prompt' or 'prompt_token_ids' column" in other["error"]


def test_user_columns_keep_their_values_and_no_block_runs_a_nan_prompt(model: Path) -> None:
    """Numpy batches turned a nullable int64 id into floats (2**62 + 1, + 3 and + 4 all
    became 4.611686018427388e+18) and an all-null prompt column of a block into NaN, which
    ran as the prompt "nan" instead of the row's token ids."""
    import pyarrow as pa

    big = 2**62
    table = pa.table(
        {
            "key": pa.array([big + 1, None, big + 3, big + 4], type=pa.int64()),
            "prompt": pa.array([None] * 4, type=pa.string()),
            "prompt_token_ids": [[5, 17, 42], [7, 8], [9, 10, 11], [12]],
            "sampling_params": ['{"max_tokens": 3}', None, None, '{"max_tokens": 2}'],
        }
    )
    config = ProcessorConfig(str(model), engine=ENGINE, sampling=SAMPLING, batch_size=2)
    out = build_processor(config)(ray.data.from_arrow(table).repartition(2)).take_all()
    assert sorted(r["key"] for r in out if r["key"] is not None) == [big + 1, big + 3, big + 4]
    llm = LLM(str(model), **ENGINE)
    for row in out:
        want = llm.generate([row["prompt_token_ids"]], SamplingParams(**SAMPLING))[0]
        cap = {big + 1: 3, big + 4: 2}.get(row["key"], SAMPLING["max_tokens"])
        assert row["error"] is None and row["generated_token_ids"] == want.token_ids[:cap]


def test_replicas_ask_for_a_gpu_on_a_cluster_with_gpus_under_device_auto() -> None:
    """device auto (the default) asked Ray for no GPU: every replica of a node ran on cuda:0
    unaccounted for."""
    assert ProcessorConfig().gpus_per_replica(cluster_gpus=8) == 1.0
    assert ProcessorConfig().gpus_per_replica(cluster_gpus=0) == 0.0
    assert ProcessorConfig(engine={"device": "cpu"}).gpus_per_replica(cluster_gpus=8) == 0.0
    assert ProcessorConfig(num_gpus=0.5).gpus_per_replica(cluster_gpus=8) == 0.5


def test_replicas_asking_for_gpus_a_cluster_lacks_are_warned_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """num_gpus=1 (or engine device cuda) on a cluster of CPUs: no replica could start and
    the pipeline waited forever, saying nothing but "pending: 1 GPU" in its progress."""
    import logging

    assert ray.cluster_resources().get("GPU", 0.0) == 0.0  # the tests' local Ray
    ds = ray.data.from_items([{"prompt": "a"}])
    with caplog.at_level(logging.WARNING, logger="tokenmill.integrations"):
        for config in (ProcessorConfig(num_gpus=1), ProcessorConfig(engine={"device": "cuda"})):
            build_processor(config)(ds)  # lazy: warned before anything runs
        build_processor(ProcessorConfig(engine={"device": "cpu"}))(ds)
    warned = [r.getMessage() for r in caplog.records if "GPUs" in r.getMessage()]
    assert len(warned) == 2, warned
    assert warned[0].startswith("each engine replica asks Ray for 1 GPUs, but the cluster has 0")


def test_messages_cells_read_as_run_job_reads_them_with_the_configs_template(
    model: Path,
) -> None:
    """A messages column as JSON text or as Spark's array<map<string,string>> ran as a row
    error here while run-job read it; and the processor takes a chat template and its
    variables, as LLM.chat and a job do."""
    import json

    import pyarrow as pa

    template = (
        "{% for m in messages %}{{ m['role'] }}: "
        "{% if shout %}{{ m['content'] | upper }}{% else %}{{ m['content'] }}{% endif %}\n"
        "{% endfor %}assistant:"
    )
    shout = {"shout": True}
    config = ProcessorConfig(str(model), engine=ENGINE, sampling=SAMPLING,
                             chat_template=template, chat_template_kwargs=shout)  # fmt: skip
    replica = EngineReplica(config)
    question = _question(5)
    maps = pa.array(
        [[list(m.items()) for m in question]], pa.list_(pa.map_(pa.string(), pa.string()))
    )
    for cell in (pa.array([json.dumps(question)]), maps):
        (row,) = replica(pa.table({"messages": cell})).to_pylist()
        assert row["error"] is None, row["error"]
        want = LLM(str(model), **ENGINE).chat(
            [question], SamplingParams(**SAMPLING), chat_template=template,
            chat_template_kwargs={"shout": True},
        )[0]  # fmt: skip
        assert row["num_input_tokens"] == len(want.prompt_token_ids)
        assert row["generated_text"] == want.text
    with pytest.raises(ValueError, match="ProcessorConfig.chat_template_kwargs may not set"):
        ProcessorConfig(str(model), chat_template_kwargs={"tokenize": True})


def test_the_processors_template_may_be_a_file(model: Path, tmp_path: Path) -> None:
    """As a job's model.chat_template: a path was taken as the template's text, and every
    row's prompt was the path itself."""
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    config = ProcessorConfig(str(model), chat_template=str(path))
    assert config.chat_template == path.read_text()  # the text, for every replica
    with pytest.raises(ValueError, match="ProcessorConfig.chat_template: no file"):
        ProcessorConfig(str(model), chat_template=str(tmp_path / "missing.jinja"))


def test_numpy_token_ids_from_preprocess_run(model: Path) -> None:
    """A preprocess returning numpy token ids (a tokenizer's return_tensors="np") makes Ray
    Data store a tensor column; its cells reach the replica as ndarrays, and every row
    failed with 'prompt_token_ids must be a list of integers'."""
    import numpy as np

    def pre(row: dict) -> dict:
        return {"id": row["id"], "prompt_token_ids": np.array([5, 6, 7], dtype=np.int64)}

    config = ProcessorConfig(str(model), engine=ENGINE, sampling=SAMPLING, batch_size=2)
    out = build_processor(config, preprocess=pre)(ray.data.range(3)).take_all()
    assert [r["error"] for r in out] == [None] * 3
    assert all(r["num_input_tokens"] == 3 for r in out)


def test_logprobs_are_refused_not_computed_and_dropped(model: Path) -> None:
    """No output column holds logprobs: a row asking for them ran and lost them."""
    replica = EngineReplica(ProcessorConfig(str(model), engine=ENGINE, sampling=SAMPLING))
    rows = [{"prompt": "a b", "sampling_params": {k: 2}} for k in ("logprobs", "prompt_logprobs")]
    for result in replica.run(rows):
        assert result["finish_reason"] == "error" and "logprobs" in result["error"]
    with pytest.raises(ValueError, match="logprobs"):
        ProcessorConfig(str(model), sampling={"logprobs": 2})


def test_a_json_null_sampling_params_cell_is_no_params(model: Path) -> None:
    """json.dumps(None) is "null": a JSON-text column's empty cell was a row error."""
    replica = EngineReplica(ProcessorConfig(str(model), engine=ENGINE, sampling=SAMPLING))
    (result,) = replica.run([{"prompt": "a b", "sampling_params": "null"}])
    assert result["error"] is None


def test_the_processor_continues_a_reply_begun_as_transformers_renders_it(model: Path) -> None:
    """ProcessorConfig's add_generation_prompt / continue_final_message end every
    conversation as apply_chat_template(tokenize=True) does with them (and LLM.chat); a row
    with no assistant reply to continue is that row's error; both true is refused."""
    import json

    import pyarrow as pa
    from transformers import AutoTokenizer

    ending = {"add_generation_prompt": False, "continue_final_message": True}
    config = ProcessorConfig(str(model), engine=ENGINE, sampling=SAMPLING, **ending)
    replica = EngineReplica(config)
    begun = [*_question(2), {"role": "assistant", "content": '{"answer": '}]
    want_ids = AutoTokenizer.from_pretrained(model).apply_chat_template(
        begun, tokenize=True, **ending
    )["input_ids"]
    assert replica._prompt_tokens({"messages": begun}) == want_ids
    got = replica(pa.table({"messages": [json.dumps(begun), json.dumps(_question(3))]}))
    continued, asked = got.to_pylist()
    want = LLM(str(model), **ENGINE).chat([begun], SamplingParams(**SAMPLING), **ending)[0]
    assert list(want.prompt_token_ids) == want_ids
    assert continued["error"] is None, continued["error"]
    assert continued["num_input_tokens"] == len(want_ids)
    assert continued["generated_text"] == want.text
    assert asked["finish_reason"] == "error"
    assert asked["error"].startswith("continue_final_message is set, but")
    assert "ends with a user message" in asked["error"]
    with pytest.raises(ValueError, match="ProcessorConfig.continue_final_message and add_gen"):
        ProcessorConfig(str(model), continue_final_message=True)
    with pytest.raises(ValueError, match="ProcessorConfig.add_generation_prompt must be true"):
        ProcessorConfig(str(model), add_generation_prompt="no")  # type: ignore[arg-type]


def test_columns_the_replica_does_not_read_pass_through_unconverted(model: Path) -> None:
    """Every column of a batch was turned into Python values: a timestamp past year 9999
    in a column the engine never reads raised OverflowError, failing the whole dataset."""
    import pyarrow as pa

    far = pa.array([0, 253402300800 * 10], pa.timestamp("s"))  # year 10000 and later
    replica = EngineReplica(ProcessorConfig(str(model), engine=ENGINE, sampling=SAMPLING))
    got = replica(pa.table({"prompt": ["a b", "c d"], "when": far}))
    assert got.column("when").equals(pa.chunked_array([far]))
    assert got.column("error").to_pylist() == [None, None]
    assert got.column("num_generated_tokens").to_pylist() == [SAMPLING["max_tokens"]] * 2
    (missing,) = replica(pa.table({"text": ["a b"], "when": far[:1]})).column("error").to_pylist()
    assert missing.endswith("it has ['text', 'when']")


def test_a_rows_guided_decoding_dict_as_ray_data_llm_gives_it_runs(model: Path) -> None:
    """Ray Data LLM rows give sampling_params={"guided_decoding": {"json": schema}} (a
    column holds no StructuredOutputsParams): every such row was an error."""
    replica = EngineReplica(ProcessorConfig(str(model), engine=ENGINE, sampling=SAMPLING))
    settings = [
        {"guided_decoding": {"json": {"enum": ["yes", "no"]}}},
        {"structured_outputs": {"json_object": True, "json": None}},  # a struct column's null
        {"structured_outputs": {"json": {"type": "integer"}, "backend": "xgrammar"}},
    ]
    rows = [{"prompt": "a b", "sampling_params": {**s, "max_tokens": 12}} for s in settings]
    schema, any_object, backend = replica.run(rows)
    assert schema["error"] is None and schema["generated_text"] in ('"yes"', '"no"')
    assert any_object["error"] is None and any_object["generated_text"].startswith("{")
    assert backend["finish_reason"] == "error" and "backend" in backend["error"]
