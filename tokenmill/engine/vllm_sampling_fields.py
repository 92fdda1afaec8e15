"""vLLM's SamplingParams arguments the engine has no setting for.

Scripts spell them out at vLLM's defaults (``detokenize=True``, ``bad_words=None``), which
change nothing here, so those are taken; any other value would be silently ignored, so it
is refused, naming the argument and what to do instead:

    detokenize=True                    the text is always decoded
    spaces_between_special_tokens=True the tokenizer's own decode joins special tokens
    allowed_token_ids, bad_words,      None or empty: no restriction (logit_bias bans or
      logits_processors                  forces tokens; structured_output constrains text)
    extra_args=None                    no custom sampler reads them
    output_kind=CUMULATIVE or          LLM.generate / chat return each request's final
      FINAL_ONLY                         output only (LLMEngine.step too): DELTA refused
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

__all__ = ["RequestOutputKind", "check_output_kind", "check_vllm_only"]


class RequestOutputKind(IntEnum):
    """vLLM's ``RequestOutputKind`` (``vllm.sampling_params``), with its values: what a
    streaming caller is handed as a request runs. Offline calls hand back the final output
    only, so CUMULATIVE (vLLM's default) and FINAL_ONLY are the same here."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# argument -> (the value that changes nothing: True or None, what to do instead of another)
_TAKEN: dict[str, tuple[bool | None, str]] = {
    "detokenize": (True, "the engine always decodes the text; leave it out"),
    "spaces_between_special_tokens": (
        True,
        "special tokens are joined as the tokenizer's decode joins them; leave it out",
    ),
    "allowed_token_ids": (
        None,
        "ban the other tokens with logit_bias={id: -100}, or constrain the text with "
        "structured_output",
    ),
    "bad_words": (None, "ban their tokens with logit_bias={id: -100}"),
    "logits_processors": (None, "custom logits processors are not supported"),
    "extra_args": (None, "no sampler reads extra arguments; leave it out"),
}


def check_vllm_only(values: dict[str, Any]) -> None:
    """Raise ValueError naming the first of ``values`` (vLLM-only argument -> value) that
    is not its no-op value (an empty list counts as None)."""
    for name, value in values.items():
        taken, instead = _TAKEN[name]
        if isinstance(value, list | tuple) and not value:
            value = None
        if value is not taken:  # (1 is not True)
            default = "None (or empty)" if taken is None else repr(taken)
            raise ValueError(
                f"SamplingParams.{name}={value!r} is not supported (vLLM's; only {default} "
                f"is taken): {instead}"
            )


def check_output_kind(value: Any) -> None:
    """Raise ValueError unless ``value`` is RequestOutputKind CUMULATIVE or FINAL_ONLY
    (ours or vLLM's enum, or its int), naming DELTA when it is that."""
    kind = None
    if isinstance(value, int) and not isinstance(value, bool):
        kind = RequestOutputKind._value2member_map_.get(int(value))
    if kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
        return
    if kind is RequestOutputKind.DELTA:
        raise ValueError(
            "SamplingParams.output_kind=RequestOutputKind.DELTA is not supported: LLM.generate "
            "and chat return each request's final output only, never the new tokens of a "
            "step; leave it out (CUMULATIVE, vLLM's default) or pass FINAL_ONLY"
        )
    raise ValueError(
        f"SamplingParams.output_kind must be RequestOutputKind.CUMULATIVE or FINAL_ONLY "
        f"(from tokenmill import RequestOutputKind), got {value!r}"
    )
