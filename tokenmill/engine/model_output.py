"""ModelOutput: what one step sampled, as host values, for the scheduler and the engine."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenmill.engine.sampler import SamplerOutput


@dataclass(frozen=True)
class ModelOutput:
    """Sampled tokens of the rows that sampled this step, in logits-row order.

    ``rows[i]`` is the index in the step's ``SchedulerOutput`` of a row that sampled
    ``counts[i]`` tokens (1 + its drafts), the next ``counts[i]`` of ``sampled_token_ids``.
    """

    rows: np.ndarray  # [S] int64
    counts: np.ndarray  # [S] int64
    sampled_token_ids: np.ndarray  # [N] int64, N = counts.sum()
    sampler_output: SamplerOutput | None  # host tensors (logprobs when asked for)
