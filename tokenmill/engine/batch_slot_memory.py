"""Whether ``max_num_seqs`` batch slots, and on CPU a full step's logits, fit the host,
checked before the weights load.

Each slot keeps its request's token ids, ``max_model_len`` of them as int32, in host memory
(core/batch_slots.py), all allocated when the engine starts. ``max_num_seqs=10**12`` passed
the settings check, loaded the weights, then failed in numpy ("Unable to allocate 931. TiB"),
or in a job blamed ``kv_cache_memory`` for the activations it sizes; it is refused here,
named, while nothing has loaded.

On CPU a step's logits are host memory too: fp32 ``[rows, vocab]`` and the sampler's two
copies (activation_reserve.py), for at most ``min(max_num_seqs, max_num_batched_tokens)``
rows (each row takes a token of the step's budget). ``max_num_seqs`` and
``max_num_batched_tokens`` of 50,000 with a 100,000-token vocabulary loaded the weights and
then failed in the first full step ("DefaultCPUAllocator: can't allocate memory"), the rows
already running; they are refused here too.
"""

from __future__ import annotations

from tokenmill.engine.activation_reserve import LOGITS_BYTES
from tokenmill.engine.engine_config import EngineSettingError, host_memory

__all__ = ["check_slots_fit"]

_TOKEN_ID_BYTES = 4  # int32


def check_slots_fit(
    max_num_seqs: int,
    max_model_len: int,
    host_logits_vocab: int = 0,
    max_num_batched_tokens: int = 0,
) -> None:
    """Raises EngineSettingError naming ``max_num_seqs`` when its slots' token ids, at
    ``max_model_len`` tokens each, and the logits of a full step (``host_logits_vocab``
    entries a row, 0 where they are not in host memory; at most ``max_num_batched_tokens``
    rows) need more than the host's available memory; naming ``max_num_batched_tokens``
    when the logits of its rows alone do."""
    per_slot = max_model_len * _TOKEN_ID_BYTES
    per_row = host_logits_vocab * LOGITS_BYTES
    rows = min(max_num_seqs, max_num_batched_tokens) if per_row else 0
    _, available = host_memory()
    if max_num_seqs * per_slot + rows * per_row <= available:
        return
    gib = f"{available / 2**30:.1f} GiB is available now"
    logits = (
        f"a step's logits take {per_row} bytes a row (fp32 over a {host_logits_vocab}-token "
        "vocabulary, and two copies the sampler makes)"
    )
    if rows < max_num_seqs and rows * per_row > available:
        raise EngineSettingError(
            "max_num_batched_tokens",
            max_num_batched_tokens,
            f"at most {available // per_row} here: on CPU {logits}, a row for each token of "
            f"the step's budget, and {gib} (lower max_num_batched_tokens)",
        )
    fit = available // (per_slot + per_row)  # rows == max_num_seqs
    if per_row and fit >= max_num_batched_tokens:  # the logits stop growing past its rows
        fit = (available - max_num_batched_tokens * per_row) // per_slot
    held = f"each request's batch slot keeps max_model_len ({max_model_len}) token ids in host "
    held += f"memory, {per_slot} bytes, " + (f"on CPU {logits}, " if per_row else "")
    also = ", or max_model_len" if per_slot >= per_row else ""
    raise EngineSettingError(
        "max_num_seqs",
        max_num_seqs,
        f"at most {fit} here: {held}and {gib} (lower max_num_seqs{also})",
    )
