"""ModelConfig: the architecture facts the engine needs, parsed from an HF ``config.json`` dict.

GGUF metadata is translated into the same HF-style dict by the GGUF loader, so there is one
validation path for both formats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# HF `architectures` names this engine implements; see models/registry.py.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

# vLLM's ModelConfig attributes its scripts read (llm.llm_engine.model_config.<name>) ->
# where the value is here
_VLLM_NAMES = {
    "max_model_len": (
        "the engine's context (vLLM's model_config.max_model_len) is "
        "llm.llm_engine.max_model_len; the model's own is max_position_embeddings"
    ),
    "hf_config": "its fields (vocab_size, hidden_size, ...) are on it, as hf_config's are",
    "model": "the model's path is llm.llm_engine.model_path",
    "dtype": "the dtype the engine runs in is llm.llm_engine.dtype",
}
# Rope scaling types implemented in models/rope.py.
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
# The bias switches transformers' model of each architecture reads (it ignores the others).
_BIAS_KEYS = {
    "LlamaForCausalLM": ("attention_bias", "mlp_bias"),
    "Qwen3ForCausalLM": ("attention_bias",),
}
# transformers' defaults for Mistral's, Qwen2's and Qwen3's absent window keys
_DEFAULT_WINDOW, _DEFAULT_WINDOW_LAYERS = 4096, 28
# Positions a model may have: 16M (the largest context real models have is 10M); a damaged
# file's 2**63 failed deep in torch, naming neither the file nor the key.
_MAX_POSITIONS = 1 << 24
# The rope types transformers gives the pre-training length (max_position_embeddings) when
# the config does not name it
_ORIGINAL_LENGTH_TYPES = ("llama3", "yarn", "longrope")
# The rope_scaling keys each type reads without a default (models/rope.py).
_ROPE_KEYS = {"linear": ("factor",), "llama3": ("factor", "original_max_position_embeddings")}


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of a Llama-family decoder.

    Attributes mirror HF config keys; ``source`` names the file or directory they came from so
    errors can point at it.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head, before RoPE
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    quantization: str = "none"  # how the checkpoint stores its weights (checkpoint_quant.py)
    # Some layers attend only to the last this many tokens (Mistral's sliding_window, Qwen2's
    # with use_sliding_window); None: every layer attends to all. The engine does not
    # implement the window: it keeps sequences within it, where full attention is the same.
    sliding_window: int | None = None
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        where = f" in {self.source}" if self.source else ""
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}{where}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for key in ("num_attention_heads", "num_key_value_heads"):
            if getattr(self, key) <= 0:
                raise ValueError(
                    f"config key {key} must be positive{where}, got {getattr(self, key)}"
                )
        if self.max_position_embeddings > _MAX_POSITIONS:
            raise ValueError(
                f"config key max_position_embeddings is {self.max_position_embeddings}{where}; "
                f"this engine takes at most {_MAX_POSITIONS:,} positions"
            )
        for key in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"config key {key} must be a positive number{where}, got {value}")
        factor = (self.rope_scaling or {}).get("factor")
        if isinstance(factor, (int, float)) and not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"rope_scaling factor must be a positive number{where}, got {factor}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}{where}"
            )
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, key) <= 0:
                raise ValueError(
                    f"config key {key} must be positive{where}, got {getattr(self, key)}"
                )
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_scaling type {rope_type!r}{where}; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        needed = _ROPE_KEYS.get(rope_type, ())
        missing = [
            k for k in needed if not isinstance((self.rope_scaling or {}).get(k), (int, float))
        ]
        if missing:
            raise ValueError(
                f"rope_scaling of type {rope_type!r} needs {', '.join(needed)} (numbers){where}; "
                f"missing or not a number: {', '.join(missing)}"
            )

    def __getattr__(self, name: str) -> Any:
        """Only reached for a missing attribute: vLLM's ModelConfig names the engine's
        settings, which this one (the model's config.json) does not hold; say where they
        are instead of a bare AttributeError."""
        instead = _VLLM_NAMES.get(name)
        if instead is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise AttributeError(
            f"ModelConfig has no {name!r}: it holds the model's config.json, not vLLM's "
            f"engine settings; {instead}"
        )

    @property
    def rope_type(self) -> str:
        return str(_rope_type(self.rope_scaling or {}))

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "") -> ModelConfig:
        """Build from an HF ``config.json`` dict; ValueError names ``source`` and the key."""
        where = f" in {source}" if source else ""
        archs = cfg.get("architectures") or []
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ValueError(f"config key 'architectures' must be a list of names{where}")
        if not archs:
            raise ValueError(f"config has no 'architectures' list{where}")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}{where}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def need(key: str) -> Any:
            if key not in cfg or cfg[key] is None:
                raise ValueError(f"config key {key!r} is missing{where}")
            return cfg[key]

        def whole(key: str, value: Any) -> int:
            """A count or an id: an int (not a bool), or a float without a fraction."""
            if isinstance(value, float) and value.is_integer():
                return int(value)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"config key {key!r} must be a whole number{where}, got {value!r}")
            return value

        def number(key: str, value: Any) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"config key {key!r} must be a number{where}, got {value!r}")
            return float(value)

        def token_id(key: str, value: Any) -> int:
            if whole(key, value) < 0 or value >= 2**31:
                raise ValueError(f"config key {key!r} must be a token id{where}, got {value!r}")
            return int(value)

        n_heads = whole("num_attention_heads", need("num_attention_heads"))
        hidden = whole("hidden_size", need("hidden_size"))
        # transformers' default where the key is absent: Qwen3's config class says 128
        head_dim = _or_default(
            cfg.get("head_dim"), 128 if arch == "Qwen3ForCausalLM" else hidden // max(n_heads, 1)
        )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is not None and not isinstance(rope_scaling, dict):
            raise ValueError(
                f"config key 'rope_scaling' must be a mapping{where}, got {rope_scaling!r}"
            )
        rope_theta = cfg.get("rope_theta")
        tied = cfg.get("tie_word_embeddings", False)
        if not isinstance(tied, bool):
            raise ValueError(
                f"config key 'tie_word_embeddings' must be true or false{where}, got {tied!r}"
            )
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(
                f"config key hidden_act is {act!r}{where}; this engine's MLP is SiLU-gated "
                "(hidden_act silu)"
            )
        for key in _BIAS_KEYS.get(arch, ()):  # (the keys transformers reads for ``arch``)
            if cfg.get(key):
                what = "q/k/v/o_proj" if key == "attention_bias" else "the MLP's projections"
                raise ValueError(
                    f"config key {key} is true{where}: {arch} then has biases on {what}, "
                    "which this engine does not implement (Qwen2's q/k/v biases it does)"
                )
        # As transformers reads them: a legacy `rope_scaling` replaces `rope_parameters`
        # (transformers 5's key) whole; the type is `rope_type`, or the legacy `type`; theta is
        # the dict's, else the top-level key's.
        rope_params = rope_scaling or cfg.get("rope_parameters")
        rope_scaling = None
        if isinstance(rope_params, dict):
            rope_theta = _or_default(rope_params.get("rope_theta"), rope_theta)
            rope_type = _rope_type(rope_params)
            if rope_type != "default":
                rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
                if rope_type in _ORIGINAL_LENGTH_TYPES:  # a top-level key wins, as Phi-3's
                    original = cfg.get("original_max_position_embeddings")
                    if original is not None:
                        rope_scaling["original_max_position_embeddings"] = original
                    rope_scaling.setdefault(
                        "original_max_position_embeddings", cfg.get("max_position_embeddings")
                    )
        return cls(
            architecture=arch,
            vocab_size=whole("vocab_size", need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=whole("intermediate_size", need("intermediate_size")),
            num_hidden_layers=whole("num_hidden_layers", need("num_hidden_layers")),
            num_attention_heads=n_heads,
            num_key_value_heads=whole(
                "num_key_value_heads", _or_default(cfg.get("num_key_value_heads"), n_heads)
            ),
            head_dim=whole("head_dim", head_dim),
            # (only an absent or null value takes a default: a 0 is refused by __post_init__,
            # not run as the default)
            rms_norm_eps=number("rms_norm_eps", _or_default(cfg.get("rms_norm_eps"), 1e-6)),
            rope_theta=number("rope_theta", _or_default(rope_theta, 10000.0)),
            max_position_embeddings=whole(
                "max_position_embeddings", need("max_position_embeddings")
            ),
            tie_word_embeddings=tied,
            attention_bias=arch == "Qwen2ForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            bos_token_id=(
                None
                if cfg.get("bos_token_id") is None
                else token_id("bos_token_id", cfg["bos_token_id"])
            ),
            eos_token_ids=tuple(token_id("eos_token_id", e) for e in eos_ids),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            sliding_window=_sliding_window(cfg, arch, where),
            source=source,
        )


def _or_default(value: Any, default: Any) -> Any:
    """``value``, or ``default`` when it is None (a falsy 0 stays, for validation to judge)."""
    return default if value is None else value


def _rope_type(params: dict[str, Any]) -> Any:
    """A rope settings dict's type: ``rope_type``, or the legacy ``type``, else default."""
    return params.get("rope_type", params.get("type", "default"))


def _sliding_window(cfg: dict[str, Any], arch: str, where: str = "") -> int | None:
    """The window of the layers that slide, as transformers reads the config: Mistral's
    ``sliding_window`` applies to every layer; Qwen2's and Qwen3's only with
    ``use_sliding_window``, to the layers from ``max_window_layers`` on (or those
    ``layer_types`` calls sliding_attention). An absent key takes transformers' default
    (a window of 4096, ``max_window_layers`` 28); an explicit null is no window."""
    if arch == "LlamaForCausalLM":
        return None
    window = cfg.get("sliding_window", _DEFAULT_WINDOW)
    if not window:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(
            f"config key 'sliding_window' must be a whole number{where}, got {window!r}"
        )
    if arch != "MistralForCausalLM":
        if not cfg.get("use_sliding_window", False):
            return None
        types = cfg.get("layer_types")
        if types is not None and not (
            isinstance(types, list) and all(isinstance(t, str) for t in types)
        ):
            raise ValueError(f"config key 'layer_types' must be a list of names{where}")
        if types is not None:
            sliding = "sliding_attention" in types
        else:
            layers = int(cfg.get("num_hidden_layers") or 0)
            sliding = int(cfg.get("max_window_layers", _DEFAULT_WINDOW_LAYERS)) < layers
        if not sliding:
            return None
    return int(window)


def context_limit(mc: ModelConfig) -> tuple[int, str]:
    """The longest sequence the model runs exactly here, and why: its context, or its
    sliding attention window (not implemented: within it full attention is the same)."""
    if mc.sliding_window is not None and mc.sliding_window < mc.max_position_embeddings:
        return mc.sliding_window, (
            f"the model's attention slides over windows of {mc.sliding_window} tokens, which "
            "this engine does not implement; within one window its outputs are exact"
        )
    return mc.max_position_embeddings, "the model's context (max_position_embeddings)"
