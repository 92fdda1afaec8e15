"""How the kernel benchmarks time GPU work: warm clocks, a clean cold L2, CUDA events, median.

- ``warm_up_gpu``: an idle H200 sits at a low SM clock (360 MHz seen) and takes a while under
  load to reach its boost clock, so the first rows a fresh process timed came out slow. Every
  benchmark calls it once before its first timing.
- ``time_ms``: before every timed call, 256 MiB are *read* (a sum), which evicts everything
  from L2 and leaves no dirty line in it. ``triton.testing.do_bench`` instead clears L2 by
  zeroing a buffer, leaving up to L2's size of dirty lines that the timed kernel then pays to
  write back. For an 84 MB RoPE call that was a quarter of its time: on the H200, RoPE at
  T=4096 read 76.4% of 4.25 TB/s with the zeroing flush and 85.0% with the read flush, a
  same-size copy 79.0% and 90.4% (session 4, BENCHMARKS.md). At 336 MB both flushes agree
  within 3 points.
- ``time_ms(fn, graph=True)``: ``fn`` is captured once into a CUDA graph and the replays are
  timed, so no host launch work (Python, a split-K GEMM's second kernel) can sit inside the
  timed span; it is what the engine's decode steps, which replay CUDA graphs, pay. On the
  H200 (session 14) the small-M GEMMs read within 5% of their eager times this way: the
  256 MiB flush before each call keeps the GPU busy while Python launches.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

_WARM_UP_SIDE = 4096  # a bf16 matmul of ~0.2 ms on an H200: keeps every SM busy
_FLUSH_INT32S = (256 << 20) // 4  # 256 MiB, five times an H200's L2


def warm_up_gpu(seconds: float = 1.0) -> None:
    """Run bf16 matmuls back to back for ``seconds`` of wall time (synchronised)."""
    a = torch.randn(_WARM_UP_SIDE, _WARM_UP_SIDE, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(_WARM_UP_SIDE, _WARM_UP_SIDE, device="cuda", dtype=torch.bfloat16)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for _ in range(20):
            a @ b
        torch.cuda.synchronize()


@functools.cache
def _flush_buffer() -> torch.Tensor:
    return torch.ones(_FLUSH_INT32S, dtype=torch.int32, device="cuda")


def flush_l2() -> None:
    """Read 256 MiB: evicts everything from L2 and leaves no dirty line behind."""
    _flush_buffer().sum(dtype=torch.int64)


def graphed(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` captured into a CUDA graph (after eager calls that compile and warm it): the
    returned callable replays the graph, one launch whatever ``fn`` launches."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def time_ms(
    fn: Callable[[], Any],
    warmup_ms: float = 25,
    rep_ms: float = 100,
    before: Callable[[], Any] | None = flush_l2,
    graph: bool = False,
) -> float:
    """Median milliseconds of ``fn()`` over about ``rep_ms`` of calls (after ``warmup_ms``),
    each timed alone with CUDA events after an untimed ``before()`` (by default ``flush_l2``:
    each call starts on a clean, cold L2; ``bench/l2_flush_effect.py`` swaps it). With
    ``graph``, ``fn`` is captured into a CUDA graph and its replays are timed (see above)."""
    fn()
    torch.cuda.synchronize()
    if graph:
        fn = graphed(fn)
        fn()
        torch.cuda.synchronize()
    probe = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    probe[0].record()
    for _ in range(5):
        fn()
    probe[1].record()
    torch.cuda.synchronize()
    per_call = max(probe[0].elapsed_time(probe[1]) / 5, 1e-3)
    for _ in range(max(1, round(warmup_ms / per_call))):
        fn()
    reps = max(5, round(rep_ms / per_call))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends, strict=True):
        if before is not None:
            before()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
