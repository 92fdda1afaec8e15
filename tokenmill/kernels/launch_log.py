"""LaunchLog: a layer's attention launches, recorded once and launched again for the next
layers with only their KV cache swapped.

A mixed step's attention runs eagerly between the piecewise graphs (piecewise_graphs.py),
once a layer, with the same queries (the graphs' static buffers), the same step metadata
and the same grids: only the layer's KV cache differs. Each Triton launch through
``kernel[grid](...)`` binds and specializes its ~30 arguments in Python and the wrapper
checks shapes first: on an H100 host 42-66 us a launch, 5.5 of a mixed step's 9.8 ms of
host time at 256 rows of SmolLM2 (30 layers x store, decode and prefill kernels;
BENCHMARKS session 43). So the first layer's launches are recorded (the compiled kernel,
its grid, its arguments in the kernel's order) and every later layer launches the same
compiled kernels directly, each argument that pointed into the first layer's cache
pointing at the same place in its own:

    layer 0:   store_kv(k, v, K0, V0, slots)   decode(q, K0, V0, ...)   prefill(q, K0, ...)
                   | recorded: kernel, grid, (k, v, K0, V0, slots, ...)
    layer l:   the same kernels and grids, K0 -> Kl, V0 -> Vl (same offsets, shapes, strides)

A swapped tensor has the first one's dtype, shape and strides, and its address the same
16-byte alignment (what Triton specializes on), so the compiled kernel is the one Triton
itself would pick. Under the Triton interpreter (no compiled kernels) nothing is replayable
and the caller launches every layer itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LaunchLog", "launch"]

_ACTIVE: ContextVar[LaunchLog | None] = ContextVar("tokenmill_launch_log", default=None)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``, recorded in the active LaunchLog if there is one."""
    compiled = kernel[grid](*args, **kwargs)
    log = _ACTIVE.get()
    if log is not None:
        log.add(kernel, compiled, grid, args, kwargs)


@dataclass(frozen=True)
class _Launch:
    compiled: Any  # triton's CompiledKernel
    grid: tuple[int, ...]
    args: list[Any]  # every parameter of the kernel, in order, defaults applied


@dataclass(frozen=True)
class _Swap:
    launch: int  # which launch
    arg: int  # which of its arguments
    offset: int  # bytes from the first layer's cache to the argument's first element
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    aligned: bool  # its address a multiple of 16 bytes (Triton specializes on it)


class LaunchLog:
    """Launches recorded while ``recording()`` was active; ``replay`` launches them again
    over another cache. ``replayable`` is False where a launch gave no compiled kernel (the
    Triton interpreter)."""

    def __init__(self) -> None:
        self.launches: list[_Launch] = []
        self.replayable = True
        self._swaps: list[_Swap] | None = None
        self._base: torch.Tensor | None = None

    @classmethod
    @contextmanager
    def recording(cls) -> Iterator[LaunchLog]:
        log = cls()
        token = _ACTIVE.set(log)
        try:
            yield log
        finally:
            _ACTIVE.reset(token)

    def add(self, kernel: Any, compiled: Any, grid: tuple[int, ...], args: tuple, kwargs: dict):
        if compiled is None or not hasattr(kernel, "signature"):
            self.replayable = False
            return
        names = kernel.signature.parameters
        bound = kernel.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in names})
        bound.apply_defaults()
        grid = tuple(grid) + (1,) * (3 - len(grid))  # a compiled kernel takes all three
        self.launches.append(_Launch(compiled, grid, list(bound.arguments.values())))

    def swaps(self, base: torch.Tensor) -> None:
        """Name the tensor the recorded launches read as their layer's cache: every tensor
        argument inside its memory is swapped by ``replay``."""
        start, end = base.data_ptr(), base.data_ptr() + base.numel() * base.element_size()
        swaps = []
        for i, recorded in enumerate(self.launches):
            for j, arg in enumerate(recorded.args):
                if isinstance(arg, torch.Tensor) and start <= arg.data_ptr() < end:
                    if arg.dtype != base.dtype:
                        raise ValueError(
                            f"LaunchLog: argument {j} of launch {i} is a {arg.dtype} view of "
                            f"a {base.dtype} cache; it cannot be swapped"
                        )
                    offset, aligned = arg.data_ptr() - start, arg.data_ptr() % 16 == 0
                    swaps.append(
                        _Swap(i, j, offset, tuple(arg.shape), tuple(arg.stride()), aligned)
                    )
        self._swaps, self._base = swaps, base

    def replay(self, cache: torch.Tensor, views: dict[tuple, torch.Tensor]) -> None:
        """Launch the recorded kernels again on the current stream, the arguments inside
        the base cache (``swaps``) moved to the same places in ``cache``, which has its
        dtype, shape and strides. ``views``: a cache of those places (kept by the caller for
        as long as its caches live), so a view is made once per layer and argument."""
        base = self._base
        if self._swaps is None or base is None or not self.replayable:
            raise RuntimeError("LaunchLog.replay: nothing replayable was recorded and named")
        if (
            cache.dtype != base.dtype
            or cache.shape != base.shape
            or cache.stride() != base.stride()
        ):
            raise ValueError(
                f"LaunchLog.replay: cache {cache.dtype} {tuple(cache.shape)} {cache.stride()} "
                f"is not laid out as the recorded {base.dtype} {tuple(base.shape)} {base.stride()}"
            )
        args = [list(recorded.args) for recorded in self.launches]
        for s in self._swaps:
            args[s.launch][s.arg] = _view(cache, s, views)
        stream = torch.cuda.current_stream(cache.device).cuda_stream
        for recorded, launch_args in zip(self.launches, args, strict=True):
            recorded.compiled[recorded.grid](*launch_args, stream=stream)


def _view(cache: torch.Tensor, swap: _Swap, views: dict[tuple, torch.Tensor]) -> torch.Tensor:
    key = (cache.data_ptr(), swap.offset, swap.shape, swap.stride)
    view = views.get(key)
    if view is None:
        itemsize = cache.element_size()
        if swap.offset % itemsize or ((cache.data_ptr() + swap.offset) % 16 == 0) != swap.aligned:
            raise ValueError(
                f"LaunchLog: the argument at byte {swap.offset} of another cache is not aligned "
                "to 16 bytes as the recorded one was (its kernel would specialize otherwise)"
            )
        view = cache.as_strided(
            swap.shape, swap.stride, cache.storage_offset() + swap.offset // itemsize
        )
        views[key] = view
    return view
