"""SamplingParams: how one request's tokens are chosen and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.structured_output import check_structured_output


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, validated when built.

    ``temperature == 0`` means greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``seed`` makes the request's samples reproducible whatever else shares its batch.
    ``logprobs`` asks for the sampled token's logprob plus that many top alternatives.
    ``n`` completions are returned per prompt; with ``best_of``, that many are generated and
    the ``n`` with the highest cumulative logprob are returned, best first. With a ``seed``,
    completion ``i`` draws from a seed derived from (seed, i); completion 0 from ``seed``
    itself, so ``n=1`` gives what it gives without ``n``. ``prompt_logprobs`` is not
    supported yet (the engine computes logits only where it samples) and must stay None.
    ``structured_output`` constrains the completion to JSON: a JSON schema (a dict or a JSON
    string) it must validate against, or ``"json_object"`` for any JSON object; it is kept
    as compact JSON text (``"json_object"`` as is). The row stops ("stop") as soon as the
    JSON is complete; one that reaches ``max_tokens`` first ends with "length" and an
    incomplete JSON, as OpenAI's do. Needs the llguidance package (see structured_output.py).
    Raises ValueError naming the field when a value is out of range.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    n: int = 1
    best_of: int | None = None
    prompt_logprobs: int | None = None
    structured_output: str | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            "max_tokens",
            self.max_tokens,
            "an integer >= 1",
        )
        _check(
            isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            self.min_tokens,
            "an integer in [0, max_tokens]",
        )
        _check(
            _is_number(self.temperature) and self.temperature >= 0,
            "temperature",
            self.temperature,
            "a number >= 0",
        )
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(
            isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 0),
            "top_k",
            self.top_k,
            "-1 (off) or an integer >= 0 (0 is off too)",
        )
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name, value, "in [-2, 2]")
        _check(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            self.repetition_penalty,
            "a number > 0",
        )
        _check(
            self.seed is None or isinstance(self.seed, int), "seed", self.seed, "an integer or None"
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "non-empty strings"
        )
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            "logprobs",
            self.logprobs,
            "None or an integer in [0, 20]",
        )
        _check(_is_int(self.n) and self.n >= 1, "n", self.n, "an integer >= 1")
        _check(
            self.best_of is None or (_is_int(self.best_of) and self.best_of >= self.n),
            "best_of",
            self.best_of,
            f"None or an integer >= n (n={self.n})",
        )
        _check(
            self.prompt_logprobs is None,
            "prompt_logprobs",
            self.prompt_logprobs,
            "None (prompt logprobs are not supported yet: the engine computes logits only at "
            "the positions it samples)",
        )
        # Last: the other fields' errors come first, and without llguidance installed only
        # a request that asks for structured output fails (ImportError).
        object.__setattr__(
            self, "structured_output", check_structured_output(self.structured_output)
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def num_samples(self) -> int:
        """Completions generated per prompt: ``best_of`` when set, else ``n``."""
        return self.n if self.best_of is None else self.best_of


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {expected}, got {value!r}")
