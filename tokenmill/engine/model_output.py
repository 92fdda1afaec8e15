"""ModelOutput: what one step sampled, as host values, for the scheduler and the engine."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.sampler import SamplerOutput


@dataclass(frozen=True)
class ModelOutput:
    """Sampled tokens of the requests that sampled this step, in batch order."""

    request_ids: tuple[str, ...]
    sampled_token_ids: list[int]
    sampler_output: SamplerOutput | None  # host tensors (logprobs when asked for)

    def as_dict(self) -> dict[str, list[int]]:
        return {
            rid: [tok] for rid, tok in zip(self.request_ids, self.sampled_token_ids, strict=True)
        }
