"""The Llama model's load_weights: checkpoint tensors routed to their parameters' weight loaders
(q/k/v and gate/up as parts of the merged ones), the errors it raises, and build_model."""

from __future__ import annotations

import re

import pytest
import torch

from tokenmill.engine.attention.backend import get_attention_backend
from tokenmill.engine.loader.hf_layout import expected_shapes
from tokenmill.engine.model_config import ModelConfig
from tokenmill.engine.model_loader import build_model
from tokenmill.engine.parallel import ParallelConfig

SOURCE = "/models/tiny"
CPU = torch.device("cpu")


def _config(**overrides) -> ModelConfig:
    fields = {
        "architecture": "LlamaForCausalLM",
        "vocab_size": 40,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }
    return ModelConfig(**{**fields, **overrides})


def _checkpoint(config: ModelConfig) -> dict[str, torch.Tensor]:
    """Random tensors under every name a plain Llama checkpoint of ``config`` holds."""
    g = torch.Generator().manual_seed(0)
    optional = ("bias", "q_norm.weight", "k_norm.weight")
    return {
        name: torch.randn(shape, generator=g)
        for name, shape in expected_shapes(config).items()
        if not name.endswith(optional)
        and not (name == "lm_head.weight" and config.tie_word_embeddings)
    }


def _build(config: ModelConfig, weights: dict[str, torch.Tensor] | None, **kwargs):
    backend = get_attention_backend("torch", config.num_key_value_heads)
    items = None if weights is None else list(weights.items())
    return build_model(config, backend, 16, CPU, torch.float32, items, source=SOURCE, **kwargs)


def test_merged_parameters_stack_the_checkpoint_parts() -> None:
    config = _config()
    ckpt = _checkpoint(config)
    model = _build(config, ckpt)
    params = dict(model.named_parameters())
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}"
        q, k, v = (ckpt[f"{p}.self_attn.{n}_proj.weight"] for n in "qkv")
        assert torch.equal(params[f"{p}.self_attn.qkv_proj.weight"], torch.cat([q, k, v]))
        gate, up = ckpt[f"{p}.mlp.gate_proj.weight"], ckpt[f"{p}.mlp.up_proj.weight"]
        assert torch.equal(params[f"{p}.mlp.gate_up_proj.weight"], torch.cat([gate, up]))
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
            assert torch.equal(params[f"{p}.{name}"], ckpt[f"{p}.{name}"])
    assert torch.equal(model.lm_head.weight, ckpt["lm_head.weight"])


def test_tied_head_uses_the_embeddings_and_skips_a_stored_copy() -> None:
    """A tied checkpoint that stores its head as a copy of the embeddings loads; one whose
    stored head differs is refused (it was dropped, and every row ran on the wrong head)."""
    config = _config(tie_word_embeddings=True)
    ckpt = _checkpoint(config)
    ckpt["lm_head.weight"] = ckpt["model.embed_tokens.weight"].clone()
    model = _build(config, ckpt)
    assert model.lm_head is None
    hidden = torch.randn(3, config.hidden_size)
    expected = hidden @ ckpt["model.embed_tokens.weight"].T
    torch.testing.assert_close(model.compute_logits(hidden), expected)
    # in the model's dtype: the sampler converts them where it computes with them
    model = model.to(torch.bfloat16)
    assert model.compute_logits(hidden.to(torch.bfloat16)).dtype == torch.bfloat16
    ckpt["lm_head.weight"] = torch.zeros(config.vocab_size, config.hidden_size)
    with pytest.raises(ValueError, match="lm_head.weight differs from its embeddings"):
        _build(config, ckpt)


def test_nan_or_infinite_weights_are_refused_naming_them() -> None:
    config = _config()
    for bad in (float("nan"), float("inf")):
        ckpt = _checkpoint(config)
        ckpt["model.layers.0.mlp.up_proj.weight"][0, 0] = bad
        with pytest.raises(ValueError, match=r"gate_up_proj.weight in .* NaN or infinite"):
            _build(config, ckpt)


@pytest.mark.parametrize(
    "name",
    ["model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.fc1.weight", "model.extra.weight"],
)
def test_unexpected_tensor_is_named_with_its_file(name: str) -> None:
    config = _config()
    ckpt = {**_checkpoint(config), name: torch.ones(config.hidden_size)}  # (zero biases load)
    with pytest.raises(ValueError, match=rf"^unexpected weight {name} in {SOURCE}: "):
        _build(config, ckpt)


@pytest.mark.parametrize(
    ("name", "bad", "expected"),
    [
        ("model.layers.1.self_attn.k_proj.weight", (8, 32), (16, 32)),
        ("model.layers.0.mlp.down_proj.weight", (32, 47), (32, 48)),
        ("model.norm.weight", (31,), (32,)),
    ],
)
def test_wrong_shape_names_the_tensor_and_both_shapes(
    name: str, bad: tuple[int, ...], expected: tuple[int, ...]
) -> None:
    config = _config()
    ckpt = {**_checkpoint(config), name: torch.zeros(bad)}
    message = f"weight {name} in {SOURCE} has shape {bad}, expected {expected}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        _build(config, ckpt)


def test_missing_tensors_are_listed_by_checkpoint_name() -> None:
    config = _config()
    ckpt = _checkpoint(config)
    del ckpt["model.layers.1.self_attn.k_proj.weight"], ckpt["model.norm.weight"]
    with pytest.raises(ValueError) as err:
        _build(config, ckpt)
    assert str(err.value) == (
        f"checkpoint in {SOURCE} lacks weights: "
        "model.layers.1.self_attn.k_proj.weight, model.norm.weight"
    )


def test_build_model_makes_parameters_in_dtype_and_keeps_their_loaders() -> None:
    config = _config()
    backend = get_attention_backend("torch", config.num_key_value_heads)
    default = torch.get_default_dtype()
    model = build_model(config, backend, 16, CPU, torch.bfloat16, None)
    assert torch.get_default_dtype() == default
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.weight_loader is qkv.weight_loader
    assert qkv.weight.device == CPU


def test_rank_1_of_2_loads_its_heads_from_the_whole_checkpoint() -> None:
    config = _config()
    ckpt = _checkpoint(config)
    model = _build(config, ckpt, parallel=ParallelConfig(tp_rank=1, tp_size=2))
    attn = model.model.layers[0].self_attn
    assert (attn.n_heads, attn.n_kv, attn.q_size, attn.kv_size) == (2, 1, 16, 8)
    q, k, v = (ckpt[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(attn.qkv_proj.weight, torch.cat([q[16:], k[8:], v[8:]]))
    assert torch.equal(attn.o_proj.weight, ckpt["model.layers.0.self_attn.o_proj.weight"][:, 16:])
    down = model.model.layers[0].mlp.down_proj.weight
    assert torch.equal(down, ckpt["model.layers.0.mlp.down_proj.weight"][:, 24:])


def test_heads_that_do_not_split_over_the_ranks_are_refused() -> None:
    with pytest.raises(
        ValueError, match="num_key_value_heads=2 does not split evenly over tp_size=4"
    ):
        _build(_config(), None, parallel=ParallelConfig(tp_rank=0, tp_size=4))
