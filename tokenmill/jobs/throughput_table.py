"""The measured throughput table (throughput_table.json) and the dry run's time estimate.

    the job's model ─► weights (model_params) ─┐
    engine.device, the GPU seen here ──────────┼─► the nearest measured entry ─► its tok/s
    model.dtype, model.quantization ───────────┘
    predicted output tokens / tok/s ─► estimated time (one replica; Ray: / replicas)
    rows a step can hold (rows, engine.max_num_seqs) ─► a note when far below the entry's

Every entry is a figure measured by a benchmark and written in BENCHMARKS.md; nothing here
models hardware. An entry is chosen by device (GPU or CPU) first, then by size (within a
factor of two counts as the same size), then the GPU's name, quantization and dtype; every
way the chosen entry differs from the job is said beside the estimate, because a rate
measured on another workload, model size or GPU can be off by several times.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources

from tokenmill.engine.model_config import ModelConfig

__all__ = ["Estimate", "ThroughputEntry", "estimate_time", "load_table", "model_params"]

TABLE_FILE = "throughput_table.json"


@dataclass(frozen=True)
class ThroughputEntry:
    name: str
    model: str
    params: int
    device: str  # gpu | cpu
    hardware: str  # "H200", "2 cores of an Intel Xeon"
    dtype: str
    quantization: str
    output_tokens_per_s: float
    rows_in_flight: int  # the most rows a decode step of the measured run held
    figure: str  # as BENCHMARKS.md writes it
    workload: str
    source: str  # the heading of its section in BENCHMARKS.md


@dataclass(frozen=True)
class Estimate:
    """Predicted output tokens over a measured rate; ``notes`` say how the job differs."""

    entry: ThroughputEntry
    output_tokens: int
    seconds: float  # on one replica
    replicas: int = 1
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def wall_seconds(self) -> float:
        """With ``replicas`` replicas sharing the rows evenly."""
        return self.seconds / self.replicas


def load_table() -> list[ThroughputEntry]:
    """The entries of the table shipped in the package."""
    text = resources.files("tokenmill.jobs").joinpath(TABLE_FILE).read_text()
    return [ThroughputEntry(**raw) for raw in json.loads(text)["entries"]]


def model_params(config: ModelConfig) -> int:
    """Weights of the embeddings, the LM head (unless tied) and every layer's linear layers
    (norms left out): what a decode step reads, so what its time roughly scales with."""
    h, d = config.hidden_size, config.head_dim
    attention = h * config.num_attention_heads * d * 2 + h * config.num_key_value_heads * d * 2
    mlp = 3 * h * config.intermediate_size
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return embeddings + config.num_hidden_layers * (attention + mlp)


def estimate_time(
    output_tokens: int,
    params: int,
    device: str,
    gpu_name: str | None,
    dtype: str,
    quantization: str,
    replicas: int = 1,
    table: list[ThroughputEntry] | None = None,
    rows_in_flight: int | None = None,
) -> Estimate:
    """The time ``output_tokens`` take at the rate of the entry nearest to the job: a model of
    ``params`` weights on ``device`` ("gpu" or "cpu"; ``gpu_name`` when one is visible), in
    ``dtype`` with ``quantization``, over ``replicas`` replicas, each decode step holding up
    to ``rows_in_flight`` rows (None: not known)."""
    entries = table if table is not None else load_table()
    if not entries:
        raise ValueError(f"{TABLE_FILE} has no entries")
    same_device = [e for e in entries if e.device == device] or entries

    def distance(e: ThroughputEntry) -> tuple[int, bool, bool, bool, float]:
        size = abs(math.log2(e.params / max(params, 1)))
        return (
            round(size),
            not (gpu_name and e.hardware.lower() in gpu_name.lower()),
            e.quantization != quantization,
            e.dtype != dtype,
            size,
        )

    entry = min(same_device, key=distance)
    notes = _differences(entry, params, device, gpu_name, dtype, quantization)
    if rows_in_flight is not None and rows_in_flight * 2 <= entry.rows_in_flight:
        notes.append(
            f"a step holds at most {rows_in_flight:,} sequences here (the job's rows, a row of "
            "n completions n of them, or engine.max_num_seqs, whichever is fewer), "
            f"{entry.rows_in_flight:,} in the entry: a decode step takes about as long with "
            "fewer, so expect it slower, by up to about "
            f"{entry.rows_in_flight / max(rows_in_flight, 1):,.0f}x"
        )
    seconds = output_tokens / entry.output_tokens_per_s
    return Estimate(entry, output_tokens, seconds, max(replicas, 1), tuple(notes))


def _differences(
    entry: ThroughputEntry,
    params: int,
    device: str,
    gpu_name: str | None,
    dtype: str,
    quantization: str,
) -> list[str]:
    notes = []
    if entry.device != device:
        notes.append(f"no {device.upper()} entry: measured on a {entry.device.upper()}")
    ratio = params / entry.params
    if ratio >= 2 or ratio <= 0.5:
        notes.append(
            f"the model has {_count(params)} weights, the entry {_count(entry.params)}: "
            "time grows roughly with the weights, so expect it to be off by about that factor"
        )
    if device == "gpu" and gpu_name and entry.hardware.lower() not in gpu_name.lower():
        notes.append(f"measured on an {entry.hardware}; this machine's GPU is {gpu_name}")
    if device == "gpu" and not gpu_name:
        notes.append(f"no GPU visible here: assumes the run gets an {entry.hardware}")
    if entry.quantization != quantization:
        notes.append(f"measured with quantization {entry.quantization}, the job has {quantization}")
    if entry.dtype != dtype:
        notes.append(f"measured in {entry.dtype}, the job runs {dtype}")
    return notes


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)
