"""How much engine time a row will take, predicted before it runs: what length ordering sorts by.

A row holds a batch slot for one engine step per output token, after its prompt has been
prefilled, ``max_num_batched_tokens`` tokens a step at most. Its output length is unknown
until it stops; ``max_tokens`` bounds it, and is often set per row to fit the task (a label:
8, a summary: 512), which is what makes it a useful prediction. So:

    predicted steps = max_tokens + prompt_tokens / prefill_tokens_per_step

A row that stops early (EOS, a stop string, finished JSON) is overestimated; nothing better
is known before it runs. Among rows with the same ``max_tokens`` the longer prompt ranks
first (its prefill is more work), which keeps the ranking total without reordering rows that
cost the same. Rows not yet tokenized (a Ray driver hands text to its replicas) count
prompt tokens as UTF-8 bytes / 4, about what BPE tokenizers give for English text.
"""

from __future__ import annotations

__all__ = ["BYTES_PER_TOKEN", "estimated_prompt_tokens", "predicted_steps"]

BYTES_PER_TOKEN = 4  # a BPE token is about 4 bytes of English text


def predicted_steps(prompt_tokens: int, max_tokens: int, prefill_tokens_per_step: int) -> float:
    """Engine steps a row is predicted to take: its output budget plus its prefill share.
    Raises ValueError for a non-positive ``prefill_tokens_per_step``."""
    if prefill_tokens_per_step < 1:
        raise ValueError(f"prefill_tokens_per_step must be >= 1, got {prefill_tokens_per_step}")
    return max_tokens + prompt_tokens / prefill_tokens_per_step


def estimated_prompt_tokens(text: str) -> int:
    """Prompt tokens of ``text`` before it is tokenized: its UTF-8 bytes / 4, rounded up."""
    return -(-len(text.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN)
