"""tokenmill as a stage of a Ray Data pipeline: ``build_processor`` turns a model and its
settings into a function from a ``ray.data.Dataset`` of prompts to one with the generated
text, run by a pool of engine replicas (Ray actors), each a tokenmill ``LLM``:

    ds (rows)  --preprocess-->  rows with "messages" or "prompt" (+ "sampling_params")
               --map_batches(EngineReplica, concurrency=N)-->  + generated columns
               --postprocess-->  what the user keeps

A row the engine cannot run (an over-long prompt, a conversation the chat template
rejects, a bad sampling value) gets ``error`` set and empty outputs; the rest of its batch
runs (one bad row never fails a batch; an exception in ``preprocess`` or ``postprocess``
fails the dataset, as any Ray Data map does). Batches come as Arrow tables, so every input
column is kept as it is: its values and types (numpy batches turned nullable integer ids
into floats that collided, and an all-null column's NaN into the prompt "nan"). A user
column named like an output column is replaced by it.

Columns added: ``generated_text``, ``generated_token_ids``, ``num_input_tokens``,
``num_generated_tokens``, ``finish_reason`` (stop, length or error), ``error`` (None or what
went wrong).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.engine.prompts import ChatTemplate

__all__ = ["OUTPUT_COLUMNS", "EngineReplica", "ProcessorConfig", "build_processor"]

OUTPUT_COLUMNS = (
    "generated_text",
    "generated_token_ids",
    "num_input_tokens",
    "num_generated_tokens",
    "finish_reason",
    "error",
)

# The columns a replica reads; every other column passes through as Arrow, never turned
# into Python values (a timestamp past year 9999 raised OverflowError there, failing the
# dataset over a column the engine never reads, and a large passthrough column was copied
# into Python objects for nothing).
INPUT_COLUMNS = ("messages", "prompt", "prompt_token_ids", "sampling_params")

Row = dict[str, Any]

log = logging.getLogger("tokenmill.integrations")


@dataclass(frozen=True)
class ProcessorConfig:
    """What the processor runs.

    ``model``: an alias, an HF directory or a .gguf file (as ``LLM``'s). ``engine``: the
    engine's settings (``EngineConfig``'s fields: device, dtype, max_num_seqs, ...).
    ``sampling``: default ``SamplingParams`` fields, under a row's own ``sampling_params``.
    ``concurrency``: engine replicas; ``batch_size``: rows a replica gets per call (a
    multiple of max_num_seqs keeps its engine full); ``num_gpus``: per replica (None: 1 when
    the engine's device is cuda, or auto on a cluster with GPUs, else 0).
    ``chat_template`` (Jinja text, or a local file holding it, read here so replicas get
    the text) replaces the model's for the ``messages`` rows;
    ``chat_template_kwargs`` are variables it reads (``{"enable_thinking": False}``);
    ``add_generation_prompt`` / ``continue_final_message`` how every conversation ends: a
    new assistant turn, or (False / True) the last message, an assistant's reply begun,
    continued (a row whose last message is not an assistant's is then that row's error).
    """

    model: str = "smollm2-135m-instruct"
    engine: Mapping[str, Any] = field(default_factory=dict)
    sampling: Mapping[str, Any] = field(default_factory=dict)
    concurrency: int = 1
    batch_size: int = 256
    num_gpus: float | None = None
    num_cpus: float = 1
    chat_template: str | None = None
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def __post_init__(self) -> None:
        for name in ("concurrency", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ProcessorConfig.{name} must be an integer >= 1, got {value!r}")
        for name in ("num_cpus", "num_gpus"):  # Ray refused these only once the dataset ran,
            value = getattr(self, name)  # naming no ProcessorConfig key ('1' was a TypeError)
            if value is None and name == "num_gpus":
                continue
            if not _is_resource_quantity(value):
                raise ValueError(
                    f"ProcessorConfig.{name} must be a finite number >= 0 (what one replica "
                    f"asks Ray for){' or None' if name == 'num_gpus' else ''}, got {value!r}"
                )
        for name, of in (("engine", "EngineConfig's"), ("sampling", "SamplingParams'")):
            value = getattr(self, name)
            if not isinstance(value, Mapping):  # dict() and ** took a list of pairs, or
                raise TypeError(  # said "'NoneType' object is not iterable"
                    f"ProcessorConfig.{name} must be a mapping of {of} fields, got {value!r}"
                )
        from tokenmill.engine.engine_config import EngineConfig
        from tokenmill.engine.prompts import check_chat_options
        from tokenmill.engine.sampling_params import SamplingParams
        from tokenmill.engine.vllm_settings import engine_settings as vllm_engine_settings
        from tokenmill.jobs.chat_template_setting import chat_template_setting

        settings = vllm_engine_settings(self.model, dict(self.engine))  # as LLM takes them
        EngineConfig.from_settings(self.model, **settings)  # refuse bad settings here,
        _one_completion(SamplingParams(**self.sampling), "ProcessorConfig.sampling")  # not
        # in every replica
        if self.chat_template is not None:  # the text, or a file holding it, as in a job
            if not isinstance(self.chat_template, str):
                raise ValueError(
                    "ProcessorConfig.chat_template must be a Jinja template, the path of a "
                    f"file holding one, or None, got {self.chat_template!r}"
                )
            try:
                text = chat_template_setting(self.chat_template)
            except ValueError as exc:
                raise ValueError(f"ProcessorConfig.chat_template: {exc}") from None
            object.__setattr__(self, "chat_template", text)  # replicas get the text
        try:
            self.chat().arguments()
            check_chat_options(self.add_generation_prompt, self.continue_final_message)
        except ValueError as exc:
            raise ValueError(f"ProcessorConfig.{exc}") from None

    def chat(self) -> ChatTemplate:
        """How the ``messages`` rows are rendered."""
        from tokenmill.engine.prompts import ChatTemplate

        return ChatTemplate.of_settings(self)

    def gpus_per_replica(self, cluster_gpus: float = 0.0) -> float:
        """GPUs a replica asks Ray for: ``num_gpus``, else one when the engine runs on
        CUDA, named or (device auto, the default) found on the cluster (``cluster_gpus``):
        asking for none there left every replica of a node on cuda:0, unaccounted for."""
        if self.num_gpus is not None:
            return self.num_gpus
        device = str(self.engine.get("device", "auto"))
        on_gpu = device.startswith("cuda") or (device == "auto" and cluster_gpus > 0)
        return 1.0 if on_gpu else 0.0


class EngineReplica:
    """One engine, fed a batch of rows per call (Ray Data's callable-class contract)."""

    def __init__(self, config: ProcessorConfig) -> None:
        from tokenmill.engine.llm import LLM

        self.config = config
        self.chat = config.chat()
        self.llm = LLM(config.model, **config.engine)

    def __call__(self, batch: Any) -> Any:
        """``batch`` (an Arrow table) with the output columns set."""
        import pyarrow as pa

        read = [name for name in INPUT_COLUMNS if name in batch.column_names]
        results = self.run(batch.select(read).to_pylist(), columns=batch.column_names)
        for name, kind in _output_types().items():
            column = pa.array([r[name] for r in results], type=kind)
            if name in batch.column_names:
                batch = batch.drop_columns([name])
            batch = batch.append_column(name, column)
        return batch

    def run(self, rows: list[Row], columns: list[str] | None = None) -> list[Row]:
        """The generated columns for each row, in order. ``columns``: the batch's, named in
        the error of a row with no prompt column (default: the row's keys)."""
        from tokenmill.engine.sampling_params import SamplingParams

        results: list[Row | None] = [None] * len(rows)
        prompts, params, where = [], [], []
        for i, row in enumerate(rows):
            try:
                tokens = self._prompt_tokens(row, columns)
                sampling = {**self.config.sampling, **_mapping(row.get("sampling_params"))}
                params.append(_one_completion(SamplingParams(**sampling), "sampling_params"))
            except (ValueError, TypeError) as exc:
                # The error lands on the row itself; its index in this batch (one Ray Data
                # cut, never shown to the user) named no row the user can find.
                results[i] = _failed(str(exc))
                continue
            prompts.append(tokens)
            where.append(i)
        outs = self.llm.generate(prompts, params) if prompts else []
        for i, out in zip(where, outs, strict=True):
            results[i] = {
                "generated_text": out.text,
                "generated_token_ids": list(out.token_ids),
                "num_input_tokens": len(out.prompt_token_ids),
                "num_generated_tokens": len(out.token_ids),
                "finish_reason": out.finish_reason,
                "error": out.error,
            }
        return results  # type: ignore[return-value]

    def _prompt_tokens(self, row: Row, columns: Iterable[str] | None = None) -> list[int]:
        from tokenmill.engine.chat_messages import conversation_cell, normalize_messages
        from tokenmill.engine.prompts import encode_prompt

        if row.get("messages") is not None:
            messages = normalize_messages(conversation_cell(row["messages"]))
            generation, final = self.chat.ending(messages)
            return self.llm.encode_chat(
                messages,
                add_generation_prompt=generation,
                chat_template=self.config.chat_template,
                chat_template_kwargs=self.config.chat_template_kwargs,
                continue_final_message=final,
            )
        if row.get("prompt") is not None:
            if not isinstance(row["prompt"], str):
                raise ValueError(f"prompt must be a string, got {type(row['prompt']).__name__}")
            return encode_prompt(self.llm.tokenizer, row["prompt"])
        if row.get("prompt_token_ids") is not None:
            ids = row["prompt_token_ids"]
            if hasattr(ids, "tolist"):  # a tensor column's cell (numpy ids) is an ndarray
                ids = ids.tolist()
            if not isinstance(ids, list) or not all(type(t) is int for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers")
            return ids
        null = [name for name in ("messages", "prompt", "prompt_token_ids") if name in row]
        if null:
            verb = "is" if len(null) == 1 else "are"
            raise ValueError(f"its {' and '.join(map(repr, null))} {verb} null")
        raise ValueError(
            "needs a 'messages', 'prompt' or 'prompt_token_ids' column (a preprocess "
            f"function can build one); it has {sorted(row if columns is None else columns)}"
        )


def _is_resource_quantity(value: Any) -> bool:
    from tokenmill.engine.sampling_params import is_number  # (as the module's other uses)

    return is_number(value) and value >= 0


def _one_completion(params: Any, where: str) -> Any:
    """``params``, or ValueError when it asks for several completions: a row's output columns
    hold one (a row with n > 1 would lose all but the first); or for logprobs, which no
    output column holds (they ran and were dropped)."""
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None:
            raise ValueError(
                f"{where}: {name}={getattr(params, name)}, but the processor writes no "
                f"{name} column; leave {name} unset"
            )
    if params.n > 1:
        raise ValueError(
            f"{where}: n={params.n}, but a row's generated_text holds one completion; for "
            "several samples of a prompt, repeat its row (e.g. ds.flat_map) with different "
            "seeds (best_of, which keeps the best one, is fine)"
        )
    return params


def build_processor(
    config: ProcessorConfig,
    preprocess: Callable[[Row], Row] | None = None,
    postprocess: Callable[[Row], Row] | None = None,
) -> Callable[[Any], Any]:
    """A function ``ds -> ds`` running ``config``'s model over a Ray Dataset's rows (see
    the top). Refuses bad engine or sampling settings at once (ValueError, TypeError)."""

    def process(ds: Any) -> Any:
        import ray
        from ray.data import ActorPoolStrategy

        if not ray.is_initialized():
            ray.init()  # (Ray Data would at execution) to see what the cluster has
        resources = ray.cluster_resources()
        _warn_if_replicas_take_every_cpu(config, resources.get("CPU", 0.0))
        num_gpus = config.gpus_per_replica(resources.get("GPU", 0.0))
        _warn_if_replicas_want_more_gpus(num_gpus, resources.get("GPU", 0.0))
        if preprocess is not None:
            ds = ds.map(preprocess)
        ds = ds.map_batches(
            EngineReplica,
            fn_constructor_kwargs={"config": config},
            batch_size=config.batch_size,
            batch_format="pyarrow",
            compute=ActorPoolStrategy(size=config.concurrency),  # (`concurrency=`
            # is deprecated from Ray 2.51)
            num_gpus=num_gpus,
            num_cpus=config.num_cpus,
        )
        if postprocess is not None:
            ds = ds.map(postprocess)
        return ds

    return process


def _mapping(value: Any) -> dict[str, Any]:
    """A row's ``sampling_params`` as Python values: a mapping, or its JSON text. An Arrow
    struct column holds every row's fields in every row (None where a row has none: dropped
    here, nested ones too, so a JSON schema given as a struct cannot hold a null: give it as
    JSON text), and integers as floats where the column has nulls (6.0: an int again). A
    structured-output mapping of StructuredOutputsParams' fields is built into one, as Ray
    Data LLM rows give it (``params_of_fields``)."""
    from tokenmill.engine.structured_output_params import params_of_fields

    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"sampling_params is text but not JSON ({exc})") from None
        if value is None:  # json.dumps(None): no params of its own
            return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"sampling_params must be a mapping, got {type(value).__name__}")
    out = {}
    for key, v in value.items():
        if v is None:
            continue
        if hasattr(v, "tolist"):  # numpy scalars and arrays
            v = v.tolist()
        v = _without_nulls(v)
        if isinstance(v, float) and v.is_integer() and key in _int_fields():
            v = int(v)
        out[key] = params_of_fields(v) if key in _STRUCTURED_KEYS else v
    return out


_STRUCTURED_KEYS = ("structured_output", "structured_outputs", "guided_decoding")


def _without_nulls(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


@functools.cache
def _output_types() -> dict[str, Any]:
    """The output columns' Arrow types: the same in every block, whatever its values."""
    import pyarrow as pa

    return {
        "generated_text": pa.string(),
        "generated_token_ids": pa.list_(pa.int64()),
        "num_input_tokens": pa.int64(),
        "num_generated_tokens": pa.int64(),
        "finish_reason": pa.string(),
        "error": pa.string(),
    }


def _warn_if_replicas_take_every_cpu(config: ProcessorConfig, cluster_cpus: float) -> None:
    """Replicas holding every CPU leave none for the tasks that read and map the rows
    before them: the pipeline waits forever, silently (the job executor says so too)."""
    wanted = config.concurrency * config.num_cpus
    if cluster_cpus and wanted >= cluster_cpus:
        log.warning(
            "the %d engine replicas ask for %g CPUs, all the cluster's %g: Ray Data's read "
            "and map tasks get none and the pipeline waits; lower concurrency or num_cpus",
            config.concurrency, wanted, cluster_cpus,
        )  # fmt: skip


def _warn_if_replicas_want_more_gpus(num_gpus: float, cluster_gpus: float) -> None:
    """A replica asking for more GPUs than the cluster has (``num_gpus=1``, or an engine
    device of cuda, on a cluster of CPUs) never starts: the pipeline waited forever, its
    progress line the only sign. A warning, not an error: an autoscaler may add GPUs."""
    if num_gpus > cluster_gpus:
        log.warning(
            "each engine replica asks Ray for %g GPUs, but the cluster has %g: no replica "
            "starts and the pipeline waits (unless GPU nodes join); to run on CPUs, set "
            "ProcessorConfig(num_gpus=0, engine={'device': 'cpu'})",
            num_gpus, cluster_gpus,
        )  # fmt: skip


@functools.cache
def _int_fields() -> frozenset[str]:
    from tokenmill.engine.sampling_params import SamplingParams

    types = {f.name: str(f.type) for f in fields(SamplingParams)}
    return frozenset(name for name, t in types.items() if "int" in t and "float" not in t)


def _failed(message: str) -> Row:
    return {
        "generated_text": "",
        "generated_token_ids": [],
        "num_input_tokens": 0,
        "num_generated_tokens": 0,
        "finish_reason": "error",
        "error": message,
    }
