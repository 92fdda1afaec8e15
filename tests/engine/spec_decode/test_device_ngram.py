"""DeviceNgramProposer: NgramProposer's matches from a search of a device copy of the rows
(here the PyTorch reference on CPU; the Triton kernel equals it in tests/kernels), kept up
to date as rows grow, shrink and change hands; and the engine's output with it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.engine.spec_decode.test_ngram import _put
from tests.engine.spec_decode.test_speculative import _run_120, model_path, off_run  # noqa: F401
from tokenmill.engine import spec_decode
from tokenmill.engine.core.batch_slots import BatchSlots
from tokenmill.engine.spec_decode import device_ngram
from tokenmill.engine.spec_decode.device_ngram import DeviceNgramProposer
from tokenmill.engine.spec_decode.ngram import NgramProposer


@pytest.mark.parametrize("vocab", [3, 20])
def test_matches_the_host_index_as_rows_grow_shrink_and_change_hands(
    vocab: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every call's (start, length) and drafts equal the host proposer's (a wide index: no
    hash collision at these sizes), calls asking for any subset of the slots; the device
    copy widens as rows grow (from 8 tokens here)."""
    monkeypatch.setattr(device_ngram, "MIN_WIDTH", 8)
    rng = np.random.default_rng(vocab)
    capacity, k = 8, 4
    host = NgramProposer(k, min_n=1, max_n=4, table_bits=20)
    device = DeviceNgramProposer(k, min_n=1, max_n=4, device="cpu")
    slots = BatchSlots(capacity, 512, 16)
    rows = [rng.integers(0, vocab, rng.integers(1, 40)).tolist() for _ in range(capacity)]
    for slot, tokens in enumerate(rows):
        _put(slots, slot, tokens, owner=object())
    for call in range(40):
        asked = np.array(sorted(rng.choice(capacity, rng.integers(1, capacity + 1), False)))
        want = host.match(slots, asked)
        got = device.match(slots, asked)
        assert [g.tolist() for g in got] == [w.tolist() for w in want]
        assert device.propose(slots, asked).tolist() == host.propose(slots, asked).tolist()
        for slot in asked.tolist():
            if call % 9 == 4:  # another request takes the slot
                rows[slot] = rng.integers(0, vocab, rng.integers(1, 30)).tolist()
                _put(slots, slot, rows[slot], owner=object())
                host._owner[slot] = None  # (the host index keys on the owner too)
            elif call % 7 == 3 and len(rows[slot]) > 3:  # the same request, cut back
                rows[slot] = rows[slot][:-2] + rng.integers(0, vocab, 1).tolist()
                _put(slots, slot, rows[slot])
                host._owner[slot] = None  # (the host index cannot forget: start it over)
            else:
                rows[slot] += rng.integers(0, vocab, rng.integers(1, 4)).tolist()
                _put(slots, slot, rows[slot])
    longest = max(len(r) for r in rows)
    assert 8 < device._tokens.shape[1] < 2 * longest  # widened as far as the rows needed


def test_no_rows_ask_for_nothing() -> None:
    device = DeviceNgramProposer(3, device="cpu")
    start, length = device.match(BatchSlots(2, 16, 4), np.zeros(0, dtype=np.int64))
    assert start.shape == length.shape == (0,)


@pytest.fixture()
def device_matcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine builds the device class as its n-gram matcher (here on CPU)."""

    def build(config):
        return DeviceNgramProposer(config.max_tokens, config.ngram_min, config.ngram_max, "cpu")

    monkeypatch.setattr(spec_decode, "_ngram_proposer", build)


@pytest.mark.parametrize(
    ("method", "ahead_below"), [("ngram", None), ("suffix", None), ("ngram", 99)]
)
def test_greedy_output_equals_off_with_the_device_matcher(
    model_path: Path,  # noqa: F811
    off_run,  # noqa: F811
    device_matcher: None,
    method: str,
    ahead_below: int | None,
) -> None:
    want, off = off_run
    settings = {"async_scheduling": True} if ahead_below else {}
    got, profile = _run_120(model_path, method, ahead_below, **settings)
    assert got == want
    stats = profile["speculative"]
    assert stats["accepted_tokens"] > 0 and profile["steps"] < off["steps"], stats
