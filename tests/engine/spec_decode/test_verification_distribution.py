"""Verification keeps the target's distribution: a statistical test over > 10^6 samples.

A row with drafts d1 .. dk samples s_j at each of its 1 + k positions from the target (with
temperature, top-k, top-p and min-p applied) and keeps s_0 .. s_a, a = the leading drafts
with s_j == d_(j+1) (engine/core/drafts.py). For a deterministic draft this is rejection
sampling: d is kept with probability p(d), and otherwise the token is p without d,
renormalized. So the token emitted at position j, among rows that reach it, is distributed
as p_j, the target at j, for every draft position and for the bonus token after the last.
Each is checked with a chi-square test against p_j computed here independently (float64).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.engine.core.drafts import accepted_counts
from tokenmill.engine.sampler import Sampler
from tokenmill.engine.sampling_metadata import SamplingMetadata
from tokenmill.engine.sampling_params import SamplingParams

# 0.999 quantiles of chi-square with df degrees of freedom: a correct sampler fails one
# check in a thousand (the generator is seeded, so a pass is reproducible).
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
MIN_SAMPLES = 1_000_000

# Per position: the target's logits over an 8-token vocabulary (independent of context).
LOGITS = np.array(
    [
        [2.0, 1.1, 0.3, -0.2, 0.9, -1.0, 0.0, 0.5],
        [0.4, 2.2, 1.0, 0.1, -0.5, 0.8, -2.0, 0.3],
        [1.0, 0.9, 0.8, 0.7, 0.6, -0.4, 0.2, 1.3],
    ]
)
DRAFTS = [0, 1]  # the likeliest token at positions 0 and 1: most rows reach the bonus token


def _target(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The target distribution: temperature, then top-k, top-p, min-p (as documented)."""
    z = logits / p.temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(len(z), dtype=bool)
    k = len(z) if p.top_k <= 0 else p.top_k
    keep[order[:k]] = True
    probs = np.where(keep, np.exp(z - z.max()), 0.0)
    probs /= probs.sum()
    mass_before = np.cumsum(probs[order]) - probs[order]
    nucleus = np.zeros(len(z), dtype=bool)
    nucleus[order[(mass_before < p.top_p) | (np.arange(len(z)) == 0)]] = True
    probs = np.where(keep & nucleus, probs, 0.0)
    probs /= probs.sum()
    probs = np.where(probs < p.min_p * probs.max(), 0.0, probs)
    return probs / probs.sum()


def _chi_square(observed: np.ndarray, expected_p: np.ndarray) -> tuple[float, int]:
    support = expected_p > 0
    assert observed[~support].sum() == 0, "a token outside the target's support was emitted"
    expected = expected_p[support] * observed.sum()
    stat = float((((observed[support] - expected) ** 2) / expected).sum())
    return stat, int(support.sum()) - 1


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9),
        SamplingParams(temperature=1.3, min_p=0.1),
        SamplingParams(temperature=1.0),
    ],
    ids=["temp-topk-topp", "temp-minp", "plain"],
)
def test_emitted_tokens_follow_the_target_at_every_position(params: SamplingParams) -> None:
    positions, vocab = LOGITS.shape
    requests = 200_000  # per batch; 3 logits rows each
    meta = SamplingMetadata.build(
        [params] * (requests * positions),
        [[]] * (requests * positions),
        [[]] * (requests * positions),
        vocab_size=vocab,
        device=torch.device("cpu"),
        generator=torch.Generator().manual_seed(1234),
    )
    logits = torch.tensor(LOGITS, dtype=torch.float32).repeat(requests, 1)  # [3R, V]
    drafts = np.tile(DRAFTS, (requests, 1))
    lengths = np.full(requests, len(DRAFTS))
    counts = np.zeros((positions, vocab), dtype=np.int64)  # emitted token counts per position
    sampler = Sampler()
    while counts.sum(axis=1).min() < MIN_SAMPLES:
        sampled = sampler(logits, meta).sampled_token_ids.numpy().reshape(requests, positions)
        accepted = accepted_counts(sampled, drafts, lengths)  # [R]
        for j in range(positions):  # position j is emitted by rows that accepted >= j drafts
            np.add.at(counts[j], sampled[accepted >= j, j], 1)
    for j in range(positions):
        stat, df = _chi_square(counts[j], _target(LOGITS[j], params))
        assert stat < CHI2_999[df], (j, stat, df, counts[j])
