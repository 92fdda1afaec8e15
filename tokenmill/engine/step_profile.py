"""Per-step timing: where a step's time goes (host preparation vs device compute).

For each step: CPU milliseconds from the start of input preparation until the step's kernels
are all enqueued (scheduling and output processing are timed by the engine and added), the
milliseconds the host then sat waiting for a step's tokens, and GPU milliseconds between CUDA
events around the step's kernels. Events are read only in ``summary`` (one sync), never
inside a step. With async scheduling a step's wait and processing belong to the previous
step's tokens; per step on average it is the same host work.

When the host keeps ahead of the device, ``wait_ms`` is about ``gpu_ms - cpu_ms``: the CPU
work is hidden. When ``wait_ms`` is near 0 the device waits for the host instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tokenmill.engine.device_copy import current_stream
from tokenmill.engine.host_batch import HostBatch


@dataclass
class StepRecord:
    num_reqs: int
    num_tokens: int
    graph: bool  # replayed in CUDA graphs: a decode graph, or the pieces around attention
    decode: bool  # every row decodes (one token, or with drafts: a chain or a tree)
    context_tokens: int = 0  # sum of the batch's sequence lengths (KV the step reads)
    cpu_ms: float = 0.0
    wait_ms: float = 0.0
    events: tuple | None = None
    gpu_ms: float | None = None


@dataclass
class StepProfiler:
    device: torch.device
    enabled: bool = False
    records: list[StepRecord] = field(default_factory=list)
    _start: float = 0.0

    def begin(self, t0: float, batch: HostBatch, graph: bool) -> None:
        if not self.enabled:
            return
        self._start = t0
        events = None
        if self.device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record(current_stream(self.device))
        self.records.append(
            StepRecord(
                batch.num_reqs,
                batch.num_tokens,
                graph,
                batch.decode_step,
                context_tokens=int(batch.seq_lens.sum()),
                events=events,
            )
        )

    def end(self) -> None:
        if not self.enabled or not self.records:
            return
        rec = self.records[-1]
        rec.cpu_ms = (time.perf_counter() - self._start) * 1e3
        if rec.events is not None:
            rec.events[1].record(current_stream(self.device))

    def add_host_ms(self, ms: float) -> None:
        """Scheduling and output processing of the last step, timed by the engine."""
        if self.enabled and self.records:
            self.records[-1].cpu_ms += ms

    def add_wait_ms(self, ms: float) -> None:
        """Time the host blocked on the device for a step's tokens."""
        if self.enabled and self.records:
            self.records[-1].wait_ms += ms

    def summary(self) -> dict:
        """Mean CPU and GPU ms per step, split into decode (graph or eager) and other steps."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        for rec in self.records:
            if rec.events is not None and rec.gpu_ms is None:
                rec.gpu_ms = rec.events[0].elapsed_time(rec.events[1])
        out: dict = {}
        for name, keep in (
            ("decode", lambda r: r.decode),
            ("prefill_or_mixed", lambda r: not r.decode),
        ):
            rows = [r for r in self.records if keep(r)]
            if not rows:
                continue
            gpu = [r.gpu_ms for r in rows if r.gpu_ms is not None]
            out[name] = {
                "steps": len(rows),
                "graph_steps": sum(r.graph for r in rows),
                "mean_batch": round(sum(r.num_reqs for r in rows) / len(rows), 1),
                "mean_tokens": round(sum(r.num_tokens for r in rows) / len(rows), 1),
                "cpu_ms": round(sum(r.cpu_ms for r in rows) / len(rows), 3),
                "wait_ms": round(sum(r.wait_ms for r in rows) / len(rows), 3),
                "gpu_ms": round(sum(gpu) / len(gpu), 3) if gpu else None,
                "gpu_ms_median_max": _median_max(gpu),
            }
        return out


def _median_max(values: list[float]) -> tuple[float, float] | None:
    """Median and maximum: a max far above the median points at one-off costs (a compile)."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[len(ordered) // 2], 3), round(ordered[-1], 3)
