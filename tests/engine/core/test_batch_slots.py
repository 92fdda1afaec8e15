"""BatchSlots.add_many: every request's state in its slot, as one ``add`` at a time wrote it."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill.engine.core.batch_slots import BatchSlots
from tokenmill.engine.core.request import Request
from tokenmill.engine.sampling_columns import SamplingColumns
from tokenmill.engine.sampling_params import SamplingParams


def _requests() -> list[Request]:
    shared = SamplingParams(max_tokens=7, temperature=0.0)  # one object for several rows
    biased = SamplingParams(max_tokens=5, temperature=0.8, logit_bias={3: 1.5, 9: -2.0})
    stops = SamplingParams(max_tokens=9, min_tokens=2, stop_token_ids=[4, 5, 6], seed=11)
    params = [shared, biased, shared, stops, biased, SamplingParams(ignore_eos=True), shared]
    eos = [(2,), (), (2, 3), (2,), (1, 2, 3, 4), (), (2,)]
    reqs = []
    for i, (p, e) in enumerate(zip(params, eos, strict=True)):
        req = Request(f"r{i}", list(range(10 + i, 13 + 3 * i)), p, eos_token_ids=e)
        if i == 3:
            req.append_output_token(99)  # a preempted request comes back with its output
            req.num_computed_tokens = 0
        reqs.append(req)
    return reqs


def test_add_many_writes_each_request_as_it_is() -> None:
    reqs = _requests()
    slots = BatchSlots(capacity=8, max_model_len=64, block_size=4)
    slots.add(Request("first", [1, 2], SamplingParams()))  # slot 0 taken, another in between
    rows = slots.add_many(reqs)
    assert rows.tolist() == [1, 2, 3, 4, 5, 6, 7]
    # the columns as set_row writes them, one row at a time (after the first request's row)
    want = SamplingColumns.of([SamplingParams()] + [r.sampling_params for r in reqs])
    for i, (row, req) in enumerate(zip(rows.tolist(), reqs, strict=True)):
        n = len(req.all_token_ids)
        assert req.slot == row and slots.requests[row] is req
        assert slots.token_ids[row, :n].tolist() == req.all_token_ids
        assert slots.num_tokens[row] == n and slots.num_prompt[row] == req.num_prompt_tokens
        p = req.sampling_params
        assert (slots.max_tokens[row], slots.min_tokens[row]) == (p.max_tokens, p.min_tokens)
        assert slots.ignore_eos[row] == p.ignore_eos
        eos = slots.eos_ids[row]
        assert (
            tuple(eos[eos >= 0]) == req.eos_token_ids
            and (eos[len(req.eos_token_ids) :] == -1).all()
        )
        stop = slots.stop_ids[row]
        assert tuple(stop[stop >= 0]) == tuple(p.stop_token_ids or ())
        for name, column in slots.sampling.columns.items():
            if name == "logit_bias":
                got, exp = column[row], want.columns[name][i + 1]
                assert (got is None) == (exp is None)
                if exp is not None:  # its own (ids, biases), not spread over rows
                    assert all(np.array_equal(a, b) for a, b in zip(got, exp, strict=True))
            else:
                assert column[row] == want.columns[name][i + 1], name
        assert slots.sampling.setting_ids[row] == want.setting_ids[i + 1]
    assert slots.stop_ids.shape[1] == 3 and slots.eos_ids.shape[1] == 4  # widened


def test_add_many_takes_no_slot_when_it_refuses() -> None:
    slots = BatchSlots(capacity=3, max_model_len=8, block_size=4)
    long = Request("long", list(range(9)), SamplingParams())
    with pytest.raises(ValueError, match="long: 9 tokens exceed max_model_len 8"):
        slots.add_many([Request("ok", [1], SamplingParams()), long])
    with pytest.raises(RuntimeError, match="4 requests for 3 free"):
        slots.add_many([Request(f"r{i}", [1], SamplingParams()) for i in range(4)])
    assert slots.num_free == 3
