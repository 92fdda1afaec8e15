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

The interval is process-wide, and both spans here set it through its one owner
(switch_interval.py): the shortest any open span asks for, and the one found before the
first put back when the last ends, however they nest or overlap across threads. An
interval someone set shorter already is left as it is.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from tokenmill.engine.switch_interval import SWITCH_INTERVAL

__all__ = ["BRIEF_TURN_S", "TURN_S", "brief_gil_turns", "short_gil_turns"]

TURN_S = 0.0005  # seconds a thread waits for the GIL before it asks the holder to drop it
# For a short wait whose end the engine's thread should not lose to another thread's turn
# (DeviceNgramProposer's wait for its matches): 20 us everywhere slowed plain async decoding
# 5-9% on an H100 (BENCHMARKS.md, session 46), so only such spans get it.
BRIEF_TURN_S = 0.00002


def short_gil_turns() -> AbstractContextManager[None]:
    """The switch interval at most TURN_S inside the block: an engine loop's (re-entrant,
    any thread)."""
    return SWITCH_INTERVAL.at_most(TURN_S)


def brief_gil_turns() -> AbstractContextManager[None]:
    """The switch interval at most BRIEF_TURN_S inside the block: a short wait's (a
    proposer's for the device), inside a loop's span or not."""
    return SWITCH_INTERVAL.at_most(BRIEF_TURN_S)
