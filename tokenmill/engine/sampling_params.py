"""SamplingParams: how one request's tokens are chosen and when it stops."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import InitVar, dataclass
from typing import Any

from tokenmill.engine.structured_output_params import (
    StructuredOutputsParams,
    check_structured_output,
)
from tokenmill.engine.vllm_sampling_fields import (
    RequestOutputKind,
    check_output_kind,
    check_vllm_only,
)


@dataclass
class SamplingParams:
    """Per-request sampling settings, validated when built.

    ``temperature == 0`` means greedy; so does one below 1e-5 (kept as 0: dividing the
    logits by it would overflow float32, as vLLM's rule has it). ``top_k <= 0`` and
    ``top_p == 1`` disable those filters.
    ``seed`` makes the request's samples reproducible whatever else shares its batch; it is
    a signed 64-bit integer (``SEED_RANGE``). -1 is no seed, kept as None (vLLM's meaning:
    scripts pass it for "random").
    ``logprobs`` asks for the sampled token's logprob plus that many top alternatives.
    ``n`` completions are returned per prompt; with ``best_of``, that many are generated and
    the ``n`` with the highest cumulative logprob are returned, best first. With a ``seed``,
    completion ``i`` draws from a seed derived from (seed, i); completion 0 from ``seed``
    itself, so ``n=1`` gives what it gives without ``n``. ``prompt_logprobs`` (0-20) asks
    for each prompt token's logprob and that many top alternatives at its position
    (``RequestOutput.prompt_logprobs``; see prompt_logprobs.py); such a request takes no
    prefix-cache hits, since cached positions have no logits.
    ``structured_output`` constrains the completion: a JSON schema (a dict or a JSON string)
    it must validate against, ``"json_object"`` for any JSON object, ``"regex:<pattern>"``
    for a completion the pattern matches in full, ``"choice:<JSON list>"`` for exactly one
    of the listed strings, or a ``StructuredOutputsParams(json= | regex= | choice= |
    json_object=)`` as vLLM's. It is kept as canonical text (compact JSON for a schema; see
    structured_output_params.py). The row stops ("stop") as soon as the output is complete;
    one that reaches ``max_tokens`` first ends with "length" and an incomplete output, as
    OpenAI's do. Needs the llguidance package (see structured_output.py).
    ``logit_bias`` maps token ids to a bias in [-100, 100] added to their logits at every
    step, before temperature, top-k and top-p (OpenAI's and vLLM's ``logit_bias``): +100
    all but forces a token, -100 all but bans it. Keys may be ints or, as OpenAI's JSON
    spells them, strings of digits; they are kept as ints. Ids past the model's vocabulary
    are refused when the request is added to an engine.
    ``max_tokens=None`` (vLLM's: as many as the context leaves room for) is kept as
    2**31 - 1: the engine's ``max_model_len`` ends the row ("length").
    ``truncate_prompt_tokens`` k (vLLM's) keeps the prompt's last k tokens (left
    truncation); -1, as many as the engine's context leaves room for with one token to
    generate.
    Raises ValueError naming the field when a value is out of range; so does setting a
    field afterwards (``params.max_tokens = 64``, as vLLM's scripts do), which checks the
    whole again and leaves the params as they were when it fails. ``LLM.generate`` /
    ``chat`` copy the params they are given when the call starts.
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
    structured_output: str | dict[str, Any] | StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    truncate_prompt_tokens: int | None = None
    # vLLM's names for structured_output (>= 0.10.2, and before): either may be given
    # instead of it (not a field: kept as structured_output)
    structured_outputs: InitVar[StructuredOutputsParams | None] = None
    guided_decoding: InitVar[StructuredOutputsParams | None] = None
    # vLLM's arguments with no setting here: taken at vLLM's defaults, which change nothing,
    # refused by name otherwise (vllm_sampling_fields.py)
    detokenize: InitVar[bool] = True
    spaces_between_special_tokens: InitVar[bool] = True
    allowed_token_ids: InitVar[list[int] | None] = None
    bad_words: InitVar[list[str] | None] = None
    logits_processors: InitVar[list[Any] | None] = None
    extra_args: InitVar[dict[str, Any] | None] = None
    output_kind: InitVar[RequestOutputKind] = RequestOutputKind.CUMULATIVE

    def __post_init__(
        self,
        structured_outputs: StructuredOutputsParams | None,
        guided_decoding: StructuredOutputsParams | None,
        detokenize: bool,
        spaces_between_special_tokens: bool,
        allowed_token_ids: list[int] | None,
        bad_words: list[str] | None,
        logits_processors: list[Any] | None,
        extra_args: dict[str, Any] | None,
        output_kind: RequestOutputKind,
    ) -> None:
        check_vllm_only(
            {
                "detokenize": detokenize,
                "spaces_between_special_tokens": spaces_between_special_tokens,
                "allowed_token_ids": allowed_token_ids,
                "bad_words": bad_words,
                "logits_processors": logits_processors,
                "extra_args": extra_args,
            }
        )
        check_output_kind(output_kind)
        spellings = (self.structured_output, structured_outputs, guided_decoding)
        given = [v for v in spellings if v is not None]
        if len(given) > 1:
            raise ValueError(
                "SamplingParams: give one of structured_output, structured_outputs and "
                "guided_decoding (they are one setting, under vLLM's names too)"
            )
        if given:
            object.__setattr__(self, "structured_output", given[0])
        # Lists are accepted for convenience and frozen into tuples (vLLM keeps lists): so
        # they change only through __setattr__'s checks, and a call's shallow snapshot of
        # its params (llm.py) holds. None (vLLM's default spelling) is none.
        if self.stop is None:
            object.__setattr__(self, "stop", ())
        if self.stop_token_ids is None:
            object.__setattr__(self, "stop_token_ids", ())
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        _check(
            not isinstance(self.stop_token_ids, (str, bytes))
            and all(is_int(t) and 0 <= t <= _INT_MAX for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            "a list of token ids (integers in [0, 2**31 - 1])",
        )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for flag in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _check(
                isinstance(getattr(self, flag), bool), flag, getattr(self, flag), "True or False"
            )
        if self.max_tokens is None:  # vLLM's "no limit": the context ends the row
            object.__setattr__(self, "max_tokens", _INT_MAX)
        _check(
            is_int(self.max_tokens) and 1 <= self.max_tokens <= _INT_MAX,
            "max_tokens",
            self.max_tokens,
            "an integer in [1, 2**31 - 1] (the context ends a row first anyway)",
        )
        _check(
            is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            self.min_tokens,
            "an integer in [0, max_tokens]",
        )
        _check(
            is_number(self.temperature) and 0 <= self.temperature <= _FLOAT32_MAX,
            "temperature",
            self.temperature,
            "a number >= 0 (at most 3.4e38: the sampler's columns are float32)",
        )
        if self.temperature < _GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        _check(is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(
            is_int(self.top_k) and (self.top_k == -1 or 0 <= self.top_k <= _INT_MAX),
            "top_k",
            self.top_k,
            "-1 (off) or an integer in [0, 2**31 - 1] (0 is off too)",
        )
        _check(is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(is_number(value) and -2 <= value <= 2, name, value, "in [-2, 2]")
        _check(
            is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= _FLOAT32_MAX,
            "repetition_penalty",
            self.repetition_penalty,
            "a number > 0 (at most 3.4e38: the sampler's columns are float32)",
        )
        if is_int(self.seed) and self.seed == -1:  # vLLM's "unseeded" (its rule)
            object.__setattr__(self, "seed", None)
        low, high = SEED_RANGE
        _check(
            self.seed is None or (is_int(self.seed) and low <= self.seed <= high),
            "seed",
            self.seed,
            "None or an integer in [-2**63, 2**63 - 1] (the engine keeps a seed's 64 bits: "
            "one outside would sample as one inside)",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "non-empty strings"
        )
        _check(
            self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= 20),
            "logprobs",
            self.logprobs,
            "None or an integer in [0, 20]",
        )
        _check(is_int(self.n) and self.n >= 1, "n", self.n, "an integer >= 1")
        _check(
            self.best_of is None or (is_int(self.best_of) and self.best_of >= self.n),
            "best_of",
            self.best_of,
            f"None or an integer >= n (n={self.n})",
        )
        _check(
            self.prompt_logprobs is None
            or (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
            "prompt_logprobs",
            self.prompt_logprobs,
            "None or an integer in [0, 20]",
        )
        _check(
            self.truncate_prompt_tokens is None
            or (
                is_int(self.truncate_prompt_tokens)
                and (self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1)
            ),
            "truncate_prompt_tokens",
            self.truncate_prompt_tokens,
            "None, -1 (the context's room) or an integer >= 1",
        )
        object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))
        # Last: the other fields' errors come first, and without llguidance installed only
        # a request that asks for structured output fails (ImportError).
        object.__setattr__(
            self, "structured_output", check_structured_output(self.structured_output)
        )

    def __setattr__(self, name: str, value: Any) -> None:
        names = _field_names(type(self))
        if names[-1] not in self.__dict__:  # being built (__init__ sets the fields in
            object.__setattr__(self, name, value)  # order): __post_init__ checks them all
            return
        name = _ALIASES.get(name, name)
        if name not in names:
            raise AttributeError(f"SamplingParams has no field {name!r}")
        checked = dataclasses.replace(self, **{name: value})  # raises as the constructor
        for field_name in names:
            object.__setattr__(self, field_name, getattr(checked, field_name))

    def __delattr__(self, name: str) -> None:  # (a deleted last field would read as unbuilt)
        raise AttributeError(f"SamplingParams fields cannot be deleted ({name!r}); set them")

    def clone(self) -> SamplingParams:
        """A copy to change without changing these (vLLM's ``clone``)."""
        return copy.deepcopy(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def num_samples(self) -> int:
        """Completions generated per prompt: ``best_of`` when set, else ``n``."""
        return self.n if self.best_of is None else self.best_of


_ALIASES = {"structured_outputs": "structured_output", "guided_decoding": "structured_output"}


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    """The fields of ``cls`` (SamplingParams or a subclass of it)."""
    return tuple(f.name for f in dataclasses.fields(cls))


LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's bounds


def check_logit_bias(
    value: object, name: str = "SamplingParams.logit_bias"
) -> dict[int, float] | None:
    """``value`` as a ``{token id: bias}`` dict (None or empty: None), ids as ints.

    Takes a mapping whose keys are ints >= 0 or strings of digits (OpenAI's JSON), and whose
    values are numbers in [-100, 100]. Raises ValueError naming the key (after ``name``:, when
    given) otherwise.
    """
    if value is None:
        return None
    where = f"{name}: " if name else ""
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{where}expected a mapping of token id to bias, got {type(value).__name__}"
        )
    low, high = LOGIT_BIAS_RANGE
    bias: dict[int, float] = {}
    for key, item in value.items():
        token = _token_id(key)
        if token is None:
            raise ValueError(
                f"{where}key {_short(key)} is not a token id (an integer >= 0, or its digits "
                "as a string)"
            )
        if not (is_number(item) and low <= item <= high):
            raise ValueError(
                f"{where}the bias of token {_short(key)} must be a number in [-100, 100], "
                f"got {_short(item)}"
            )
        if token in bias:
            raise ValueError(f"{where}token id {token} is given twice")
        bias[token] = float(item)
    return bias or None


def check_vocab_ids(params: SamplingParams, vocab_size: int) -> None:
    """Raise ValueError when ``params.logit_bias`` or ``params.stop_token_ids`` names ids
    outside ``[0, vocab_size)`` (the sampler's sparse add needs every biased id to be a
    column of the logits; a stop id the model cannot sample would never stop anything)."""
    for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
        bad = ids_outside_vocab(ids, vocab_size)
        if bad:
            raise ValueError(
                f"{name} token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
            )


def ids_outside_vocab(ids: Iterable[int] | None, vocab_size: int) -> list[int]:
    """The token ids of ``ids`` (a logit_bias mapping's keys, stop ids) outside
    ``[0, vocab_size)``, in order."""
    return sorted(t for t in ids or () if not 0 <= t < vocab_size)


def _token_id(key: object) -> int | None:
    if is_int(key):
        return key if key >= 0 else None  # type: ignore[return-value, operator]
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12:
        return int(key)
    return None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# The seeds told apart: the engine keeps a seed's low 64 bits (sampling_columns.py), so a
# wider range had 2**64 sample as 0 and -1 as 2**64 - 1. Signed, as vLLM's OpenAI server
# takes seeds (torch.long), so negative seeds keep their samples.
SEED_RANGE = (-(2**63), 2**63 - 1)
_FLOAT32_MAX = 3.4028234663852886e38  # larger values overflow the sampler's float32 columns
_INT_MAX = 2**31 - 1  # counts and top_k beyond it mean nothing more (and overflow the columns)


_GREEDY_BELOW = 1e-5  # temperatures below it sample greedily


def is_number(value: object) -> bool:
    """A finite int or float (not a bool); an int too large for a float is not."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class SamplingParamError(ValueError):
    """A SamplingParams field's value breaks its rule: ``name``, the ``value`` given and
    what was ``expected`` (a job spec names it as ``sampling.<name>``)."""

    def __init__(self, name: str, value: object, expected: str) -> None:
        super().__init__(f"SamplingParams.{name} must be {expected}, got {value!r}")
        self.name, self.value, self.expected = name, value, expected


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise SamplingParamError(name, value, expected)
