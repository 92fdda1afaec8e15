"""Whether ``max_num_seqs`` batch slots fit the host, checked before the weights load.

Each slot keeps its request's token ids, ``max_model_len`` of them as int32, in host memory
(core/batch_slots.py), all allocated when the engine starts. ``max_num_seqs=10**12`` passed
the settings check, loaded the weights, then failed in numpy ("Unable to allocate 931. TiB"),
or in a job blamed ``kv_cache_memory`` for the activations it sizes; it is refused here,
named, while nothing has loaded.
"""

from __future__ import annotations

from tokenmill.engine.engine_config import EngineSettingError, host_memory

__all__ = ["check_slots_fit"]

_TOKEN_ID_BYTES = 4  # int32


def check_slots_fit(max_num_seqs: int, max_model_len: int) -> None:
    """Raises EngineSettingError naming ``max_num_seqs`` when its slots' token ids, at
    ``max_model_len`` tokens each, need more than the host's available memory."""
    per_slot = max_model_len * _TOKEN_ID_BYTES
    _, available = host_memory()
    if max_num_seqs * per_slot <= available:
        return
    raise EngineSettingError(
        "max_num_seqs",
        max_num_seqs,
        f"at most {available // per_slot} here: each request's batch slot keeps "
        f"max_model_len ({max_model_len}) token ids in host memory, "
        f"{per_slot} bytes, and {available / 2**30:.1f} GiB is available now "
        "(lower max_num_seqs, or max_model_len)",
    )
