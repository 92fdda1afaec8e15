"""What the engine hands back for each request.

A RequestOutput is one prompt's result. Its completions are in ``outputs`` (vLLM's shape:
``o.outputs[i].text``); the flat fields (``o.text``, ``o.token_ids``, ...) are the first
completion's, so code written against either shape reads the same values:

    RequestOutput(request_id, prompt, prompt_token_ids, prompt_logprobs, num_cached_tokens,
                  error)
      ├─ text, token_ids, finish_reason, stop_reason, logprobs  ══ outputs[0]'s
      └─ outputs: [CompletionOutput(index=0, ...), CompletionOutput(index=1, ...), ...]
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CompletionOutput", "Logprob", "RequestOutput", "TokenLogprob"]


@dataclass(frozen=True)
class Logprob:
    """One candidate token at a position, as vLLM's results give it."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None  # the token's text (logprob_texts.py)


@dataclass(frozen=True)
class TokenLogprob(Mapping[int, Logprob]):
    """The chosen token's logprob and the top alternatives (token id -> logprob).

    It is also vLLM's per-position mapping, token id -> ``Logprob`` over the chosen token and
    the alternatives, in vLLM's order (the chosen token first, then the alternatives by
    rank), so ``lp[token_id].logprob`` and ``lp.items()`` read as they do there.
    """

    token_id: int
    logprob: float
    rank: int
    top: dict[int, float] = field(default_factory=dict)
    # token id -> text, for Logprob.decoded_token (set when the request's output is built)
    texts: Mapping[int, str] | None = field(default=None, compare=False, repr=False)

    @functools.cached_property
    def _entries(self) -> dict[int, Logprob]:
        # The chosen token first, then the alternatives by rank, as vLLM orders them (code
        # reads the chosen token's logprob as ``next(iter(lp.values()))``).
        text = (self.texts or {}).get
        entries = {self.token_id: Logprob(self.logprob, self.rank, text(self.token_id))}
        ranked = sorted(self.top.items(), key=lambda kv: -kv[1])
        for rank, (t, v) in enumerate(ranked, start=1):
            entries.setdefault(t, Logprob(v, rank, text(t)))
        return entries

    def __getitem__(self, token_id: int) -> Logprob:
        return self._entries[token_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(frozen=True)
class CompletionOutput:
    """One completion of a prompt (one of ``SamplingParams.n``).

    ``cumulative_logprob`` is the sum of the sampled tokens' logprobs under the model's raw
    distribution (before temperature and penalties, as ``logprobs``); None when the engine
    did not compute them (no ``logprobs`` asked for and no ``best_of`` to rank by).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[TokenLogprob] | None
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """Always True: the engine returns finished requests only."""
        return True

    @property
    def lora_request(self) -> None:
        """vLLM's: always None (no LoRA adapters)."""
        return None


@dataclass(frozen=True)
class RequestOutput:
    """A finished request. ``error`` is set when the request could not run, e.g. a prompt
    longer than the model's context, or one of its completions failed (that completion's
    ``finish_reason`` is "error": a grammar rejected a sampled token); the other requests of
    the batch are unaffected.

    Built from the flat fields (one completion; ``outputs`` is then derived from them) or by
    ``from_completions``. ``prompt`` is the prompt's text where there was one (a text prompt,
    or a conversation rendered by the chat template); None for token-id prompts.
    ``prompt_logprobs`` (when SamplingParams asked for them) is vLLM's: None for the first
    prompt token, then per token a TokenLogprob, the mapping token id -> Logprob of that
    token and the top alternatives at its position. Raises
    ValueError when ``outputs`` is given and its first completion disagrees with the flat
    fields, or its indexes are not 0, 1, 2, ...
    """

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def __post_init__(self) -> None:
        if not self.outputs:
            only = CompletionOutput(
                index=0,
                text=self.text,
                token_ids=self.token_ids,
                cumulative_logprob=cumulative_logprob(self.logprobs),
                logprobs=self.logprobs,
                finish_reason=self.finish_reason,
                stop_reason=self.stop_reason,
            )
            object.__setattr__(self, "outputs", [only])
            return
        first = self.outputs[0]
        flat = (self.text, self.token_ids, self.finish_reason, self.stop_reason, self.logprobs)
        if flat != (first.text, first.token_ids, first.finish_reason, first.stop_reason,
                    first.logprobs):  # fmt: skip
            raise ValueError(
                f"RequestOutput {self.request_id!r}: the flat fields must be outputs[0]'s; "
                "build it with RequestOutput.from_completions"
            )
        indexes = [c.index for c in self.outputs]
        if indexes != list(range(len(self.outputs))):
            raise ValueError(
                f"RequestOutput {self.request_id!r}: completion indexes must be 0, 1, 2, ...; "
                f"got {indexes}"
            )

    @classmethod
    def from_completions(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        completions: Sequence[CompletionOutput],
        *,
        prompt: str | None = None,
        num_cached_tokens: int = 0,
        prompt_logprobs: list[TokenLogprob | None] | None = None,
        error: str | None = None,
    ) -> RequestOutput:
        """A RequestOutput holding ``completions`` (at least one; indexes 0, 1, 2, ...), its
        flat fields taken from the first; ``error`` set when one of them failed. Raises
        ValueError when ``completions`` is empty."""
        if not completions:
            raise ValueError(f"RequestOutput {request_id!r}: needs at least one completion")
        first = completions[0]
        return cls(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            text=first.text,
            token_ids=first.token_ids,
            finish_reason=first.finish_reason,
            stop_reason=first.stop_reason,
            num_cached_tokens=num_cached_tokens,
            logprobs=first.logprobs,
            outputs=list(completions),
            prompt=prompt,
            prompt_logprobs=prompt_logprobs,
            error=error,
        )

    @property
    def finished(self) -> bool:
        """Always True: the engine returns finished requests only."""
        return True

    # vLLM's attributes for what the engine has no such thing for (migrated code reads them:
    # they raised AttributeError); ``num_cached_tokens`` and the rest hold real values.
    @property
    def metrics(self) -> None:
        """None: no per-request timings are kept (vLLM's is None too without stats)."""
        return None

    @property
    def lora_request(self) -> None:
        """None: no LoRA adapters."""
        return None

    @property
    def encoder_prompt(self) -> None:
        """None: decoder-only models only."""
        return None

    @property
    def encoder_prompt_token_ids(self) -> None:
        """None: decoder-only models only."""
        return None

    @property
    def multi_modal_placeholders(self) -> dict[str, list[Any]]:
        """Empty (vLLM's value without multi-modal inputs): text prompts only."""
        return {}

    @property
    def kv_transfer_params(self) -> None:
        """None: no disaggregated prefill."""
        return None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        """Tokens of the first completion (``outputs[0]``), as the other flat fields."""
        return len(self.token_ids)

    @property
    def ok(self) -> bool:
        return self.error is None


def cumulative_logprob(logprobs: Sequence[TokenLogprob] | None) -> float | None:
    """The sum of the sampled tokens' logprobs; None when they were not computed."""
    if logprobs is None:
        return None
    return float(sum(lp.logprob for lp in logprobs))
