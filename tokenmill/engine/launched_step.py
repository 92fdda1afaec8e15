"""LaunchedStep: a step whose kernels are enqueued and whose sampled tokens are on their way.

    launch(step n) ─► sampler ─► copy tokens (and logprobs) to pinned host memory ─► event
                        host: schedule and launch step n+1 ...
    output()  ─► wait for the event (the only host-device sync of a step) ─► ModelOutput

The copies start as soon as the sampler's kernels are enqueued, so by the time the host has
launched the next step, the previous step's tokens are usually already in host memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.engine.device_copy import download, record_event
from tokenmill.engine.model_output import ModelOutput
from tokenmill.engine.prompt_logprobs import PromptLogprobsTensors
from tokenmill.engine.sampler import LogprobsTensors, SamplerOutput


@dataclass
class LaunchedStep:
    rows: np.ndarray  # [S] the SchedulerOutput rows that sample, in logits-row order
    counts: np.ndarray  # [S] tokens each of them sampled (1 + its drafts)
    tokens: torch.Tensor | None  # [S] int64 on the host (filled once ``ready`` completes)
    logprobs: LogprobsTensors | None  # host copies, same condition
    ready: torch.cuda.Event | None  # None on CPU: already complete
    wait_ms: float = 0.0  # how long ``output`` blocked on the device
    # Requests' prompt logprobs scored by this step (prompt_logprobs.py), with their own
    # event: a step that prefills a chunk may sample nothing.
    prompt_logprobs: PromptLogprobsTensors | None = None
    accepted: int | None = None  # drafts its rows accepted, once the engine processed it

    @classmethod
    def empty(cls) -> LaunchedStep:
        return cls(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), None, None, None)

    @classmethod
    def start(cls, rows: np.ndarray, counts: np.ndarray, out: SamplerOutput) -> LaunchedStep:
        """Begin copying ``out`` to the host behind the work already enqueued."""
        lp = out.logprobs
        host_lp = None
        if lp is not None:
            host_lp = LogprobsTensors(
                sampled_token_ids=download(lp.sampled_token_ids),
                sampled_logprobs=download(lp.sampled_logprobs),
                sampled_ranks=download(lp.sampled_ranks),
                top_token_ids=download(lp.top_token_ids),
                top_logprobs=download(lp.top_logprobs),
            )
        tokens = download(out.sampled_token_ids)
        ready = None
        if out.sampled_token_ids.device.type == "cuda":
            ready = record_event(out.sampled_token_ids.device)
        return cls(rows, counts, tokens, host_lp, ready)

    def output(self) -> ModelOutput:
        """Wait for the copies and return the step's tokens (and logprobs) as host values."""
        if self.tokens is None:
            return ModelOutput(self.rows, self.counts, np.empty(0, dtype=np.int64), None)
        if self.ready is not None:
            t0 = time.perf_counter()
            self.ready.synchronize()
            self.wait_ms = (time.perf_counter() - t0) * 1e3
            self.ready = None
        return ModelOutput(
            self.rows,
            self.counts,
            self.tokens.numpy(),
            SamplerOutput(sampled_token_ids=self.tokens, logprobs=self.logprobs),
        )
