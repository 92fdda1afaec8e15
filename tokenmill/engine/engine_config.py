"""EngineConfig: how one engine replica runs; the one place engine settings are declared.

Each field carries its default and its rule (``metadata["rule"]``, a :class:`Rule`);
``__post_init__`` checks every field against its rule. ``LLM(model, **settings)`` takes these
fields as keywords (``EngineConfig.from_settings``) and the job spec's ``engine`` section is
built from them (``tokenmill/jobs/engine_section.py``), so a setting, its default and what it
accepts are written here and nowhere else.

Importing this module does not import torch: the job spec validates against it on machines
and in commands that never run a model.
"""

from __future__ import annotations

import difflib
import gc
import os
import re
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from tokenmill.engine.core.draft_tree import MAX_TREE_DRAFTS
from tokenmill.engine.model_config import ModelConfig
from tokenmill.engine.sampling_params import SEED_RANGE

if TYPE_CHECKING:
    import torch

__all__ = [
    "EngineConfig",
    "EngineSettingError",
    "Rule",
    "SpeculativeConfig",
    "UnknownSettingError",
    "auto_device",
]


def auto_device() -> str:
    """What ``device="auto"`` resolves to: "cuda" where a CUDA GPU is visible, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


_DTYPES = {  # accepted name -> torch dtype name
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",  # torch's and vLLM's other names
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}
_DEVICE = re.compile(r"auto|cpu|cuda|cuda:(0|[1-9][0-9]{0,2})")  # torch keeps n in an int8
DEFAULT_CPU_KV_BYTES = 2 << 30
DEFAULT_GPU_MEMORY_FRACTION = 0.9

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60


def _shown(value: Any) -> str:
    """A bounded repr: a bad value may be a 10 MB string or a 5,000-digit integer."""
    try:
        return _REPR.repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        return f"an integer of {value.bit_length()} bits"


class EngineSettingError(ValueError):
    """A setting's value breaks its rule: ``key``, the ``value`` given and what was
    ``expected`` (the job spec shows the value as YAML spells it)."""

    def __init__(self, key: str, value: Any, expected: str) -> None:
        super().__init__(key, value, expected)
        self.key, self.value, self.expected = key, value, expected

    def __str__(self) -> str:
        return f"{self.key}: expected {self.expected}, got {_shown(self.value)}"


class UnknownSettingError(EngineSettingError):
    """A settings group's mapping names a key the group lacks (``speculative.max_token``):
    ``close`` is the group's key it most likely misspells (``max_tokens``), else None."""

    def __init__(self, key: str, value: Any, known: list[str]) -> None:
        super().__init__(key, value, f"one of the keys {', '.join(known)}")
        found = difflib.get_close_matches(key.rpartition(".")[2], known, n=1, cutoff=0.75)
        self.close = found[0] if found else None
        self.known = known

    def __str__(self) -> str:
        group = self.key.rpartition(".")[0]
        guess = f"did you mean {group}.{self.close}? " if self.close else ""
        return f"{self.key}: unknown key ({guess}the keys: {', '.join(self.known)})"


@dataclass(frozen=True)
class Rule:
    """What a setting accepts. ``expected`` completes "expected ..., got <value>";
    ``convert`` turns an accepted value into the setting's own type (a mapping into a
    settings group), when it has one."""

    expected: str
    accepts: Callable[[Any], bool]
    convert: Callable[[Any], Any] | None = None

    def check(self, key: str, value: Any) -> Any:
        """``value`` (converted) if the rule accepts it; raises EngineSettingError naming
        ``key``."""
        if not self.accepts(value):
            raise EngineSettingError(key, value, self.expected)
        return value if self.convert is None else self.convert(value)


def _rule(
    expected: str, accepts: Callable[[Any], bool], convert: Callable[[Any], Any] | None = None
) -> Mapping[str, Rule]:
    return MappingProxyType({"rule": Rule(expected, accepts, convert)})


def _one_of(*choices: str) -> Mapping[str, Rule]:
    return _rule(f"one of {', '.join(choices)}", lambda v: isinstance(v, str) and v in choices)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is no batch size


def _is_device(value: Any) -> bool:
    if not isinstance(value, str) or _DEVICE.fullmatch(value) is None:
        return False
    return not value.startswith("cuda:") or int(value[5:]) <= 127


def _is_kv_memory(value: Any) -> bool:
    if value is None or (_is_int(value) and value > 0):
        return True
    return isinstance(value, float) and 0 < value <= 1  # nan and inf fail both


MODEL = _rule(
    "a model alias, HF directory or .gguf file (a non-empty string)",
    lambda v: isinstance(v, str) and v.strip() != "" and "\0" not in v,
)
DTYPE = _rule(
    f"auto or one of {', '.join(sorted(_DTYPES))}",
    lambda v: isinstance(v, str) and (v == "auto" or v in _DTYPES),
)
DEVICE = _rule("one of auto, cpu, cuda, cuda:<n> (n a GPU index: 0, 1, ...)", _is_device)
POSITIVE_INT = _rule("a positive integer", lambda v: _is_int(v) and v >= 1)
NON_NEGATIVE_INT = _rule("an integer >= 0", lambda v: _is_int(v) and v >= 0)
MODEL_LEN = _rule(
    "an integer >= 2, or unset for the model's own context length",
    lambda v: v is None or (_is_int(v) and v >= 2),
)
# The attention kernels count a request's keys in int32 (seq_lens, and the decode kernel's
# max_blocks * BLOCK_SIZE): a block past 2**30 tokens could never fill, and 2**40 was refused
# only once the weights had loaded, blaming kv_cache_memory.
MAX_BLOCK_SIZE = 2**30
BLOCK_SIZE = _rule(
    "a power of two from 1 to 2**30 (1, 2, 4, 8, 16, ...: the attention kernels count keys "
    "in int32; 16 to 128 are usual)",
    lambda v: _is_int(v) and 1 <= v <= MAX_BLOCK_SIZE and v & (v - 1) == 0,
)
KV_MEMORY = _rule(
    "bytes (a positive integer) or a fraction of the device's memory (a number in (0, 1])",
    _is_kv_memory,
)
BOOL = _rule("true or false", lambda v: isinstance(v, bool))
BOOL_OR_UNSET = _rule(
    "true or false, or unset (on with CUDA only)", lambda v: v is None or isinstance(v, bool)
)
# The engine's own seed follows a request's rule: torch's manual_seed refused 2**64 only
# once the weights had loaded ("Overflow when unpacking long long", naming no setting).
SEED = _rule(
    "an integer in [-2**63, 2**63 - 1] (a signed 64-bit seed, as SamplingParams.seed)",
    lambda v: _is_int(v) and SEED_RANGE[0] <= v <= SEED_RANGE[1],
)
# Each worker is a Python interpreter holding the tokenizer, all started at the first
# structured request: 10**12 passed here and had the engine start interpreters until the
# host gave out. A worker per core is the most that helps; unset picks at most 8.
MAX_GRAMMAR_PROCESSES = 64
PROCESSES = _rule(
    f"an integer from 0 to {MAX_GRAMMAR_PROCESSES}, or unset (on CUDA a worker per two CPU "
    "cores, at most 8; 0 on CPU)",
    lambda v: v is None or (_is_int(v) and 0 <= v <= MAX_GRAMMAR_PROCESSES),
)

SPECULATIVE_METHODS = ("off", "ngram", "suffix", "lookahead", "auto")
# A decode row of 1 + k tokens runs in the decode kernel and its CUDA graphs up to 8 tokens.
MAX_SPECULATIVE_TOKENS = 7


@dataclass(frozen=True)
class SpeculativeConfig:
    """Draft tokens for decode steps (speculative decoding; greedy output is unchanged and
    sampled output keeps its distribution, see engine/core/drafts.py).

    ``method``: off; ngram (prompt lookup: what followed the last earlier occurrence of
    the row's latest ``ngram_min``..``ngram_max`` tokens, spec_decode/ngram.py) on every
    step; suffix (the same, or what followed a longer match in the outputs of requests
    finished before, spec_decode/suffix.py) on every step; lookahead (Jacobi iteration over
    a window of ``lookahead_window`` guessed columns and up to ``lookahead_candidates``
    n-grams of ``max_tokens`` + 1 tokens from its trajectories, verified as one tree a row,
    spec_decode/lookahead.py) on every step; auto: suffix where a goodput policy measures
    that it pays (spec_decode/policy.py).
    ``max_tokens``: the most draft tokens a row takes per step (k); for lookahead, the
    length of a candidate (a row then computes (window + candidates) x k drafts a step).
    Raises EngineSettingError naming ``speculative.<key>``.
    """

    method: str = "off"
    max_tokens: int = 3
    ngram_min: int = 2
    ngram_max: int = 4
    lookahead_window: int = 5
    lookahead_candidates: int = 5

    def __post_init__(self) -> None:
        checks = (
            (
                "method",
                self.method in SPECULATIVE_METHODS,
                f"one of {', '.join(SPECULATIVE_METHODS)}",
            ),
            (
                "max_tokens",
                _is_int(self.max_tokens) and 1 <= self.max_tokens <= MAX_SPECULATIVE_TOKENS,
                f"an integer from 1 to {MAX_SPECULATIVE_TOKENS}",
            ),
            ("ngram_min", _is_int(self.ngram_min) and self.ngram_min >= 1, "an integer >= 1"),
            (
                "ngram_max",
                _is_int(self.ngram_max) and self.ngram_min <= self.ngram_max <= 16,
                f"an integer from ngram_min ({self.ngram_min}) to 16",
            ),
            (
                "lookahead_window",
                _is_int(self.lookahead_window) and 1 <= self.lookahead_window <= 32,
                "an integer from 1 to 32",
            ),
            (
                "lookahead_candidates",
                _is_int(self.lookahead_candidates)
                and 0 <= self.lookahead_candidates
                and (  # the tree only lookahead drafts
                    self.method != "lookahead"
                    or (self.lookahead_window + self.lookahead_candidates) * self.max_tokens
                    <= MAX_TREE_DRAFTS
                ),
                f"an integer >= 0 with (lookahead_window + lookahead_candidates) x max_tokens "
                f"<= {MAX_TREE_DRAFTS} (a step's tree of drafts)",
            ),
        )
        for key, ok, expected in checks:
            if not ok:
                raise EngineSettingError(f"speculative.{key}", getattr(self, key), expected)

    @classmethod
    def from_mapping(cls, value: Mapping[str, Any]) -> SpeculativeConfig:
        """From job.yaml's ``speculative:`` mapping; an unknown key is named. ``method:
        false`` is "off": YAML reads an unquoted ``off`` (also in ``--set``) as false."""
        known = {f.name for f in fields(cls)}
        for key in value:
            if key not in known:
                raise UnknownSettingError(f"speculative.{key}", value[key], sorted(known))
        if value.get("method") is False:
            value = {**value, "method": "off"}
        return cls(**value)


SPECULATIVE = _rule(
    "a mapping (method, max_tokens, ngram_min, ngram_max, lookahead_window, lookahead_candidates)",
    lambda v: isinstance(v, (Mapping, SpeculativeConfig)),
    # a mapping's keys and values are checked here, an error naming the key inside
    lambda v: SpeculativeConfig.from_mapping(v) if isinstance(v, Mapping) else v,
)


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings. Raises EngineSettingError (a ValueError) naming the key when a value
    breaks its rule.

    ``kv_cache_memory``: bytes (int) or a fraction of the device's memory (float in (0, 1]);
    None means 2 GiB on CPU (at most twice the blocks that ``max_num_seqs`` requests of
    ``max_model_len`` tokens hold) and 90% of the GPU's memory (less weights and activations).
    ``max_num_batched_tokens`` is the per-step token budget; prompts longer than it are
    prefilled in chunks. ``max_model_len`` None: the model's own context length.
    ``enable_prefix_caching`` reuses the KV blocks of prompt prefixes seen before.
    ``cuda_graphs`` captures decode steps (CUDA with the Triton backend).
    ``load_format="random"`` builds the model from ``config.json`` alone with random weights
    and no tokenizer (prompts must be token ids): for throughput benchmarks of real shapes.
    ``profile_steps`` records per-step CPU and GPU time (``LLMEngine.step_profile()``).
    ``async_scheduling`` schedules step n+1 while the device runs step n (None: on CUDA only,
    where it hides the host's work; on CPU the host is the device, so nothing overlaps).
    ``seed`` seeds the sampling of requests without a seed of their own (and random weights).
    ``speculative`` drafts tokens for decode steps (SpeculativeConfig, or its fields as a
    mapping); off by default. ``quantization``: the linear layers' weights, none (the model's
    dtype), fp8 (e4m3 weights and activations, quantized at load; models/fp8.py), int4
    (a GGUF file's Q4_0 / Q4_1 blocks as they are, W4A16; models/int4.py) or int8 (its
    Q8_0 blocks as they are, W8A16; models/int8.py). A quantized
    checkpoint (FP8, GPTQ, AWQ safetensors) runs as it is, whatever this says.
    ``kv_cache_dtype``: auto (the model's dtype) or fp8 (e4m3, twice the tokens in the same
    memory; kernels/fp8_kv.py). ``structured_output_backend``: the grammar library of
    structured output, llguidance or xgrammar (``pip install xgrammar``; structured_output.py).
    ``structured_output_processes``: worker processes that hold the grammars and do their
    per-token work in parallel (grammar_processes.py); 0 keeps them in the engine's process;
    None: on CUDA a worker per two CPU cores, at most 8, and 0 on CPU.
    """

    model: str = field(metadata=MODEL)
    dtype: str = field(default="auto", metadata=DTYPE)
    device: str = field(default="auto", metadata=DEVICE)
    max_num_seqs: int = field(default=256, metadata=POSITIVE_INT)
    max_num_batched_tokens: int = field(default=8192, metadata=POSITIVE_INT)
    max_model_len: int | None = field(default=None, metadata=MODEL_LEN)
    block_size: int = field(default=16, metadata=BLOCK_SIZE)
    kv_cache_memory: int | float | None = field(default=None, metadata=KV_MEMORY)
    enable_prefix_caching: bool = field(default=True, metadata=BOOL)
    attention_backend: str = field(default="auto", metadata=_one_of("auto", "torch", "triton"))
    cuda_graphs: bool = field(default=True, metadata=BOOL)
    load_format: str = field(default="auto", metadata=_one_of("auto", "random"))
    profile_steps: bool = field(default=False, metadata=BOOL)
    async_scheduling: bool | None = field(default=None, metadata=BOOL_OR_UNSET)
    seed: int = field(default=0, metadata=SEED)
    speculative: SpeculativeConfig = field(default=SpeculativeConfig(), metadata=SPECULATIVE)
    quantization: str = field(default="none", metadata=_one_of("none", "fp8", "int4", "int8"))
    kv_cache_dtype: str = field(default="auto", metadata=_one_of("auto", "fp8"))
    structured_output_backend: str = field(
        default="llguidance", metadata=_one_of("llguidance", "xgrammar")
    )
    structured_output_processes: int | None = field(default=None, metadata=PROCESSES)

    def __post_init__(self) -> None:
        for f in fields(self):
            given = getattr(self, f.name)
            value = f.metadata["rule"].check(f.name, given)
            if value is not given:  # e.g. job.yaml's speculative mapping, as SpeculativeConfig
                object.__setattr__(self, f.name, value)

    @classmethod
    def setting_names(cls) -> tuple[str, ...]:
        """The keyword settings ``from_settings`` (and ``LLM``) take: every field but model."""
        return tuple(f.name for f in fields(cls) if f.name != "model")

    @classmethod
    def from_settings(cls, model: str, **settings: Any) -> EngineConfig:
        """``EngineConfig(model, **settings)``, with an unknown key named and the valid ones
        listed. Raises TypeError for an unknown key, EngineSettingError for a bad value."""
        names = cls.setting_names()
        unknown = sorted(set(settings) - set(names))
        if unknown:
            close = difflib.get_close_matches(unknown[0], names, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise TypeError(
                f"unknown engine setting(s) {', '.join(unknown)}{hint}; the settings are "
                f"{', '.join(names)} (see tokenmill.EngineConfig)"
            )
        return cls(model=model, **settings)

    def resolve_device(self) -> torch.device:
        """The device ``device`` names here. Raises EngineSettingError naming ``device`` for
        a GPU this process does not see (none visible, or an index past those visible: a
        Ray replica sees its own GPU alone, as cuda:0)."""
        import torch

        if self.device == "auto":
            return torch.device(auto_device())
        device = torch.device(self.device)
        if device.type != "cuda":
            return device
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if visible == 0:
            raise EngineSettingError("device", self.device, "cpu or auto (no CUDA GPU is visible)")
        if (device.index or 0) >= visible:
            raise EngineSettingError(
                "device",
                self.device,
                f"cuda, auto or cuda:0 to cuda:{visible - 1} (the GPUs visible)",
            )
        return device

    def resolve_async_scheduling(self, device: torch.device) -> bool:
        if self.async_scheduling is None:
            return device.type == "cuda"
        return self.async_scheduling

    def resolve_dtype(self, model_config: ModelConfig, device: torch.device) -> torch.dtype:
        import torch

        if self.dtype != "auto":
            return getattr(torch, _DTYPES[self.dtype])
        if device.type == "cpu":
            return torch.float32
        stored = _DTYPES.get(model_config.torch_dtype.replace("torch.", ""), "bfloat16")
        return torch.bfloat16 if stored == "float32" else getattr(torch, stored)

    def kv_cache_budget(
        self, device: torch.device, reserve_bytes: int = 0, reserve_for: str = "activations"
    ) -> int:
        """Bytes for the KV cache on ``device``, after ``reserve_bytes`` for activations
        (``reserve_for`` says what they are for, and what to lower). A fraction counts what
        the device (or the host) holds already; on CPU, a byte count above the memory
        available raises EngineSettingError (it failed the allocation, or woke the
        out-of-memory killer, after the model had loaded)."""
        mem = self.kv_cache_memory
        if isinstance(mem, int) and device.type != "cpu":
            return mem
        if device.type == "cuda":
            import torch

            # Memory of engines already gone (a cycle not yet collected, blocks still in
            # torch's cache) is free for this one: count it so.
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(device)
            fraction = DEFAULT_GPU_MEMORY_FRACTION if mem is None else mem
            return int(fraction * total) - (total - free) - reserve_bytes
        if mem is None:
            return DEFAULT_CPU_KV_BYTES
        total, available = host_memory()
        if isinstance(mem, int):
            if mem + reserve_bytes > available:
                raise EngineSettingError(
                    "kv_cache_memory",
                    mem,
                    f"at most the {available / 2**30:.1f} GiB of host memory available now "
                    f"(of {total / 2**30:.1f} GiB) less {reserve_bytes / 2**30:.2f} GiB for "
                    f"{reserve_for}; the KV cache is allocated and zeroed at start",
                )
            return mem
        # As on a GPU: the share of the memory this engine may bring the host's use up to.
        return int(mem * total) - (total - available) - reserve_bytes


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of this host's memory: Linux's MemAvailable (free memory plus
    the caches it can drop), else the free pages."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = page * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return total, int(line.split()[1]) * 1024
    except OSError:
        pass
    return total, page * os.sysconf("SC_AVPHYS_PAGES")
