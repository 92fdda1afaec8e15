"""The lengths the rows left will take, from finished rows and rows still generating
(Kaplan-Meier), and the ETA they give while the short rows finish first."""

from __future__ import annotations

import numpy as np
import pytest

from tests.jobs.test_progress import FakeClock, FakeEngine
from tokenmill.jobs.progress import LiveCounts, Progress
from tokenmill.jobs.row_lengths import RowLengths


def test_rows_still_running_count_as_longer_than_they_ran() -> None:
    """4 rows ended at 10 tokens, 4 run on at 20, rows take at most 40: half the rows pass
    10 and none has ended since, so a row is 10 + 0.5 x 30 = 25 tokens on average, and one
    at 20 has all of its 20 to come."""
    lengths = RowLengths(horizon=40)
    assert lengths.tokens_left(3, [5]) is None  # nothing finished: no basis
    lengths.add(4, 40)
    assert lengths.tokens_left(2, [20] * 4) == pytest.approx(2 * 25 + 4 * 20)
    assert lengths.tokens_left(0, []) == 0


def test_without_a_horizon_a_row_past_every_finished_one_is_unknown() -> None:
    lengths = RowLengths()
    lengths.add(3, 31)  # 10, 10, 11 tokens (split to the token)
    assert lengths.tokens_left(1, []) == pytest.approx(31 / 3)
    assert lengths.tokens_left(0, [11]) == 0  # as long as the longest: taken to end now
    assert lengths.tokens_left(1, [12]) is None  # ran past the longest: nothing says more


@pytest.mark.parametrize("per_row", [True, False])
def test_the_eta_while_the_short_rows_finished_first(per_row: bool) -> None:
    """400 rows, half 10 tokens long and half 100; 200 start at once at 10 tokens a second.
    After 2 s the 100 short ones are done and the long ones are at 20 tokens: 100 x 80 more
    plus 200 rows of 55 tokens on average to come, 19,000 tokens. The finished rows' mean
    (10 tokens) said 10,000. The same whether the executor gives each row's tokens or only
    their sum."""
    clock, engine = FakeClock(), FakeEngine()
    progress = Progress(400, 0, live=engine, clock=clock, max_tokens=100, sample_s=0.5)
    clock.now += 1.0
    engine.counts = LiveCounts(2000, 200, row_tokens=(10,) * 200 if per_row else None)
    progress.tick()
    clock.now += 1.0
    row_tokens = (20,) * 100 if per_row else None
    engine.counts = LiveCounts(3000, 100, row_tokens=row_tokens)
    progress.update(100, 1000)
    assert progress.tokens_per_s == pytest.approx(1500)
    assert progress.eta_seconds == pytest.approx(19_000 / 1500)


def test_a_row_of_several_samples_counts_all_its_tokens() -> None:
    """A row asking for n = 3 completions is three engine requests: its tokens so far are
    its finished samples' and its running ones', as its length counts them when it ends."""
    from tokenmill.engine.outputs import RequestOutput
    from tokenmill.engine.sample_groups import SampleGroup
    from tokenmill.engine.sampling_params import SamplingParams
    from tokenmill.io.rows import InputRow
    from tokenmill.jobs.rows_in_flight import RowsInFlight

    rows = RowsInFlight()
    three = SampleGroup.of("a", SamplingParams(n=3, max_tokens=8, temperature=1.0))
    rows.add(InputRow(0, "a", "x", prompt="p"), three)
    rows.add(InputRow(1, "b", "x", prompt="p"), SampleGroup.of("b", SamplingParams()))
    assert rows.finish(RequestOutput("a.1", [1], "t", [5, 6, 7], "length")) is None
    unfinished = {"a": 2, "a.2": 4, "b": 6}  # the engine's, by request
    assert sorted(rows.row_tokens(unfinished)) == [6, 3 + 2 + 4]


def test_rows_finishing_after_a_sample_do_not_cut_the_eta() -> None:
    """The rows in flight are counted at a sample; rows finishing after it, at lengths past
    those counts, looked like the only rows to reach them (the others' counts were older),
    so every row seemed to end there: the ETA fell to a third. The ETA is worked out at
    the sample, from the rows finished and in flight at that moment."""
    clock, engine = FakeClock(), FakeEngine()
    progress = Progress(1000, 0, live=engine, clock=clock, max_tokens=100, sample_s=5.0)
    clock.now += 5.0
    engine.counts = LiveCounts(1000, 100, row_tokens=(10,) * 100)
    progress.update(1, 5)  # a sample: 1 row of 5 tokens, 100 at 10 tokens
    at_sample = progress.eta_seconds
    clock.now += 1.0  # no sample yet: rows end at 12-15 tokens meanwhile
    for length in (12, 13, 14, 15) * 5:
        progress.update(1, length)
    assert at_sample is not None and progress.eta_seconds == pytest.approx(at_sample)


def test_a_row_longer_than_the_jobs_max_tokens_moves_the_horizon() -> None:
    """Rows with their own max_tokens (OpenAI Batch bodies) finish past the job's: their
    lengths count (cut at the job's, 20 rows of 1,000 tokens read as 100: a tenth)."""
    lengths = RowLengths(horizon=100)
    lengths.add(20, 20_000)
    assert lengths.tokens_left(10, []) == pytest.approx(10_000)


def test_long_rows_are_counted_in_bins_and_stay_cheap() -> None:
    """32k-token rows of 8 completions: counted token by token an estimate took 8 ms, on
    the engine's thread at every sample; in bins it stays about as exact."""
    import time

    rng = np.random.default_rng(0)
    lengths, exact = RowLengths(horizon=262_144), []
    for length in rng.integers(1, 250_000, 5000).tolist():
        lengths.add(1, length)
        exact.append(length)
    assert lengths.width > 1
    running = rng.integers(0, 1000, 500).tolist()
    took = []  # the best of 5: what it costs, not what a loaded machine's scheduler adds
    for _ in range(5):
        start = time.perf_counter()
        left = lengths.tokens_left(100, running)
        took.append(time.perf_counter() - start)
    assert min(took) < 0.005, took
    running_left = 500 * (np.mean(exact) - 500)  # (rows at < 1,000 tokens: about the mean)
    assert left == pytest.approx(100 * np.mean(exact) + running_left, rel=0.02)


def test_rows_finishing_are_not_rows_to_come() -> None:
    """At a step's sample the rows it finished are out of flight and not yet handed on (so
    not done): counted as rows not started, the last step of a run said two rows of 50
    tokens were still to come, 50 s at 2 tok/s, where none were."""
    clock, engine = FakeClock(), FakeEngine()
    progress = Progress(4, 0, live=engine, clock=clock, max_tokens=100, sample_s=1.0)
    clock.now += 1.0
    engine.counts = LiveCounts(200, 2, row_tokens=(50, 50))
    progress.update(2, 100)  # two rows of 50 tokens ended (and a sample)
    clock.now += 50.0
    engine.counts = LiveCounts(300, 0, row_tokens=(), rows_finishing=2)
    progress.tick()
    assert progress.tokens_per_s == pytest.approx(2.0)
    assert progress.eta_seconds == pytest.approx(0.5)  # (at least one token: 1 / 2 tok/s)
