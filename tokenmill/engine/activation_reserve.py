"""The memory a step's activations take, held back from the KV cache's budget.

    max_num_batched_tokens T ──► a few [T, hidden] and one [T, 2 * intermediate] tensor
    max_num_seqs B           ──► fp32 logits [B, vocab], and two working copies (the sampler)

Each part grows with its own setting. A budget they left short blamed ``kv_cache_memory``
alone ("for activations"), though lowering the setting behind the larger part is the fix;
``why`` names it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.engine.model_config import ModelConfig

__all__ = ["LOGITS_BYTES", "ActivationReserve", "activation_reserve"]

LOGITS_BYTES = 4 * 3  # fp32, the logits and two copies the sampler makes of them


@dataclass(frozen=True)
class ActivationReserve:
    """Bytes of a full step's peak activations, by the setting that drives them."""

    tokens_bytes: int  # the [max_num_batched_tokens, ...] activations
    logits_bytes: int  # the [max_num_seqs, vocab] logits
    max_num_batched_tokens: int
    max_num_seqs: int

    @property
    def nbytes(self) -> int:
        return self.tokens_bytes + self.logits_bytes

    def why(self) -> str:
        """What the bytes are for, naming the setting behind most of them and what to lower."""
        if self.tokens_bytes >= self.logits_bytes:
            part, setting = self.tokens_bytes, "max_num_batched_tokens"
            what = f"max_num_batched_tokens={self.max_num_batched_tokens} tokens a step"
        else:
            part, setting = self.logits_bytes, "max_num_seqs"
            what = f"the logits of max_num_seqs={self.max_num_seqs} rows"
        return f"activations ({part / 2**30:.2f} GiB for {what}: lower {setting} to need less)"


def activation_reserve(
    config: ModelConfig, dtype: torch.dtype, max_num_batched_tokens: int, max_num_seqs: int
) -> ActivationReserve:
    """The peak activations of one full step of a ``config`` model in ``dtype``."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_token = (6 * config.hidden_size + 3 * config.intermediate_size) * elem
    return ActivationReserve(
        tokens_bytes=max_num_batched_tokens * per_token,
        logits_bytes=max_num_seqs * config.vocab_size * LOGITS_BYTES,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
    )
