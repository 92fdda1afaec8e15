"""frozen_heap: the collector skips what existed before a run, and only during it."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from tests.tiny_models import save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine.frozen_heap import frozen_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_objects_from_before_are_skipped_then_collected_after() -> None:
    old = _Node()
    gone = weakref.ref(old)
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        del old
        gc.collect()
        assert gone() is not None  # frozen: a full collection does not look at it
        fresh = _Node()
        fresh_gone = weakref.ref(fresh)
        del fresh
        gc.collect()
        assert fresh_gone() is None  # made during the run: collected as usual
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gone() is None  # deferred, not leaked


def test_nested_runs_unfreeze_once_the_last_ends() -> None:
    # (nesting and threads in general: test_while_running.py)
    with frozen_heap():
        with frozen_heap():
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_a_freeze_made_before_does_not_keep_the_run_unfrozen() -> None:
    # Something froze a few objects at start-up (the H200 machine had 375 frozen): the
    # objects made since must still be frozen for the run, then everything unfrozen.
    gc.freeze()
    old = _Node()
    gone = weakref.ref(old)
    try:
        with frozen_heap():
            del old
            gc.collect()
            assert gone() is not None  # frozen with the rest: not looked at during the run
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()


def test_generate_runs_frozen_and_leaves_the_heap_as_it_was(tmp_path: Path) -> None:
    model = save_tiny_model("llama", tmp_path / "llama", max_position_embeddings=256)
    llm = LLM(str(model), device="cpu", max_num_seqs=4, kv_cache_memory=16 << 20)
    counts: list[int] = []
    step = llm.engine.step

    def counting_step():  # type: ignore[no-untyped-def]
        counts.append(gc.get_freeze_count())
        return step()

    llm.engine.step = counting_step  # type: ignore[method-assign]
    out = llm.generate(["hello there"], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 3
    assert counts and all(c > 0 for c in counts)
    assert gc.get_freeze_count() == 0


def test_a_child_forked_inside_a_loop_starts_with_none_running() -> None:
    """An audit: a child forked while an engine loop ran (a thread of the parent's) counted
    that loop as its own: the frozen heap stayed frozen in it, and its own loops never undid
    the change. Its copy is undone at the fork; its own loops apply and undo as usual."""
    import os
    import sys

    from tokenmill.engine.short_gil_turns import TURN_S, short_gil_turns

    before = sys.getswitchinterval()
    read, write = os.pipe()
    with frozen_heap(), short_gil_turns():
        assert gc.get_freeze_count() > 0 and sys.getswitchinterval() == TURN_S
        pid = os.fork()
        if pid == 0:
            try:
                undone = gc.get_freeze_count() == 0 and sys.getswitchinterval() == before
                with frozen_heap():
                    applied = gc.get_freeze_count() > 0
                os.write(write, b"%d%d%d" % (undone, applied, gc.get_freeze_count() == 0))
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
    assert os.read(read, 8) == b"111"
    assert gc.get_freeze_count() == 0 and sys.getswitchinterval() == before


def test_brief_gil_turns_last_the_block_and_nest_inside_short_ones() -> None:
    """brief_gil_turns (a proposer's wait for the device): 20 us turns inside the block, the
    interval it found put back after it, an exception included."""
    import sys

    from tokenmill.engine.short_gil_turns import (
        BRIEF_TURN_S,
        TURN_S,
        brief_gil_turns,
        short_gil_turns,
    )

    before = sys.getswitchinterval()
    with short_gil_turns():
        with brief_gil_turns():
            assert sys.getswitchinterval() == pytest.approx(BRIEF_TURN_S)
        assert sys.getswitchinterval() == TURN_S
        try:
            with brief_gil_turns():
                raise KeyError("x")
        except KeyError:
            pass
        assert sys.getswitchinterval() == TURN_S
    assert sys.getswitchinterval() == before
