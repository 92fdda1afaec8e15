"""Request: its tokens read the same attached to a batch slot and detached."""

from __future__ import annotations

from tokenmill.engine.core.batch_slots import BatchSlots
from tokenmill.engine.core.request import Request
from tokenmill.engine.sampling_params import SamplingParams


def test_token_ids_between_reads_the_same_attached_and_detached() -> None:
    req = Request("r", [5, 6, 7], SamplingParams(max_tokens=8))
    req.append_output_token(8)
    detached = [req.token_ids_between(a, b) for a, b in [(0, 4), (1, 3), (2, 9), (4, 4)]]
    slots = BatchSlots(capacity=2, max_model_len=16, block_size=4)
    slots.add(req)
    req.append_output_token(9)
    attached = [req.token_ids_between(a, b) for a, b in [(0, 4), (1, 3), (2, 9), (4, 4)]]
    assert detached == [[5, 6, 7, 8], [6, 7], [7, 8], []]
    assert attached == [[5, 6, 7, 8], [6, 7], [7, 8, 9], []]  # never past num_tokens
    assert all(type(t) is int for t in attached[2])
    slots.remove(req.slot)
    assert req.token_ids_between(0, 16) == req.all_token_ids == [5, 6, 7, 8, 9]
