"""ModelOutput: what one step sampled, as host values, for the scheduler and the engine."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenmill.engine.sampler import SamplerOutput


@dataclass(frozen=True)
class ModelOutput:
    """Sampled tokens of the rows that sampled this step, in logits-row order.

    ``rows[i]`` is the index in the step's ``SchedulerOutput`` of the row that sampled
    ``sampled_token_ids[i]``.
    """

    rows: np.ndarray  # [S] int64
    sampled_token_ids: np.ndarray  # [S] int64
    sampler_output: SamplerOutput | None  # host tensors (logprobs when asked for)
