"""Sampler: greedy, temperature, filters, penalties, per-request seeds and logprobs."""

from __future__ import annotations

import pytest
import torch

from tests.devices import DEVICES
from tokenmill.engine.sampler import Sampler, SamplerOutput, apply_penalties
from tokenmill.engine.sampling_metadata import SamplingMetadata
from tokenmill.engine.sampling_params import SamplingParams


def _sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    *,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    seed: int = 0,
) -> SamplerOutput:
    rows = len(params)
    generator = torch.Generator(device=logits.device).manual_seed(seed)
    meta = SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[] for _ in range(rows)],
        outputs if outputs is not None else [[] for _ in range(rows)],
        vocab_size=logits.shape[1],
        device=logits.device,
        generator=generator,
    )
    return Sampler()(logits, meta)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device: str) -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1)).to(device)
    out = _sample(logits, [SamplingParams(temperature=0)] * 8)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_on_half_precision_logits_picks_the_float32_argmax(device: str) -> None:
    # bf16 logits with many exact ties (few distinct values): plain greedy takes the argmax
    # of the bf16 logits as they are, which must be float32's, first maximum included.
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randint(0, 6, (64, 300), generator=gen) * 0.125).to(torch.bfloat16)
    logits = logits.to(device)
    out = _sample(logits, [SamplingParams(temperature=0)] * 64)
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))
    # With logprobs the float32 path runs: the same tokens.
    with_logprobs = _sample(logits, [SamplingParams(temperature=0, logprobs=2)] * 64)
    assert torch.equal(with_logprobs.sampled_token_ids, out.sampled_token_ids)


def test_greedy_rows_in_a_mixed_batch_stay_argmax() -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0 if i % 2 else 1.5, top_k=5) for i in range(6)]
    out = _sample(logits, params)
    assert torch.equal(out.sampled_token_ids[1::2], logits[1::2].argmax(-1))


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_temperature_sampling_matches_softmax() -> None:
    base = torch.tensor([1.0, 0.5, -0.3, -1.2, 0.0])
    temperature, draws = 0.7, 20_000
    logits = base.repeat(draws, 1)  # [N, 5]
    out = _sample(logits, [SamplingParams(temperature=temperature)] * draws)
    counts = torch.bincount(out.sampled_token_ids, minlength=5).float()
    # df = 4: chi-square's 99.9% quantile is 18.47; the fixed seed keeps the test deterministic.
    assert _chi_square(counts, torch.softmax(base / temperature, -1)) < 18.47


def test_seeded_rows_match_softmax_across_seeds() -> None:
    base = torch.tensor([0.2, 1.0, -0.5])
    params = [SamplingParams(seed=s) for s in range(6000)]
    out = _sample(base.repeat(len(params), 1), params)
    counts = torch.bincount(out.sampled_token_ids, minlength=3).float()
    assert _chi_square(counts, torch.softmax(base, -1)) < 13.82  # df = 2, 99.9%


def _row_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def test_top_k_keeps_every_token_tied_with_the_kth() -> None:
    """As HF's and vLLM's top-k (exactly k were kept before: of the tied, the lowest ids)."""
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    out = _sample(logits, [SamplingParams(temperature=1.0, top_k=2)] * 4000)
    counts = torch.bincount(out.sampled_token_ids, minlength=6).float()
    assert counts[4:].sum() == 0
    expected = torch.softmax(torch.tensor([2.0, 1.0, 1.0, 1.0]), -1)
    assert _chi_square(counts[:4], expected) < 16.27  # df = 3, 99.9%


def test_top_k_never_picks_filtered_tokens() -> None:
    logits = _row_logits(2000, 30, seed=3)
    k = 4
    out = _sample(logits, [SamplingParams(temperature=2.0, top_k=k)] * 2000)
    allowed = logits.topk(k, dim=-1).indices  # [B, k]
    assert (allowed == out.sampled_token_ids.unsqueeze(1)).any(-1).all()
    # Not over-filtered: the k-th best token is drawn sometimes.
    assert (allowed[:, -1] == out.sampled_token_ids).any()


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.06, 0.04])
    logits = probs.log().repeat(4000, 1)
    # Cumulative 0.5, 0.75, 0.9: top_p = 0.8 keeps exactly the first three tokens.
    out = _sample(logits, [SamplingParams(top_p=0.8)] * 4000)
    counts = torch.bincount(out.sampled_token_ids, minlength=5).float()
    assert counts[3:].sum() == 0
    assert _chi_square(counts[:3], probs[:3] / probs[:3].sum()) < 13.82  # df = 2, 99.9%


def test_tiny_top_p_is_greedy() -> None:
    logits = _row_logits(64, 100, seed=4)
    out = _sample(logits, [SamplingParams(temperature=1.3, top_p=1e-6)] * 64)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_min_p_never_picks_unlikely_tokens() -> None:
    logits = _row_logits(2000, 30, seed=5)
    min_p = 0.2
    out = _sample(logits, [SamplingParams(min_p=min_p)] * 2000)
    probs = torch.softmax(logits, -1)
    picked = probs.gather(1, out.sampled_token_ids.unsqueeze(1)).squeeze(1)
    assert (picked >= min_p * probs.max(-1).values).all()


def test_filters_combined_on_rows_that_differ() -> None:
    logits = _row_logits(3, 20, seed=6).repeat(500, 1)  # [1500, 20], three distinct rows
    params = [
        SamplingParams(top_k=2),
        SamplingParams(top_p=0.3, temperature=0.5),
        SamplingParams(min_p=0.5, top_k=-1),
    ] * 500
    out = _sample(logits, params)
    tokens = out.sampled_token_ids.view(500, 3)
    top2 = logits[0].topk(2).indices
    assert torch.isin(tokens[:, 0], top2).all()
    probs = torch.softmax(logits[2], -1)
    assert (probs[tokens[:, 2]] >= 0.5 * probs.max()).all()


def test_min_p_judges_the_tempered_distribution_before_top_p() -> None:
    """vLLM's order: temperature, min-p, then top-k / top-p. With top-p first, min-p judged
    what was left of a renormalized nucleus and kept tokens vLLM never samples (an audit's
    chi-square: 22% of draws on token 2 here)."""
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    logits = probs.log().repeat(4000, 1)
    out = _sample(logits, [SamplingParams(min_p=0.3, top_p=0.75, seed=i) for i in range(4000)])
    counts = torch.bincount(out.sampled_token_ids, minlength=4)
    assert counts[2:].sum() == 0  # 0.2 < 0.3 * 0.4: gone before top-p looks
    assert 0.5 < counts[0] / 4000 < 0.64  # 0.4 / 0.7 = 0.571 of what is left


def test_the_bias_comes_before_the_repetition_penalty() -> None:
    """vLLM's order: logit_bias (and min_tokens' bans) first, then the penalties, so a
    biased logit is divided by the repetition penalty as any other: +2 on token 2 (seen in
    the prompt) gives 2 / 2 = 1, level with token 0, which wins the tie; penalizing first
    gave 0 / 2 + 2 = 2 and picked token 2."""
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5]])
    params = [SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={2: 2.0})]
    assert _sample(logits, params, prompts=[[2]]).sampled_token_ids.tolist() == [0]


def _metadata(params: list[SamplingParams], prompts, outputs, vocab: int) -> SamplingMetadata:
    return SamplingMetadata.build(params, prompts, outputs, vocab, torch.device("cpu"))


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0]])
    meta = _metadata([SamplingParams(repetition_penalty=2.0)], [[0, 1]], [[2, 2]], 6)
    expected = torch.tensor([[1.0, -2.0, 0.25, -3.0, 1.0, 0.0]])
    assert torch.equal(apply_penalties(logits, meta), expected)


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0]])
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)]
    # Token 0 only appears in the prompt: untouched. Token 2 twice, token 4 once in the output.
    meta = _metadata(params, [[0, 0]], [[2, 4, 2]], 6)
    expected = torch.tensor([[2.0, -1.0, 0.5 - 0.5 - 0.5, -3.0, 1.0 - 0.5 - 0.25, 0.0]])
    assert torch.allclose(apply_penalties(logits, meta), expected, atol=0, rtol=1e-6)


def test_penalties_are_per_row_and_compose() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5], [2.0, -1.0, 0.5]])
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0),
        SamplingParams(),
    ]
    meta = _metadata(params, [[1], [1]], [[0], [0]], 3)
    # Row 0: repetition first (2 / 2 = 1, -1 * 2 = -2), then frequency (1 - 1 = 0).
    expected = torch.tensor([[0.0, -2.0, 0.5], [2.0, -1.0, 0.5]])
    assert torch.equal(apply_penalties(logits, meta), expected)


def test_penalties_steer_greedy_decoding() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    params = [SamplingParams(temperature=0, presence_penalty=0.5)]
    out = _sample(logits, params, outputs=[[0]])
    assert out.sampled_token_ids.tolist() == [1]


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_ignores_its_batch(device: str) -> None:
    vocab = 1000
    mine = _row_logits(1, vocab, seed=7).to(device)
    seeded = SamplingParams(seed=1234, top_p=0.95)
    history = [5, 6, 7]

    def run(row: int, others: int, batch_seed: int, other_history: list[int]) -> int:
        logits = _row_logits(others + 1, vocab, seed=batch_seed).to(device)
        logits[row] = mine[0]
        params = [SamplingParams(temperature=0.8)] * (others + 1)
        params[row] = seeded
        outputs = [other_history] * (others + 1)
        outputs[row] = history
        out = _sample(logits, params, outputs=outputs, seed=batch_seed)
        return int(out.sampled_token_ids[row])

    tokens = {
        run(0, 0, 1, []),
        run(0, 5, 2, [1, 2]),
        run(3, 7, 3, []),
        run(6, 6, 4, [9] * 10),
    }
    assert len(tokens) == 1


def test_seeded_draws_differ_across_seeds_and_positions() -> None:
    logits = torch.zeros(1, 1000)  # uniform: any two draws collide with probability 1e-3
    by_seed = {
        int(_sample(logits, [SamplingParams(seed=s)]).sampled_token_ids[0]) for s in range(10)
    }
    by_position = {
        int(_sample(logits, [SamplingParams(seed=0)], outputs=[[1] * n]).sampled_token_ids[0])
        for n in range(10)
    }
    assert len(by_seed) >= 8 and len(by_position) >= 8


def test_unseeded_rows_follow_the_shared_generator() -> None:
    logits = torch.zeros(16, 1000)
    params = [SamplingParams()] * 16
    first = _sample(logits, params, seed=11).sampled_token_ids
    again = _sample(logits, params, seed=11).sampled_token_ids
    other = _sample(logits, params, seed=12).sampled_token_ids
    assert torch.equal(first, again) and not torch.equal(first, other)


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_come_from_raw_logits(device: str) -> None:
    logits = _row_logits(4, 50, seed=8).to(device)
    params = [
        SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.5),
        SamplingParams(temperature=0.5, logprobs=5, top_k=3),
        SamplingParams(logprobs=0, frequency_penalty=1.0),
        SamplingParams(temperature=2.0),
    ]
    out = _sample(logits, params, outputs=[[1, 2], [3], [4, 4], []])
    assert out.logprobs is not None
    expected = torch.log_softmax(logits, -1)
    sampled = out.sampled_token_ids
    lp = out.logprobs
    torch.testing.assert_close(lp.sampled_logprobs, expected.gather(1, sampled[:, None])[:, 0])
    assert lp.top_token_ids.shape == (4, 5) and lp.top_logprobs.shape == (4, 5)
    top = expected.topk(5, dim=-1)
    assert torch.equal(lp.top_token_ids, top.indices)
    torch.testing.assert_close(lp.top_logprobs, top.values)
    assert (lp.top_logprobs[:, :-1] >= lp.top_logprobs[:, 1:]).all()
    # Rank 1 is the most likely token; ranks count strictly better tokens.
    order = expected.argsort(dim=-1, descending=True)
    ranks = (order == sampled[:, None]).int().argmax(-1) + 1
    assert torch.equal(lp.sampled_ranks, ranks)
    token, logprob, rank, top_ids, top_lps = lp.to_lists()[1]
    assert (token, rank, top_ids) == (int(sampled[1]), int(ranks[1]), top.indices[1].tolist())
    assert logprob == pytest.approx(float(expected[1, token]))
    assert top_lps == pytest.approx(top.values[1].tolist())


def test_empty_batch() -> None:
    out = _sample(torch.zeros(0, 10), [])
    assert out.sampled_token_ids.shape == (0,)


def test_build_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="one of each"):
        _metadata([SamplingParams()], [], [[]], 10)
    with pytest.raises(ValueError, match="row 0 holds token id 10"):
        _metadata([SamplingParams(frequency_penalty=1.0)], [[]], [[10]], 10)
    meta = _metadata([SamplingParams()], [[]], [[]], 10)
    with pytest.raises(ValueError, match="does not match"):
        Sampler()(torch.zeros(1, 11), meta)
