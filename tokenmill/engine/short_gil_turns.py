"""short_gil_turns(): while an engine loop runs, a thread that wants the GIL waits 0.5 ms for
it, not CPython's default 5 ms.

An engine loop shares its process with other Python threads: with async scheduling the
output builder (decoding finished requests' text), and in a local job also the reader (JSON
parsing, chat templating, the Python half of tokenizing) and the writer (Parquet encoding).
The engine loop gives the GIL up many times a step (each CUDA or Triton call that releases
it, each event wait, each read from a grammar worker's pipe); whenever another thread is
runnable it takes the GIL then, and keeps it until it blocks or until the engine thread has
waited the switch interval and asked for it back. At the default 5 ms, a decode step of a
135M model (2.5 ms of host work) can lose a whole step's time per handover. Measured on an
H200 with the embedded SmolLM2 on 20,000 chat rows (session 19): the engine's host ms per
decode step was 2.79 in `run-job` against 2.47 in `LLM.chat`; at 0.5 ms it was 2.53, and the
run 7% shorter. Shorter turns cost nothing measurable on a 2-core CPU run. ``LLM`` runs its
loop with short turns too (structured output, whose steps wait on worker pipes, gave up the
GIL most: BENCHMARKS.md, session 22).

The interval is process-wide: it is set when the first loop starts and put back as it was
when the last one ends (loops in several threads count together: while_running.py), as
``frozen_heap`` does for the garbage collector. An interval someone set shorter already is
left as it is.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from tokenmill.engine.while_running import WhileRunning

__all__ = ["BRIEF_TURN_S", "TURN_S", "brief_gil_turns", "short_gil_turns"]

TURN_S = 0.0005  # seconds a thread waits for the GIL before it asks the holder to drop it
# For a short wait whose end the engine's thread should not lose to another thread's turn
# (DeviceNgramProposer's wait for its matches): 20 us everywhere slowed plain async decoding
# 5-9% on an H100 (BENCHMARKS.md, session 46), so only such spans get it.
BRIEF_TURN_S = 0.00002


def _shorten() -> float | None:
    """Set the interval to TURN_S unless it is that short already; the interval before."""
    before = sys.getswitchinterval()
    if before <= TURN_S:
        return None
    sys.setswitchinterval(TURN_S)
    return before


def _restore(before: float | None) -> None:
    if before is not None:
        sys.setswitchinterval(before)


# Set the GIL switch interval to at most TURN_S for the duration (re-entrant, any thread).
short_gil_turns = WhileRunning(_shorten, _restore)


@contextlib.contextmanager
def brief_gil_turns() -> Iterator[None]:
    """The switch interval at most BRIEF_TURN_S inside the block (this thread's span; it is
    process-wide, and put back as it was at the block's end)."""
    before = sys.getswitchinterval()
    if before > BRIEF_TURN_S:
        sys.setswitchinterval(BRIEF_TURN_S)
    try:
        yield
    finally:
        sys.setswitchinterval(before)
