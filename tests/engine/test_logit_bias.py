"""logit_bias: OpenAI's per-token bias in [-100, 100], added to the logits on the device
before temperature, top-k and top-p, in the sampler and through the whole engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.devices import DEVICES
from tests.tiny_models import save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine.sampler import Sampler
from tokenmill.engine.sampling_metadata import SamplingMetadata


def _sample(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    meta = SamplingMetadata.build(
        params,
        [[] for _ in params],
        [[] for _ in params],
        vocab_size=logits.shape[1],
        device=logits.device,
        generator=torch.Generator(device=logits.device).manual_seed(0),
    )
    return Sampler()(logits, meta).sampled_token_ids


@pytest.mark.parametrize("device", DEVICES)
def test_bias_moves_only_its_own_rows_tokens(device: str) -> None:
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)).to(device)
    before = logits.clone()
    greedy = logits.argmax(-1).tolist()
    params = [
        SamplingParams(temperature=0, logit_bias={7: 100}),  # forced
        SamplingParams(temperature=0),  # untouched
        SamplingParams(temperature=0, logit_bias={greedy[2]: -100}),  # banned: the runner-up
        SamplingParams(temperature=1.0, top_k=5, seed=1, logit_bias={"11": 100.0}),  # OpenAI keys
        SamplingParams(temperature=0, logit_bias={greedy[4]: -100, 9: 100, 10: 50}),
    ]
    got = _sample(logits, params).tolist()
    runner_up = logits[2].topk(2).indices[1].item()
    assert got == [7, greedy[1], runner_up, 11, 9]
    assert torch.equal(logits, before)  # the caller's logits are not changed


def test_bias_comes_before_temperature_and_top_k() -> None:
    """A token outside the top-k of the raw logits is inside it once biased, so it can be
    drawn; a -100 bias leaves a sampled row nothing but the other tokens."""
    base = torch.tensor([[4.0, 3.0, 2.0, -5.0]])
    boosted = SamplingParams(temperature=0.5, top_k=1, seed=0, logit_bias={3: 20})
    assert _sample(base, [boosted]).item() == 3
    draws = 400
    banned = [SamplingParams(temperature=2.0, seed=s, logit_bias={0: -100}) for s in range(draws)]
    counts = torch.bincount(_sample(base.repeat(draws, 1), banned), minlength=4)
    assert counts[0] == 0 and counts[1] > counts[2] > 0


def test_settings_are_checked_and_named() -> None:
    assert SamplingParams(logit_bias={"5": -1, 6: 2.5}).logit_bias == {5: -1.0, 6: 2.5}
    assert SamplingParams(logit_bias={}).logit_bias is None
    with pytest.raises(ValueError, match=r"the bias of token 5 must be a number in \[-100, 100\]"):
        SamplingParams(logit_bias={5: 100.5})
    with pytest.raises(ValueError, match=r"logit_bias: key 'abc' is not a token id"):
        SamplingParams(logit_bias={"abc": 1})
    with pytest.raises(ValueError, match=r"logit_bias: key -1 is not a token id"):
        SamplingParams(logit_bias={-1: 1})
    with pytest.raises(ValueError, match=r"the bias of token '3' must be a number"):
        SamplingParams(logit_bias={"3": True})
    with pytest.raises(ValueError, match="token id 3 is given twice"):
        SamplingParams(logit_bias={3: 1, "3": 2})
    with pytest.raises(ValueError, match="expected a mapping of token id to bias, got list"):
        SamplingParams(logit_bias=[3, 1])  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = save_tiny_model("llama", tmp_path_factory.mktemp("bias") / "m")
    return LLM(str(path), device="cpu", max_num_seqs=8, kv_cache_memory=16 << 20)


def test_engine_plus_100_forces_a_token_and_minus_100_bans_one(tiny_llm: LLM) -> None:
    prompts = [[5, 9, 42, 17], [80, 81, 82]]
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    reference = [o.token_ids for o in tiny_llm.generate(prompts, plain)]
    forced = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={33: 100})
    banned = SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, logit_bias={reference[1][0]: -100}
    )
    # One batch: the biased rows and an unbiased one side by side.
    outs = tiny_llm.generate([prompts[0], prompts[1], prompts[1]], [forced, banned, plain])
    assert outs[0].token_ids == [33] * 6
    assert reference[1][0] not in outs[1].token_ids
    assert outs[1].token_ids != reference[1]
    assert outs[2].token_ids == reference[1]


def test_engine_refuses_ids_past_the_vocabulary(tiny_llm: LLM) -> None:
    vocab = tiny_llm.engine.model_config.vocab_size
    bad = SamplingParams(max_tokens=2, logit_bias={vocab: 1})
    outs = tiny_llm.generate([[5, 6], [7, 8]], [bad, SamplingParams(max_tokens=2)])
    assert "logit_bias token ids outside the vocabulary" in (outs[0].error or "")
    assert outs[1].error is None and len(outs[1].token_ids) == 2


def test_engine_refuses_stop_ids_past_the_vocabulary(tiny_llm: LLM) -> None:
    """A stop id the model cannot sample would never stop anything: refused, not ignored."""
    vocab = tiny_llm.engine.model_config.vocab_size
    bad = SamplingParams(max_tokens=2, stop_token_ids=[3, vocab + 5])
    outs = tiny_llm.generate([[5, 6], [7, 8]], [bad, SamplingParams(max_tokens=2)])
    assert f"stop_token_ids token ids outside the vocabulary [0, {vocab}): [{vocab + 5}]" in (
        outs[0].error or ""
    )
    assert outs[1].error is None and len(outs[1].token_ids) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bias_holds_in_graph_replayed_decode_steps(tmp_path: Path) -> None:
    """Decode steps replay CUDA graphs that end at the hidden states; the sampler (and the
    bias) runs after them, eagerly, so every step's token obeys it."""
    path = save_tiny_model("llama", tmp_path / "m", max_position_embeddings=1024)
    llm = LLM(str(path), device="cuda", cuda_graphs=True, max_num_seqs=8, profile_steps=True)
    params = [
        SamplingParams(max_tokens=20, temperature=t, seed=1, ignore_eos=True, logit_bias={33: 100})
        for t in (0.0, 1.0, 0.0)
    ]
    outs = llm.generate([[5, 9, 42], [80, 81], [7] * 30], params)
    assert all(o.token_ids == [33] * 20 for o in outs)
    profile = llm.engine.step_profile()
    assert profile["decode"]["graph_steps"] > 0
