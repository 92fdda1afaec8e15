"""What the engine hands back for each request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's logprob and the top alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    rank: int
    top: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestOutput:
    """A finished request. ``error`` is set (and ``finish_reason == "error"``) when the
    request could not run, e.g. a prompt longer than the model's context; the other
    requests of the batch are unaffected."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def ok(self) -> bool:
        return self.error is None
