"""vLLM's SamplingParams arguments the engine has no setting for.

Scripts spell them out at vLLM's defaults (``detokenize=True``, ``bad_words=None``), which
change nothing here, so those are taken; any other value would be silently ignored, so it
is refused, naming the argument and what to do instead:

    detokenize=True                    the text is always decoded
    spaces_between_special_tokens=True the tokenizer's own decode joins special tokens
    allowed_token_ids, bad_words,      None or empty: no restriction (logit_bias bans or
      logits_processors                  forces tokens; structured_output constrains text)
    extra_args=None                    no custom sampler reads them
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_vllm_only"]

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
