"""Sampler: one token per logits row, following each row's SamplingParams.

    logits [B, V] ─┬─► log_softmax ─► LogprobsTensors      (raw model logits, as OpenAI)
                   └─► logit bias ─► penalties ─► grammar mask   (rows with logit_bias /
                                                                  structured_output)
                         ─┬─► argmax ─────────────────┐ greedy rows
                          └─► / temperature           │
                              ─► min-p                │
                              ─► top-k ─► top-p       │
                              ─► softmax              │
                              ─► argmax(p / q) ───────┴─► sampled_token_ids [B]

The order is vLLM's (v1): bias and min_tokens' bans, then penalties; temperature, then
min-p, then top-k and top-p. It matters: a repetition penalty divides a biased logit, and
min-p keeps tokens by their share of the tempered distribution before top-p renormalizes.

Sampling uses the exponential race: with q ~ Exp(1) i.i.d., argmax(p / q) is a draw from p.
The noise q of a seeded row comes from its own generator, seeded from (seed, output position),
so its token depends on nothing else in the batch. Unseeded rows share ``meta.generator``.
The logit bias is one sparse add of every row's (token, bias) pairs into the flattened
logits, so greedy rows see it too. The grammar mask (structured output) sets to -inf every
token a row's grammar forbids, so no filter after it (nor a +100 bias) can bring one back.
Nothing here reads a tensor value on the host: no host-device sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.engine.sampling_metadata import SamplingMetadata
from tokenmill.kernels.token_bitmask import (
    apply_token_bitmask_,
    apply_token_bitmask_host_,
    apply_token_bitmask_ref,
)

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "apply_logit_bias",
    "apply_penalties",
    "apply_token_bitmask",
]

# Exp(1) draws of exactly 0 would turn 0 / q into NaN, which argmax picks.
_MIN_NOISE = 1e-30


@dataclass(frozen=True)
class LogprobsTensors:
    """Logprobs under the raw model distribution, for every row of the batch.

    Rows whose request did not ask are filled too; a request that asked for ``n`` reads
    ``top_token_ids[i, :n]``. ``rank`` is 1 for the most likely token.
    """

    sampled_token_ids: torch.Tensor  # [B] int64, as in SamplerOutput
    sampled_logprobs: torch.Tensor  # [B] float32: logprob of the sampled token
    sampled_ranks: torch.Tensor  # [B] int64: 1 + number of tokens strictly more likely
    top_token_ids: torch.Tensor  # [B, n] int64, most likely first; n = max_num_logprobs
    top_logprobs: torch.Tensor  # [B, n] float32

    def to_lists(self) -> list[tuple[int, float, int, list[int], list[float]]]:
        """Per row: (token id, its logprob, its rank, top-n ids, top-n logprobs), on the host.

        Reads the tensors back: a host-device sync, meant for after the step's token read.
        """
        return list(
            zip(
                self.sampled_token_ids.tolist(),
                self.sampled_logprobs.tolist(),
                self.sampled_ranks.tolist(),
                self.top_token_ids.tolist(),
                self.top_logprobs.tolist(),
                strict=True,
            )
        )


@dataclass(frozen=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs


class Sampler:
    """Stateless: turns [B, V] logits and a step's SamplingMetadata into SamplerOutput."""

    def __call__(
        self, logits: torch.Tensor, meta: SamplingMetadata, mutable: bool = False
    ) -> SamplerOutput:
        """Sample one token per row of ``logits`` ([B, V], any float dtype; not mutated
        unless ``mutable``: the caller's to give away, changed in place instead of copied).

        Raises ValueError when the logits shape does not match ``meta``.
        """
        if logits.dim() != 2 or tuple(logits.shape) != (meta.num_rows, meta.vocab_size):
            raise ValueError(
                f"Sampler: logits shape {tuple(logits.shape)} does not match the metadata's "
                f"[{meta.num_rows}, {meta.vocab_size}]; build SamplingMetadata for this batch"
            )
        masked = meta.allowed_token_rows is not None and meta.allowed_token_bitmask is not None
        if (
            meta.all_greedy
            and meta.max_num_logprobs is None
            and meta.no_penalties
            and meta.logit_bias_index is None
            and (not masked or (mutable and _maskable(logits)))
        ):
            # The argmax of the logits as they are (grammar rows masked in place, in their
            # own dtype): converting them to float32 first is exact, so it would pick the
            # same (first) maximum, after a [B, V] copy.
            if masked:
                logits = apply_token_bitmask(
                    logits, meta.allowed_token_rows, meta.allowed_token_bitmask, in_place=True
                )
            return SamplerOutput(sampled_token_ids=logits.argmax(dim=-1), logprobs=None)
        given, logits = logits, logits.float()  # a copy unless they were float32

        # Before any penalty or temperature: logprobs describe the model, not the sampler.
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]

        # vLLM's order: the bias (and min_tokens' bans, which ride on it) before penalties
        if meta.logit_bias_index is not None and meta.logit_bias_values is not None:
            logits = apply_logit_bias(logits, meta.logit_bias_index, meta.logit_bias_values)
        if not meta.no_penalties:
            logits = apply_penalties(logits, meta)
        if masked:
            logits = apply_token_bitmask(
                logits,
                meta.allowed_token_rows,
                meta.allowed_token_bitmask,
                in_place=mutable or logits is not given,  # or a copy made above
            )

        if meta.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            sampled = _sample_random(logits, meta)
            if not meta.all_random:
                sampled = torch.where(meta.greedy, logits.argmax(dim=-1), sampled)

        logprobs = None
        if raw_logprobs is not None and meta.max_num_logprobs is not None:
            logprobs = _gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def _maskable(logits: torch.Tensor) -> bool:
    """Whether the grammar masks go on ``logits`` in place as they are (the mask kernel's
    dtypes, contiguous rows); other logits are masked in a float32 copy."""
    return logits.dtype in (torch.float32, torch.bfloat16, torch.float16) and logits.stride(1) == 1


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Return a penalised copy of ``logits`` [B, V] (float32).

    Repetition (HF): tokens seen in prompt or output have positive logits divided by the
    penalty and negative ones multiplied. Then presence / frequency (OpenAI), output tokens only:
    ``logit -= presence * (count > 0) + frequency * count``.
    """
    counts = meta.output_token_counts  # [B, V] float32
    if counts is None:
        return logits  # built whenever some row has a penalty
    if meta.prompt_mask is not None:  # built whenever some row has a repetition penalty
        seen = meta.prompt_mask | (counts > 0)  # [B, V] bool
        penalty = meta.repetition_penalty.unsqueeze(1)  # [B, 1]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    presence = meta.presence_penalty.unsqueeze(1)  # [B, 1]
    frequency = meta.frequency_penalty.unsqueeze(1)  # [B, 1]
    return logits - presence * (counts > 0).float() - frequency * counts


def apply_logit_bias(
    logits: torch.Tensor, flat_index: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """Return a copy of ``logits`` [B, V] with ``bias[k]`` added at flat position
    ``flat_index[k]`` (= row * V + token; [K] each): every row's logit_bias in one op."""
    num_rows, vocab_size = logits.shape
    flat = logits.reshape(-1).index_add(0, flat_index, bias.to(logits.dtype))  # [B * V]
    return flat.view(num_rows, vocab_size)


def apply_token_bitmask(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor, in_place: bool = False
) -> torch.Tensor:
    """``logits`` [B, V] (float32, bfloat16 or float16) with -inf at every token row
    ``rows[g]`` may not take: a copy, or the tensor itself changed with ``in_place``.
    ``bitmask`` [G, W] int32 holds one bit per token, token t at bit t % 32 of word t // 32;
    tokens past 32 * W are forbidden. ``rows`` [G] are distinct. On CUDA the Triton kernel,
    elsewhere its PyTorch reference (the same bits; kernels/token_bitmask.py); neither syncs
    with the host."""
    if logits.is_cuda:
        return apply_token_bitmask_(logits if in_place else logits.clone(), rows, bitmask)
    if logits.device.type == "cpu":
        return apply_token_bitmask_host_(logits if in_place else logits.clone(), rows, bitmask)
    return apply_token_bitmask_ref(logits, rows, bitmask)


def _sample_random(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p (vLLM's order: min-p judges the tempered
    distribution before top-k / top-p renormalize it), then one exponential-race draw per
    row: [B] int64."""
    logits = logits / meta.temperature.unsqueeze(1)  # [B, V]
    if not meta.no_min_p:
        probs = torch.softmax(logits, dim=-1)  # [B, V]
        max_probs = probs.amax(dim=-1, keepdim=True)  # [B, 1]
        logits = logits.masked_fill(probs < meta.min_p.unsqueeze(1) * max_probs, float("-inf"))
    if not (meta.no_top_k and meta.no_top_p):
        logits = _apply_top_k_top_p(logits, meta)
    probs = torch.softmax(logits, dim=-1)  # [B, V]
    return (probs / _exponential_noise(probs, meta)).argmax(dim=-1)


def _apply_top_k_top_p(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Mask to -inf all but each row's top_k best tokens, then all but its top-p nucleus.

    Works in descending-sorted order, where both filters keep a prefix of positions:

        sorted position j:   0    1    2    3    4   ...
        top-k keeps          logit j >= logit top_k - 1  (ties with the k-th kept, as HF's
                             and vLLM's top-k do: bf16 logits tie often)
        top-p keeps          cumulative prob of positions < j  is  < top_p  (j = 0 always)
    """
    vocab_size = logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)  # [B, V]
    positions = torch.arange(vocab_size, device=logits.device).unsqueeze(0)  # [1, V]
    kth = sorted_logits.gather(1, (meta.top_k.clamp(1, vocab_size) - 1).unsqueeze(1))  # [B, 1]
    keep = sorted_logits >= kth  # [B, V]
    if not meta.no_top_p:
        probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # [B, V] exclusive cumulative sum
        top_p = meta.top_p.unsqueeze(1)  # [B, 1]
        keep &= (mass_before < top_p) | (top_p >= 1.0) | (positions == 0)
    remove = torch.empty_like(keep).scatter_(1, sorted_ids, ~keep)  # back to vocab order
    return logits.masked_fill(remove, float("-inf"))


def _exponential_noise(probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Exp(1) noise [B, V]: seeded rows from their own generators, the rest from one shared."""
    noise = torch.empty_like(probs)
    if meta.has_unseeded_random:
        noise.exponential_(generator=meta.generator)
    for row, seed in meta.row_seeds:
        generator = torch.Generator(device=probs.device)
        generator.manual_seed(seed)
        noise[row].exponential_(generator=generator)
    return noise.clamp_min_(_MIN_NOISE)


def _gather_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, n: int) -> LogprobsTensors:
    """Sampled token's logprob and rank, and the top-n alternatives (all V when n > V), from
    [B, V] logprobs."""
    sampled_logprobs = logprobs.gather(1, sampled.unsqueeze(1))  # [B, 1]
    ranks = (logprobs > sampled_logprobs).sum(dim=-1) + 1  # [B]
    top_logprobs, top_ids = logprobs.topk(min(n, logprobs.shape[-1]), dim=-1)  # [B, n]
    return LogprobsTensors(
        sampled_token_ids=sampled,
        sampled_logprobs=sampled_logprobs.squeeze(1),
        sampled_ranks=ranks,
        top_token_ids=top_ids,
        top_logprobs=top_logprobs,
    )
