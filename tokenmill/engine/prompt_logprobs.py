"""Prompt logprobs: each prompt token's logprob under the model, and the top-k alternatives.

vLLM's ``SamplingParams(prompt_logprobs=k)`` gives ``RequestOutput.prompt_logprobs``: None for
the first prompt token (nothing predicts it), then for each later token a mapping token id ->
``Logprob`` holding that token and the k most likely ones at its position. The logits that
score token p + 1 are the ones computed while prefilling token p:

    prompt    t0   t1   t2   t3   t4          (L = 5 tokens)
    logits    l0   l1   l2   l3  [l4]         l4 samples the first output token
    entries  None  e1   e2   e3   e4          e(p+1) = log_softmax(l_p)[t(p+1)], top-k of it

The engine normally computes logits only at the rows it samples. For a request that asks,
the step that prefills a chunk [s, s + q) of its prompt also projects the hidden states of
positions s .. min(s + q, L - 1) - 1 through the LM head (in slices, so that a long chunk
never holds [q, V] fp32 logits at once), and hands back the target token's logprob and rank
and the top-k ids and logprobs: [P] and [P, k] tensors, copied to the host behind the step.

    LLMEngine.add_request ─► PromptLogprobs.add
    ModelRunner.launch   ─► plan(sched, batch): rows of the step's hidden states, targets
                         ─► compute_prompt_logprobs (eager forward only: a step with such a
                             row never replays a CUDA graph, whose hidden states are only
                             the sampled rows')
    LLMEngine._process   ─► record: entries appended in prompt order (before finishing)
    finished             ─► pop: the list for RequestOutput.prompt_logprobs

- **Chunked prefill.** Each chunk plans the positions it computes; the positions of all
  chunks together are 0 .. L - 2, each exactly once (``num_planned`` counts them).
- **Prefix caching.** A position served from the prefix cache has no hidden state, so a
  request with ``prompt_logprobs`` takes no prefix-cache hits (the scheduler skips its
  lookup, as vLLM does); it still offers its own blocks to later requests. Recomputing a
  cached prefix just for its logits would cost the same forward pass, in a second place.
- **Preemption.** A preempted request recomputes its prompt; positions planned before are
  not planned again, so each entry is computed once.

Requests without ``prompt_logprobs`` cost nothing here: the engine calls ``plan`` only while
some request still has positions to plan.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.engine.device_copy import download, record_event, upload
from tokenmill.engine.outputs import TokenLogprob

if TYPE_CHECKING:
    from tokenmill.engine.core.request import Request
    from tokenmill.engine.core.scheduler_output import SchedulerOutput
    from tokenmill.engine.host_batch import HostBatch

__all__ = [
    "PromptLogitsPlan",
    "PromptLogprobs",
    "PromptLogprobsTensors",
    "compute_prompt_logprobs",
]

# fp32 logits held at once while scoring prompt positions: 16M values (64 MiB), so a
# 128k-vocabulary model scores 128 positions per slice.
_SLICE_VALUES = 1 << 24


@dataclass(frozen=True)
class PromptLogitsPlan:
    """The prompt positions one step scores, flattened over the requests that asked.

    ``token_rows[i]`` is the row of the step's hidden states [T, H] at a prompt position
    whose logits score ``target_ids[i]`` (the next prompt token). ``segments`` cut the P
    rows into runs of consecutive positions: (request, first position, count). The request
    itself, not its id: one aborted while its step is in flight may have its id given to a
    new request before the step's results are recorded.
    """

    token_rows: np.ndarray  # [P] int64
    target_ids: np.ndarray  # [P] int64
    num_top: int  # the largest prompt_logprobs asked for among them
    segments: tuple[tuple[Request, int, int], ...]


@dataclass
class PromptLogprobsTensors:
    """A plan's results, on the host once ``wait`` returns.

    ``ranks`` count 1 + the tokens strictly more likely than the target.
    """

    plan: PromptLogitsPlan
    target_logprobs: torch.Tensor  # [P] float32
    ranks: torch.Tensor  # [P] int64
    top_ids: torch.Tensor  # [P, num_top] int64, most likely first
    top_logprobs: torch.Tensor  # [P, num_top] float32
    ready: torch.cuda.Event | None  # None on CPU: already complete

    def wait(self) -> None:
        """Block until the copies to the host have landed."""
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None


def compute_prompt_logprobs(
    model: torch.nn.Module, hidden: torch.Tensor, plan: PromptLogitsPlan, vocab_size: int
) -> PromptLogprobsTensors:
    """Score ``plan``'s positions from a step's hidden states [T, H] and start copying the
    results to the host (no host-device sync). ``model.compute_logits`` maps [N, H] to
    [N, vocab_size] logits."""
    device = hidden.device
    rows = upload(torch.from_numpy(plan.token_rows), device)  # [P]
    targets = upload(torch.from_numpy(plan.target_ids), device)  # [P]
    size = max(1, _SLICE_VALUES // vocab_size)  # positions a slice
    parts: list[tuple[torch.Tensor, ...]] = []
    for lo in range(0, len(plan.token_rows), size):
        logits = model.compute_logits(hidden[rows[lo : lo + size]]).float()  # [c, V]
        logprobs = torch.log_softmax(logits, dim=-1)  # [c, V]
        target = logprobs.gather(1, targets[lo : lo + size].unsqueeze(1))  # [c, 1]
        rank = (logprobs > target).sum(dim=-1) + 1  # [c]
        top_lps, top_ids = logprobs.topk(min(plan.num_top, logprobs.shape[-1]), dim=-1)  # [c, k]
        parts.append((target.squeeze(1), rank, top_ids, top_lps))
        del logits, logprobs
    target_lps, ranks, top_ids, top_lps = (torch.cat(col) for col in zip(*parts, strict=True))
    host = [download(t) for t in (target_lps, ranks, top_ids, top_lps)]
    ready = None
    if device.type == "cuda":
        ready = record_event(device)
    return PromptLogprobsTensors(plan, *host, ready=ready)


@dataclass
class _State:
    """One request's prompt logprobs so far."""

    request: Request
    k: int
    num_planned: int = 0  # logits positions [0, num_planned) handed to a step
    entries: list[TokenLogprob | None] = field(default_factory=lambda: [None])


class PromptLogprobs:
    """The engine's requests with ``prompt_logprobs``, from ``add`` to ``pop`` (or ``drop``).

    ``pending`` is how many of them still have prompt positions no step has planned; the
    engine asks for a ``plan`` only while it is non-zero.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._states: dict[str, _State] = {}
        self._unplanned: dict[str, _State] = {}

    @property
    def pending(self) -> int:
        return len(self._unplanned)

    def add(self, request: Request) -> None:
        """Track ``request`` (its SamplingParams has ``prompt_logprobs``)."""
        k = request.sampling_params.prompt_logprobs
        if k is None:
            raise ValueError(f"request {request.request_id} has no prompt_logprobs")
        state = self._states[request.request_id] = _State(request, k)
        if request.num_prompt_tokens > 1:
            self._unplanned[request.request_id] = state

    def clear(self) -> None:
        """Forget every request."""
        self._states.clear()
        self._unplanned.clear()

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget aborted requests (unknown ids are ignored)."""
        for rid in request_ids:
            self._states.pop(rid, None)
            self._unplanned.pop(rid, None)

    def pop(self, request_id: str) -> list[TokenLogprob | None] | None:
        """The finished request's prompt logprobs (None if it did not ask), forgotten here.

        Raises RuntimeError when some position was never recorded (an engine bug).
        """
        state = self._states.pop(request_id, None)
        self._unplanned.pop(request_id, None)
        if state is None:
            return None
        if len(state.entries) != state.request.num_prompt_tokens:
            raise RuntimeError(
                f"request {request_id}: {len(state.entries)} prompt logprobs recorded for "
                f"{state.request.num_prompt_tokens} prompt tokens"
            )
        return state.entries

    def plan(self, sched: SchedulerOutput, batch: HostBatch) -> PromptLogitsPlan | None:
        """The prompt positions this step computes for requests that asked and that no
        earlier step planned; None when there are none. Marks them planned.

        A row is found in ``batch`` by the KV slot of its first token (unique in a step),
        so the batch's row order does not matter. Raises RuntimeError when a request's
        positions would skip some (computed without a plan: an engine bug).
        """
        if not self._unplanned:
            return None
        wanted = np.fromiter((s.request.slot for s in self._unplanned.values()), dtype=np.int64)
        rows = np.flatnonzero(np.isin(sched.slots, wanted[wanted >= 0]))
        if not len(rows):
            return None
        qsl = np.zeros(batch.num_reqs + 1, dtype=np.int64)
        np.cumsum(batch.query_lens, out=qsl[1:])
        first_kv = batch.slot_mapping[qsl[:-1]]  # [B] the KV slot of each row's first token
        bs, table = self.block_size, sched.table
        token_rows: list[np.ndarray] = []
        targets: list[np.ndarray] = []
        segments: list[tuple[Request, int, int]] = []
        num_top = 0
        for j in rows.tolist():
            req: Request = sched.requests[j]
            state = self._unplanned.get(req.request_id)
            if state is None or state.request is not req:  # (aborted, its id reused since)
                continue
            start, count = int(sched.starts[j]), int(sched.num_new[j])
            last = req.num_prompt_tokens - 1  # positions 0 .. last - 1 score a prompt token
            lo, hi = max(start, state.num_planned), min(start + count, last)
            if start > state.num_planned:
                raise RuntimeError(
                    f"request {req.request_id}: prompt positions {state.num_planned}..{start - 1}"
                    " were computed without their logits (a prefix-cache hit?)"
                )
            if hi > lo:
                slot = int(sched.slots[j])
                kv = int(table.block_table[slot, start // bs]) * bs + start % bs
                found = np.flatnonzero(first_kv == kv)
                if len(found) != 1:
                    raise RuntimeError(
                        f"request {req.request_id}: its row is not in the step's batch"
                    )
                base = int(qsl[found[0]]) - start
                token_rows.append(np.arange(lo, hi, dtype=np.int64) + base)
                targets.append(np.asarray(req.prompt_token_ids[lo + 1 : hi + 1], dtype=np.int64))
                segments.append((req, lo, hi - lo))
                num_top = max(num_top, state.k)
                state.num_planned = hi
            if state.num_planned >= last:
                del self._unplanned[req.request_id]
        if not segments:
            return None
        return PromptLogitsPlan(
            np.concatenate(token_rows), np.concatenate(targets), num_top, tuple(segments)
        )

    def record(self, result: PromptLogprobsTensors) -> None:
        """Append a step's results to their requests' entries, in prompt order (waits for
        the host copies). Requests dropped since are skipped, and so are their ids if given
        to new requests since. Raises RuntimeError when a run of positions does not continue
        its request's entries (an engine bug)."""
        result.wait()
        lps = result.target_logprobs.tolist()
        ranks = result.ranks.tolist()
        top_ids = result.top_ids.tolist()
        top_lps = result.top_logprobs.tolist()
        targets = result.plan.target_ids.tolist()
        i = 0
        for req, first, count in result.plan.segments:
            rid = req.request_id
            state = self._states.get(rid)
            if state is None or state.request is not req:
                i += count
                continue
            if len(state.entries) != first + 1:
                raise RuntimeError(
                    f"request {rid}: prompt logprobs for positions from {first} arrived after "
                    f"{len(state.entries) - 1} of them"
                )
            k = state.k
            for _ in range(count):
                top = dict(zip(top_ids[i][:k], top_lps[i][:k], strict=True))
                state.entries.append(TokenLogprob(targets[i], lps[i], ranks[i], top))
                i += 1
