"""JobSpec against hostile input: strict scalars, device names, blank paths, YAML alias
bombs and error messages that stay short whatever the value."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tokenmill.jobs.spec import RAY_ONLY, JobSpec, JobSpecError
from tokenmill.jobs.yaml_limits import MAX_SHOWN, find_oversize, show_value

REPO = Path(__file__).resolve().parents[2]
LETTERS = "abcdefghi"


def _raw(**sections: dict[str, Any]) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "model": {"source": "some-model"},
        "input": {"path": "in.jsonl"},
        "output": {"path": "out/"},
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return raw


def _error(raw: Any, where: str = "job.yaml") -> str:
    with pytest.raises(JobSpecError) as info:
        JobSpec.from_dict(raw, where)
    return str(info.value)


def _write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


BASE_YAML = "model: {source: m}\ninput: {path: in.jsonl}\noutput: {path: out}\n"


# -- 1. strict scalars -------------------------------------------------------------------

WRONG_TYPES = [
    ("model", "source", 5, "expected a string, got 5"),
    ("model", "tensor_parallel", True, "expected an integer, got true"),
    ("model", "pipeline_parallel", "1", "expected an integer, got the string '1'"),
    ("input", "id_column", 7, "expected a string, got 7"),
    ("input", "passthrough_columns", ["topic", 3], "expected a string, got 3"),
    ("input", "passthrough_columns", "topic", "expected a list, got the string 'topic'"),
    ("sampling", "max_tokens", "5", "expected an integer, got the string '5'"),
    ("sampling", "max_tokens", 2.0, "expected an integer, got 2.0"),
    ("sampling", "top_k", False, "expected an integer, got false"),
    ("sampling", "seed", True, "expected an integer, got true"),
    ("sampling", "temperature", True, "expected a number, got true"),
    ("sampling", "top_p", "0.9", "expected a number, got the string '0.9'"),
    ("sampling", "repetition_penalty", float("nan"), "expected a finite number, got nan"),
    ("sampling", "stop", ["</s>", 1], "expected a string, got 1"),
    ("sampling", "ignore_eos", 1, "expected true or false, got 1"),
    ("sampling", "ignore_eos", "yes", "expected true or false, got the string 'yes'"),
    ("output", "rows_per_shard", True, "expected an integer, got true"),
    ("output", "rows_per_shard", "5", "expected an integer, got the string '5'"),
    ("engine", "max_num_seqs", True, "expected a positive integer, got true"),
    ("engine", "max_num_batched_tokens", 8192.0, "expected a positive integer, got 8192.0"),
    ("engine", "block_size", "16", "expected a power of two from 1 to 2**30 ("),
    ("engine", "block_size", "16", "got the string '16'"),
    ("engine", "max_model_len", True, "expected an integer >= 2"),
    ("engine", "max_model_len", True, "got true"),
    ("engine", "max_model_len", "512", "got the string '512'"),
    ("engine", "enable_prefix_caching", 0, "expected true or false, got 0"),
    ("engine", "cuda_graphs", "no", "expected true or false, got the string 'no'"),
    ("engine", "async_scheduling", 1, "expected true or false, or unset (on with CUDA"),
    ("engine", "async_scheduling", 1, "only), got 1"),
    ("engine", "kv_cache_memory", True, "got true"),
    ("engine", "kv_cache_memory", "0.5", "got the string '0.5'"),
    ("engine", "kv_cache_memory", 1.5, "a number in (0, 1]"),
    ("execution", "replicas", True, "expected an integer, got true"),
    ("execution", "ray_address", 5, "expected a string, got 5"),
    ("execution", "stall_timeout_s", "60", "expected a number, got the string '60'"),
    ("execution", "stall_timeout_s", 0, "must be greater than 0, got 0"),
    ("execution", "replica_failures_in_a_row", 0, "must be greater than or equal to 1, got 0"),
    ("execution", "replica_failures_in_a_row", 4.0, "expected an integer, got 4.0"),
    # said why, with what to do instead (it said "must be less than or equal to 1, got 2")
    ("model", "tensor_parallel", 2, "2 is not supported yet: an engine runs on one device"),
    ("model", "pipeline_parallel", 4, "run several engines, with execution.executor: ray"),
    ("model", "tensor_parallel", 0, "must be greater than or equal to 1, got 0"),
]


@pytest.mark.parametrize(("section", "key", "value", "what"), WRONG_TYPES)
def test_wrong_scalar_types_are_refused(section: str, key: str, value: Any, what: str) -> None:
    message = _error(_raw(**{section: {key: value}}))
    assert message.startswith("job.yaml: invalid job spec:\n  ")
    line = message.splitlines()[1]
    assert line.startswith(f"  {section}.{key}"), message
    assert what in line, message


def test_strict_type_message_reads_well() -> None:
    message = _error(_raw(output={"rows_per_shard": True}), "jobs/a.yaml")
    assert message == (
        "jobs/a.yaml: invalid job spec:\n  output.rows_per_shard: expected an integer, got true"
    )


def test_yaml_spellings_still_load(tmp_path: Path) -> None:
    """YAML's own true/false/yes/no, ints for float fields and lists for tuple fields."""
    path = _write(
        tmp_path,
        BASE_YAML
        + "input: {path: in.jsonl, passthrough_columns: [topic, lang]}\n"
        + "sampling: {temperature: 1, top_p: 1, stop: [a, b], ignore_eos: yes, seed: null}\n"
        + "engine: {enable_prefix_caching: no, cuda_graphs: false, async_scheduling: true,\n"
        + "         kv_cache_memory: 0.5, max_model_len: 512, device: 'cuda:1'}\n",
    )
    spec = JobSpec.load(path)
    assert spec.input.passthrough_columns == ("topic", "lang")
    assert spec.sampling.temperature == 1.0 and isinstance(spec.sampling.temperature, float)
    assert spec.sampling.stop == ("a", "b") and spec.sampling.ignore_eos is True
    assert spec.engine.enable_prefix_caching is False and spec.engine.async_scheduling is True
    assert spec.engine.kv_cache_memory == 0.5 and spec.engine.max_model_len == 512
    assert JobSpec.from_dict(spec.to_dict()) == spec  # what the Ray replicas rebuild
    assert JobSpec.from_dict(_raw(sampling={"stop": "</s>"})).sampling.stop == ("</s>",)
    assert JobSpec.from_dict(_raw(engine={"kv_cache_memory": 16 << 20})).engine.kv_cache_memory


def test_set_overrides_are_parsed_as_yaml(tmp_path: Path) -> None:
    path = _write(tmp_path, BASE_YAML)
    spec = JobSpec.load(
        path,
        [
            "output.rows_per_shard=8",
            "sampling.temperature=0.7",
            "sampling.ignore_eos=true",
            "sampling.stop=[x, y]",
            "engine.device=cuda:0",
            "engine.kv_cache_memory=1048576",
        ],
    )
    assert spec.output.rows_per_shard == 8 and spec.sampling.temperature == 0.7
    assert spec.sampling.ignore_eos is True and spec.sampling.stop == ("x", "y")
    assert spec.engine.device == "cuda:0" and spec.engine.kv_cache_memory == 1 << 20
    with pytest.raises(JobSpecError, match=r"output.rows_per_shard: expected an integer, got tr"):
        JobSpec.load(path, ["output.rows_per_shard=true"])
    with pytest.raises(JobSpecError, match=r"max_tokens: expected an integer, got the string"):
        JobSpec.load(path, ["sampling.max_tokens=" + "9" * 5000])  # past int()'s digit limit


# -- 2. device names ---------------------------------------------------------------------


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:3", "cuda:127"])
def test_known_devices_are_accepted(device: str) -> None:
    assert JobSpec.from_dict(_raw(engine={"device": device})).engine.device == device


@pytest.mark.parametrize(
    "device", ["banana", "CPU", "cuda:", "cuda:-1", "cuda:x", "cuda:00", "cuda:1 ", "mps", ""]
)
def test_unknown_devices_are_refused(device: str) -> None:
    message = _error(_raw(engine={"device": device}))
    line = message.splitlines()[1]
    assert line.startswith("  engine.device: expected one of auto, cpu, cuda, cuda:<n>"), message
    assert repr(device) in line


# -- 3. blank paths ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "key"), [("input", "path"), ("output", "path"), ("model", "source")]
)
@pytest.mark.parametrize("value", ["", "   ", "\t\n"])
def test_blank_paths_and_sources_are_refused(section: str, key: str, value: str) -> None:
    message = _error(_raw(**{section: {key: value}}))
    assert f"  {section}.{key}: must not be empty or blank" in message


@pytest.mark.parametrize("section", ["input", "output"])
@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("/data/results::v2", "holds '::', which fsspec reads as a chain"),
        ("s3://bucket/results::v2", "holds '::', which fsspec reads as a chain"),
        # relative names: fsspec wrote out::v2's files into ./out (exit 0), read in.jsonl
        # for in.jsonl::x, and opened data::v2 as a data: URI
        ("out::v2", "holds '::', which fsspec reads as a chain"),
        ("in.jsonl::x", "holds '::', which fsspec reads as a chain"),
        ("data::v2", "holds '::', which fsspec reads as a chain"),
        ("s3://bucket/in/p?versionId=1.jsonl", "holds '?versionId=', which s3fs reads"),
        # written under the working directory, as ./localhost/data/out (exit 0)
        ("file://localhost/data/out", "reads as a folder under the working directory"),
        ("file://out", "names a host or a relative path after file://"),
    ],
)
def test_paths_fsspec_would_open_as_something_else_are_refused(
    section: str, value: str, needle: str
) -> None:
    """fsspec cut /data/results::v2 to /data/results (another folder read or written, exit
    0); s3fs took ?versionId= as a version (every run exit 75, "temporary"); file://localhost
    went under the working directory."""
    message = _error(_raw(**{section: {"path": value}}))
    assert f"  {section}.path: " in message and needle in message


def test_a_chain_of_filesystems_is_still_taken() -> None:
    raw = _raw(input={"path": "simplecache::s3://bucket/in/"})
    assert JobSpec.from_dict(raw).input.path == "simplecache::s3://bucket/in/"
    raw = _raw(input={"path": "blockcache::simplecache::s3://bucket/in/"})
    assert JobSpec.from_dict(raw).input.path == "blockcache::simplecache::s3://bucket/in/"
    raw = _raw(output={"path": "file:///data/out"})
    assert JobSpec.from_dict(raw).output.path == "file:///data/out"


def test_a_chain_onto_an_absolute_local_path_is_still_taken() -> None:
    """simplecache::/data/in.jsonl (a chain onto a local file, as fsspec opens it) was taken
    until a chain had to go on to a URL: then refused (exit 2), saying to rename a file."""
    raw = _raw(input={"path": "simplecache::/data/in.jsonl"})
    assert JobSpec.from_dict(raw).input.path == "simplecache::/data/in.jsonl"


# -- 4. YAML bombs and bounded messages ----------------------------------------------------


def _laughs(indent: str = "") -> list[str]:
    """Nine anchors, each a list of nine aliases of the one before: 9**9 items expanded."""
    lines = [f"{indent}a: &a [" + ", ".join(["lol"] * 9) + "]"]
    for prev, cur in zip(LETTERS[:-1], LETTERS[1:], strict=True):
        lines.append(f"{indent}{cur}: &{cur} [" + ", ".join([f"*{prev}"] * 9) + "]")
    return lines


def _inline_laughs() -> str:
    """The same anchors defined inside ``sampling.stop`` itself."""
    anchors = ["&a [" + ", ".join(["lol"] * 9) + "]"]
    anchors += [
        f"&{c} [" + ", ".join([f"*{p}"] * 9) + "]"
        for p, c in zip(LETTERS[:-1], LETTERS[1:], strict=True)
    ]
    return "sampling:\n  stop: [" + ", ".join(anchors) + "]\n"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("\n".join(_laughs()) + "\n", "f"),  # as unknown top-level keys
        ("x:\n" + "\n".join(_laughs("  ")) + "\nsampling:\n  stop: *i\n", "x.f"),
        (_inline_laughs(), "sampling.stop"),
    ],
    ids=["top-level", "aliased-as-stop", "inside-stop"],
)
def test_yaml_alias_bombs_fail_fast(tmp_path: Path, text: str, key: str) -> None:
    path = _write(tmp_path, BASE_YAML + text)
    start = time.perf_counter()
    with pytest.raises(JobSpecError) as info:
        JobSpec.load(path)
    assert time.perf_counter() - start < 1.0
    message = str(info.value)
    assert message.startswith(f"{path}: invalid job spec:\n  {key}"), message
    assert "expands to over 100,000 values" in message and len(message) < 400


def test_many_alias_uses_are_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, BASE_YAML + "z: &z [1]\nw: [" + ", ".join(["*z"] * 150) + "]\n")
    with pytest.raises(JobSpecError, match=r"  w\.\d+: repeats a list or mapping more than 100"):
        JobSpec.load(path)
    few = _write(tmp_path, BASE_YAML + "x: &o {key: v}\ninput: {path: a, storage_options: *o}\n")
    with pytest.raises(JobSpecError, match=r"  x: unknown key"):  # a few aliases are fine
        JobSpec.load(few)


def test_from_dict_refuses_huge_and_self_referencing_values() -> None:
    start = time.perf_counter()
    message = _error(_raw(sampling={"stop": ["x"] * 10_000_000}))
    assert time.perf_counter() - start < 1.0
    assert "  sampling.stop: expands to over 100,000 values" in message
    loop: list[Any] = ["a"]
    loop.append(loop)
    message = _error(_raw(sampling={"stop": loop}))
    assert "  sampling.stop.1: contains itself" in message
    nested: Any = []
    for _ in range(1000):
        nested = [nested]
    assert "nested more than 32" in _error(_raw(input={"storage_options": {"x": nested}}))


def test_deep_or_huge_yaml_files_are_spec_errors(tmp_path: Path) -> None:
    deep = _write(tmp_path, BASE_YAML + "x: " + "[" * 50_000 + "]" * 50_000 + "\n", "deep.yaml")
    with pytest.raises(JobSpecError, match="deep.yaml: not valid YAML: .*nested too deep"):
        JobSpec.load(deep)
    digits = _write(tmp_path, BASE_YAML + "x: " + "1" * 5000 + "\n", "digits.yaml")
    with pytest.raises(JobSpecError, match="digits.yaml: not valid YAML"):
        JobSpec.load(digits)
    big = _write(tmp_path, BASE_YAML + "#" * (2 << 20) + "\n", "big.yaml")
    with pytest.raises(JobSpecError, match="big.yaml: over 1 MiB"):
        JobSpec.load(big)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(JobSpecError, match="binary.yaml: not valid YAML: .*not UTF-8"):
        JobSpec.load(binary)
    with pytest.raises(JobSpecError, match="cannot read the job file"):
        JobSpec.load(tmp_path)


@pytest.mark.parametrize(
    "raw",
    [
        _raw(output={"rows_per_shard": "9" * 1_000_000}),
        _raw(engine={"device": ["x" * 10_000] * 50_000}),
        _raw(engine={"device": {str(i): i for i in range(50_000)}}),
        _raw(engine={"block_size": {frozenset(range(50_000))}}),
        _raw(model={"source": 10**5000}),
        {**_raw(), "k" * 1_000_000: 1},
        _raw(sampling={"stop": list(range(50_000))}),
    ],
    ids=["long-string", "long-list", "big-dict", "big-set", "huge-int", "long-key", "errors"],
)
def test_error_messages_stay_short(raw: dict[str, Any]) -> None:
    start = time.perf_counter()
    message = _error(raw)
    # Over a minute and 2 GB before the bounds; 5 s leaves room for a loaded CI machine.
    assert time.perf_counter() - start < 5.0
    lines = message.splitlines()
    assert len(lines) <= 22 and all(len(line) < 200 for line in lines), message


def test_show_value_is_bounded() -> None:
    loop: list[Any] = []
    loop.append(loop)
    values = [
        "x" * 10**6,
        list(range(10**6)),
        {i: i for i in range(10**5)},
        set(range(10**5)),
        10**5000,
        loop,
        [[[[[["deep"]]]]]],
    ]
    for value in values:
        assert len(show_value(value)) <= MAX_SHOWN
    assert (show_value(True), show_value(False), show_value(None)) == ("true", "false", "null")
    assert show_value("cpu") == "'cpu'" and show_value(2.5) == "2.5"
    assert find_oversize(_raw(sampling={"stop": ["a"] * 1000})) is None


# -- specs built elsewhere still validate ----------------------------------------------------


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "examples").glob("*.yaml")))
def test_example_configs_validate(path: Path) -> None:
    assert JobSpec.load(path).model.source


def test_job_helpers_and_bench_specs_validate(tmp_path: Path) -> None:
    from tests.jobs.job_helpers import job_dict

    raw = job_dict(tmp_path / "model", tmp_path / "in.jsonl", tmp_path / "out")
    spec = JobSpec.from_dict(raw)
    assert spec.engine.kv_cache_memory == 16 << 20 and spec.input.passthrough_columns == ("topic",)
    bench = {  # as bench/job_memory.py writes it
        "name": "memory",
        "model": {"source": "smollm2-135m-instruct"},
        "input": {"path": str(tmp_path / "rows.jsonl")},
        "sampling": {"max_tokens": 1},
        "output": {"path": str(tmp_path / "out"), "format": "jsonl", "rows_per_shard": 10000},
        "engine": {"device": "cpu", "max_num_seqs": 512, "kv_cache_memory": 64 << 20},
    }
    path = _write(tmp_path, yaml.safe_dump(bench))
    assert JobSpec.load(path).engine.max_num_seqs == 512


@pytest.mark.parametrize(
    ("key", "value", "what"),
    [
        ("best_of", 0, "sampling.best_of: must be greater than or equal to 1, got 0"),
        ("best_of", 129, "sampling.best_of: must be less than or equal to 128, got 129"),
        ("best_of", "3", "sampling.best_of: expected an integer, got the string '3'"),
        ("prompt_logprobs", -1, "sampling.prompt_logprobs: must be greater than or equal to 0"),
        ("prompt_logprobs", 21, "sampling.prompt_logprobs: must be less than or equal to 20"),
        ("prompt_logprobs", True, "sampling.prompt_logprobs: expected an integer, got true"),
    ],
)
def test_best_of_and_prompt_logprobs_are_checked(key: str, value: Any, what: str) -> None:
    assert what in _error(_raw(sampling={key: value}))


def test_best_of_and_prompt_logprobs_unset_leave_the_sampling_record_as_it_was() -> None:
    """Unset, they are not in the settings the fingerprint hashes: earlier jobs resume."""
    unset = JobSpec.from_dict(_raw()).to_dict()["sampling"]
    assert "best_of" not in unset and "prompt_logprobs" not in unset
    spec = JobSpec.from_dict(_raw(sampling={"best_of": 3, "prompt_logprobs": 0}))
    assert (spec.to_dict()["sampling"]["best_of"], spec.sampling.prompt_logprobs) == (3, 0)


@pytest.mark.parametrize(
    ("value", "what"),
    [
        (-1, "sampling.logprobs: must be greater than or equal to 0, got -1"),
        (21, "sampling.logprobs: must be less than or equal to 20, got 21"),
        (True, "sampling.logprobs: expected an integer, got true"),
        ("2", "sampling.logprobs: expected an integer, got the string '2'"),
    ],
)
def test_logprobs_is_checked(value: Any, what: str) -> None:
    assert what in _error(_raw(sampling={"logprobs": value}))


def test_logprobs_unset_leaves_the_sampling_record_as_it_was() -> None:
    """Unset, it is not in the settings the fingerprint hashes: earlier jobs resume."""
    assert "logprobs" not in JobSpec.from_dict(_raw()).to_dict()["sampling"]
    for k in (0, 20):
        spec = JobSpec.from_dict(_raw(sampling={"logprobs": k}))
        assert (spec.to_dict()["sampling"]["logprobs"], spec.sampling.logprobs) == (k, k)


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        ("key=AKIA1,secret=Shh_123", "a string"),
        (["AKIA1", "Shh_123"], "a list"),
        (1234, "a number"),
    ],
)
def test_a_wrongly_typed_storage_options_is_not_echoed(value: Any, kind: str) -> None:
    """storage_options carry credentials: the error says what was expected and the kind of
    value given (as YAML names it: 'a number', not Python's 'a int'), not the value."""
    for section in ("input", "output"):
        message = _error(_raw(**{section: {"storage_options": value}}))
        assert f"{section}.storage_options: expected a mapping, got {kind} (" in message, message
        assert "Shh_123" not in message and "AKIA1" not in message and "1234" not in message


def test_a_broken_yaml_line_or_set_item_is_not_echoed(tmp_path: Path) -> None:
    """The line that broke may hold a credential: the error says where, not what."""
    broken = BASE_YAML.replace(
        "input: {path: in.jsonl}", "input: {path: in.jsonl, storage_options: {secret: Shh/1: x}}"
    )
    with pytest.raises(JobSpecError) as info:
        JobSpec.load(_write(tmp_path, broken))
    assert "Shh" not in str(info.value) and "at line 2, column" in str(info.value)
    with pytest.raises(JobSpecError) as info:
        JobSpec.load(_write(tmp_path, BASE_YAML), ["input.storage_options.secret: Shh_2"])
    assert "Shh_2" not in str(info.value)
    assert "'input.storage_options.secret'...: expected key.path=value" in str(info.value)


def test_a_set_item_without_a_key_says_so_not_that_it_has_no_equals_sign(
    tmp_path: Path,
) -> None:
    """An audit: ``--set =3`` was refused with "(no '=')", though the item has one; what it
    lacks is the key."""
    with pytest.raises(JobSpecError) as info:
        JobSpec.load(_write(tmp_path, BASE_YAML), ["=3"])
    assert "expected key.path=value (no key before '=')" in str(info.value)
    with pytest.raises(JobSpecError) as info:
        JobSpec.load(_write(tmp_path, BASE_YAML), ["sampling.max_tokens"])
    assert "expected key.path=value (no '=')" in str(info.value)


@pytest.mark.parametrize(
    ("sampling", "what"),
    [
        ({"stop": [""]}, "stop: expected non-empty strings, got ['']"),
        ({"stop": ["ok", ""]}, "stop: expected non-empty strings, got ['ok', '']"),
        ({"top_k": 2**32}, "top_k: expected -1"),
        # (2**64 sampled as seed 0)
        ({"seed": 2**64}, "seed: expected None or an integer in [-2**63, 2**63 - 1]"),
    ],
)
def test_sampling_values_every_row_would_refuse_fail_the_spec(
    sampling: dict[str, Any], what: str
) -> None:
    """Refused by SamplingParams in each row, they made every row an error and exited 0;
    the error names the key (sampling.stop: it said "sampling: stop must be ...")."""
    assert f"sampling.{what}" in _error(_raw(sampling=sampling))


@pytest.mark.parametrize(
    ("constraint", "what"),
    [
        ({"regex": "(?i)ab"}, "Regex parsing error"),
        ({"json_schema": {"type": "number", "multipleOf": 0.5}}, "'multipleOf'"),
    ],
)
def test_a_constraint_xgrammar_cannot_run_fails_a_spec_that_picks_xgrammar(
    constraint: dict[str, Any], what: str
) -> None:
    """llguidance runs both: only a job on xgrammar is refused, before the model loads."""
    pytest.importorskip("xgrammar")
    sampling = {"structured_output": constraint}
    JobSpec.from_dict(_raw(sampling=sampling))
    message = _error(_raw(sampling=sampling, engine={"structured_output_backend": "xgrammar"}))
    assert "engine: structured_output_backend xgrammar cannot run sampling.structured_output" in (
        message
    )
    assert what in message


@pytest.mark.parametrize(
    ("schema", "what"),
    [
        ({"type": "object", "minProperties": 2}, "schema.minProperties is 2"),  # both libraries
        ({"type": "integer", "minimum": 2**53 + 1}, "schema.minimum is"),
        ({"type": "objectx"}, "cannot compile this JSON schema"),  # the check compiles it
    ],
)
def test_a_schema_every_backend_is_refused_names_no_library_for_xgrammar(
    schema: dict[str, Any], what: str
) -> None:
    """The sampling section checks every constraint as llguidance reads it, whatever the
    backend: a job on xgrammar was told "llguidance cannot use this JSON schema"."""
    engine = {"structured_output_backend": "xgrammar"}
    message = _error(_raw(sampling={"structured_output": {"json_schema": schema}}, engine=engine))
    assert "sampling.structured_output: json_schema: " in message and what in message
    assert "llguidance" not in message


def test_a_job_wide_logit_bias_past_the_vocabulary_fails_the_spec(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Only the model knows its vocabulary: the check runs before its weights load (every row
    failed on it, exit 0)."""
    from tests.jobs.job_helpers import chat_rows, job_dict, write_jsonl
    from tokenmill import run_job
    from tokenmill.jobs.dry_run import dry_run

    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(4))
    spec = job_dict(tiny_model, src, tmp_path / "out", sampling={"logit_bias": {5: 1, 10**6: -100}})
    for run in (
        lambda: run_job(spec, show_progress=False),
        lambda: dry_run(JobSpec.from_dict(spec)),
    ):
        with pytest.raises(JobSpecError, match=r"sampling.logit_bias: token ids \[1000000\] are"):
            run()
    assert not (tmp_path / "out" / "shards").exists()


@pytest.mark.parametrize(
    ("columns", "what"),
    [(["Text"], "Text would overwrite"), (["ID", "topic"], "ID would overwrite"),
     (["Meta", "meta"], "'Meta' and 'meta' differ only in case"),
     (["\ud83d\ude00"], "is not valid Unicode")],
)  # fmt: skip
def test_passthrough_names_are_compared_without_case_and_must_be_unicode(
    columns: list[str], what: str
) -> None:
    """duckdb renamed a passthrough 'Text' to 'Text_1' and answered SELECT "Text" with the
    generated text."""
    assert what in _error(_raw(input={"path": "in.jsonl", "passthrough_columns": columns}))


@pytest.mark.parametrize(
    ("execution", "named"),
    [({"replicas": 3}, ["replicas: needs executor: ray, got 3 "]),
     ({"ray_address": "ray://head:10001"}, ["ray_address: needs executor: ray, got 'ray://"]),
     ({"replicas": 2, "ray_address": "auto"}, ["replicas: needs", "ray_address: needs"]),
     ({"stall_timeout_s": 5}, ["stall_timeout_s: needs executor: ray, got 5.0 "]),  # (taken once)
     ({"stall_timeout_s": None}, ["stall_timeout_s: needs executor: ray, got null "]),
     ({"replica_failures_in_a_row": 4}, ["replica_failures_in_a_row: needs executor: ray"])],
)  # fmt: skip
def test_ray_settings_with_the_local_executor_are_refused(
    execution: dict[str, Any], named: list[str]
) -> None:
    """They were ignored: replicas: 3 ran one engine, exit 0. Each error names its own key
    (an audit: they were all ``execution: ...``, a null shown as Python's None)."""
    lines = _error(_raw(execution=execution)).splitlines()[1:]
    assert len(lines) == len(named), lines
    for line, said in zip(lines, named, strict=True):
        assert line.startswith(f"  execution.{said}"), line
    JobSpec.from_dict(_raw(execution={**execution, "executor": "ray"}))


def test_a_ray_setting_given_with_set_says_the_command_line_set_it(tmp_path: Path) -> None:
    """An audit: ``--set execution.replicas=4`` on a local job was reported against the
    section (``execution: replicas: 4: needs ...``), not as set on the command line."""
    with pytest.raises(JobSpecError) as info:
        JobSpec.load(_write(tmp_path, BASE_YAML), ["execution.replicas=4"])
    assert str(info.value).splitlines()[1].startswith("  execution.replicas: needs executor: ray")
    assert str(info.value).endswith("(set on the command line)")


def test_readme_names_every_key_the_local_executor_refuses() -> None:
    """An audit: the job.yaml reference said "replicas, ray_address or stall_timeout_s with
    local: exit 2" and left out replica_failures_in_a_row, refused as well."""
    readme = (REPO / "README.md").read_text()
    reference = readme.split("### job.yaml reference", 1)[1].split("```yaml\n", 1)[1]
    execution = reference.split("\nexecution:", 1)[1].split("\nplanner:", 1)[0]
    said = " ".join(line.split("#", 1)[-1].strip() for line in execution.splitlines())
    refused = said.split("(", 1)[1].split("with local: exit 2", 1)[0]
    assert [key for key in RAY_ONLY if key not in refused] == [], refused


def test_openai_response_format_is_the_structured_output_it_means() -> None:
    """Issue 15 names sampling.response_format (OpenAI's spelling) for plain jobs: read as
    structured_output, so the job and its fingerprint are the ones written that way."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    openai = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}}
    as_openai = JobSpec.from_dict(_raw(sampling={"response_format": openai}))
    as_ours = JobSpec.from_dict(_raw(sampling={"structured_output": {"json_schema": schema}}))
    assert as_openai.to_dict() == as_ours.to_dict()
    json_object = JobSpec.from_dict(_raw(sampling={"response_format": {"type": "json_object"}}))
    assert json_object.sampling.structured_output == "json_object"
    text = JobSpec.from_dict(_raw(sampling={"response_format": {"type": "text"}}))
    assert text.sampling.structured_output is None
    assert "response_format.json_schema must be an object with" in _error(
        _raw(sampling={"response_format": {"type": "json_schema"}})
    )
    unset = JobSpec.from_dict(_raw(sampling={"response_format": None}))  # as structured_output
    assert unset.to_dict() == JobSpec.from_dict(_raw()).to_dict()
    both = {"response_format": {"type": "json_object"}, "structured_output": "json_object"}
    assert "response_format and structured_output both set" in _error(_raw(sampling=both))


@pytest.mark.parametrize(
    ("text", "said"),
    [("sampling: {temperature: 1e-3}", "'1e-3' (YAML reads 1e-3 as text: write 0.001)"),
     ("sampling: {max_tokens: 1e3}", "(YAML reads 1e3 as text: write 1000)"),
     ("engine: {kv_cache_memory: 2e9}", "2e9 as text: write 2000000000)"),  # bytes: no float
     ("engine: {kv_cache_memory: 5e-1}", "5e-1 as text: write 0.5)"),
     ("engine: {max_num_seqs: 1e3}", "(YAML reads 1e3 as text: write 1000)"),
     ("engine: {max_model_len: '512'}", "got the string '512' (YAML reads 512 as text: write 512)"),
     ("engine: {max_num_seqs: -1e3}", "expected a positive integer, got the string '-1e3'\n"),
     ("name: 2024-12-01", "got datetime.date(2024, 12, 1) (YAML read it as a date: quote it"),
     ("name: 007", "got 7 (YAML read it as a number: quote it to keep it text)"),
     ("sampling: {temperature: .inf}", "expected a finite number, got inf\n"),
     ("sampling: {temperature: hot}", "got the string 'hot'\n")],
)  # fmt: skip
def test_what_yaml_read_as_another_type_says_how_to_write_it(
    tmp_path: Path, text: str, said: str
) -> None:
    """An audit: `temperature: 1e-3` (text to YAML 1.1) and `name: 2024-12-01` (a date) were
    refused without a word on how to write them."""
    base = "model: {source: m}\ninput: {path: in.jsonl}\noutput: {path: out/}\n"
    with pytest.raises(JobSpecError) as info:
        JobSpec.load(_write(tmp_path, base + text + "\n"))
    assert said in str(info.value) + "\n"


def test_an_unknown_key_close_to_a_real_one_is_suggested() -> None:
    """An audit: `sampling.max_token` said "unknown key" and nothing of max_tokens."""
    error = _error(_raw(sampling={"max_token": 3, "zzz": 1}, engine={"max_num_seq": 4}))
    assert "sampling.max_token: unknown key (did you mean sampling.max_tokens?)" in error
    assert "engine.max_num_seq: unknown key (did you mean engine.max_num_seqs?)" in error
    assert "sampling.zzz: unknown key\n" in error + "\n"  # nothing close: no guess
    assert "outptu: unknown key (did you mean output?)" in _error({**_raw(), "outptu": {}})


def test_an_error_in_a_key_the_command_line_set_says_so_not_only_the_file(
    tmp_path: Path,
) -> None:
    """An audit: ``run-job job.yaml --set engine.foo=1`` said ``job.yaml: invalid job
    spec: engine.foo: unknown key``, sending the user to a file that does not hold it."""
    job = _write(tmp_path, BASE_YAML)
    with pytest.raises(JobSpecError) as info:
        JobSpec.load(job, ["engine.foo=1", "sampling=3"])
    message = str(info.value)
    assert message.startswith(f"{job}: invalid job spec:")
    assert "engine.foo: unknown key (set on the command line)" in message
    assert "sampling: expected a mapping, got 3 (set on the command line)" in message
    # A key of the file itself is not said to be the command line's.
    with pytest.raises(JobSpecError) as info:
        JobSpec.load(_write(tmp_path, BASE_YAML + "bogus: 1\n"), ["sampling.max_tokens=2"])
    assert "bogus: unknown key" in str(info.value)
    assert "command line" not in str(info.value)
