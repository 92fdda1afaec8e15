"""frozen_heap(): while an engine runs, the garbage collector leaves alone what existed before.

A loaded engine sits in a process holding some 650,000 objects the collector tracks (torch,
transformers, the model's modules), none of them garbage. CPython runs a full collection,
which walks every one of them, whenever enough new objects have survived: a running batch
makes such objects (requests, token lists, outputs), so full collections come every few
thousand requests and each stalls the engine: ~250 ms on a 2-core box, measured between two
steps of a 1,024-row batch whose steps take 10 ms (and, on a GPU, whose device then idles).

``gc.freeze()`` moves every tracked object into a permanent generation the collector skips;
objects made afterwards are collected as before. ``frozen_heap`` freezes while an engine
loop runs and unfreezes when the last one ends (while_running.py), so cyclic garbage among
the frozen objects (say, an engine dropped mid-run) is only deferred: collected after the
run, as usual.

It freezes even when something froze the heap before (gc cannot tell freezes apart, and
"someone else's freeze" is no sign that the heap is frozen now): on the H200 machine 375
objects were frozen before any run, by something at start-up, and while the engine left
its heap of ~950,000 objects to the collector because of them, one full collection stalled
each timed run of bench/structured_output.py by 400-560 ms (10-15% of a 3.7-5 s run). The
unfreeze at the end undoes such an earlier freeze too: its objects are then collected as
usual again, which costs only the collector's time.
"""

from __future__ import annotations

import gc

from tokenmill.engine.while_running import WhileRunning

__all__ = ["frozen_heap"]


def _freeze() -> None:
    gc.freeze()


def _unfreeze(_: None) -> None:
    gc.unfreeze()


# Freeze the collector's heap for the duration (re-entrant, any thread).
frozen_heap = WhileRunning(_freeze, _unfreeze)
