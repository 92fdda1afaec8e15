"""N-gram prompt lookup with the search on the device: NgramProposer's drafts without its
host index.

NgramProposer (ngram.py) hashes every token of a row into a per-slot table once, on the
host: inside the engine that cost 0.66-0.80 us a position on an H100 host, and a row's
whole prompt is indexed at its first drafted step, so a forced proposal at 256 rows took
0.6-1.8 ms of a 1.7-2.8 ms device step (BENCHMARKS.md, sessions 45-46). Here each proposed
row's tokens are copied to the device as they become known (only the new ones each call),
and kernels/ngram_match.py searches the whole row at every call: ~0.01 ms of device time
at 512 rows x 2,048 tokens (H100, session 47). What is left on the host is the gather of
the new tokens, one upload, and one small copy back of each row's match.

The search runs on a stream of its own: drafting ahead (async scheduling, small batches)
proposes while a step is in flight, and waiting for the main stream would wait for that
step. The device copy is the proposer's alone, so nothing orders it against the step.

The match is NgramProposer's rule (the longest suffix of ``min_n`` .. ``max_n`` tokens,
its latest earlier occurrence), found without a hash table: where the host index forgot a
gram (another one took its entry) this still finds it, so the drafts can differ in such
rows; both are verified alike, so the output cannot.

Not the engine's default (build_proposer keeps the host index): inside the engine on an
H100, 256 rows, every step drafted, a call took 1.0-1.9 ms against the host index's
0.5-1.2 ms (BENCHMARKS.md, session 47). That version waited three times a call (two
uploads from pageable memory, the copy back), each a moment the output thread can take
the GIL and keep it for a switch interval (0.5 ms). This one stages a single upload in
pinned memory and waits once, under 20 us GIL turns: still 0.15-0.6 ms a call slower than
the host index in two A/B pairs on an H100 (BENCHMARKS.md, session 48).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from tokenmill.engine.core.batch_slots import BatchSlots
from tokenmill.engine.core.runs import within_runs
from tokenmill.engine.short_gil_turns import brief_gil_turns
from tokenmill.engine.spec_decode.ngram import NgramProposer
from tokenmill.kernels.ngram_match import ngram_suffix_match, ngram_suffix_match_ref

__all__ = ["DeviceNgramProposer"]

MIN_WIDTH = 1024  # tokens a row of the device copy holds at first


class DeviceNgramProposer(NgramProposer):
    """``NgramProposer`` whose ``match`` searches a device copy of the rows' tokens (on a
    CPU ``device``, by the PyTorch reference: the same drafts, for tests)."""

    def __init__(
        self, max_drafts: int, min_n: int = 2, max_n: int = 4, device: str = "cuda"
    ) -> None:
        super().__init__(max_drafts, min_n, max_n)
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self._search = ngram_suffix_match if cuda else ngram_suffix_match_ref
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._tokens: torch.Tensor | None = None  # [C, width] int32 (_make_room)
        self._owner = np.empty(0, dtype=object)  # [C] the request whose tokens a row holds
        self._copied = np.zeros(0, dtype=np.int64)  # [C] tokens of a row on the device
        self._pinned_up: torch.Tensor | None = None  # staging for uploads (GPU)
        self._pinned_down: torch.Tensor | None = None  # and for the matches coming back
        self._done = torch.cuda.Event() if cuda else None
        if cuda:  # compile the kernel now, at the engine's start, not in a step
            tokens = torch.zeros((1, 8), dtype=torch.int32, device=self.device)
            one = torch.ones(1, dtype=torch.int64, device=self.device)
            self._search(tokens, one * 0, one * 8, min_n, max_n)

    def match(self, slots: BatchSlots, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """([R] the position after each row's match, -1 where none; [R] the matched gram's
        length, 0 where none), as ``NgramProposer.match``."""
        rows = np.asarray(rows, dtype=np.int64)
        if not len(rows):
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        on_stream = torch.cuda.stream(self._stream) if self._stream else contextlib.nullcontext()
        with on_stream:
            n = slots.num_tokens[rows].astype(np.int64)
            self._make_room(slots, int(n.max()))
            flat, known = self._new_tokens(slots, rows, n)
            # One upload: the new tokens' places and values, then the rows and their lengths.
            sent = self._upload(np.concatenate([flat, known, rows, n]))
            total = len(flat)
            self._tokens.view(-1)[sent[:total]] = sent[total : 2 * total].to(torch.int32)
            which = sent[2 * total :].view(2, -1)
            h = self.hasher  # (its n-gram sizes)
            start, length = self._search(self._tokens, which[0], which[1], h.min_n, h.max_n)
            found = self._download(torch.stack([start, length]))
        return found[0], found[1]

    def _new_tokens(
        self, slots: BatchSlots, rows: np.ndarray, n: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(places in the device copy, values) of the rows' tokens it lacks: from where it
        stopped, or from the row's start where the slot holds another request than at its
        last call or the row is shorter than then (cut back: its tokens may differ). A
        row's known tokens otherwise only grow (as NgramProposer's index assumes)."""
        fresh = rows[(slots.requests[rows] != self._owner[rows]) | (n < self._copied[rows])]
        self._owner[fresh] = slots.requests[fresh]
        self._copied[fresh] = 0
        lo = self._copied[rows]
        count = n - lo
        self._copied[rows] = n
        which = np.repeat(np.arange(len(rows)), count)
        pos = lo[which] + within_runs(count)
        known = slots.token_ids.reshape(-1).take(rows[which] * slots.token_ids.shape[1] + pos)
        return rows[which] * self._tokens.shape[1] + pos, known.astype(np.int64)

    def _upload(self, values: np.ndarray) -> torch.Tensor:
        """``values`` (int64) on the device. On a GPU through a pinned buffer, without a
        wait: each wait is a moment another thread (the output builder) can take the GIL,
        and keep it for a switch interval."""
        if self._stream is None:
            return torch.from_numpy(values)
        if self._pinned_up is None or len(self._pinned_up) < len(values):
            self._pinned_up = torch.empty(2 * len(values), dtype=torch.int64, pin_memory=True)
        staged = self._pinned_up[: len(values)]
        staged.numpy()[:] = values
        return staged.to(self.device, non_blocking=True)

    def _download(self, found: torch.Tensor) -> np.ndarray:
        """``found`` [2, R] on the host: one wait for this stream's work, with brief GIL
        turns (short_gil_turns.py) so that the engine's thread has the GIL back soon."""
        if self._stream is None:
            return found.numpy()
        if self._pinned_down is None or self._pinned_down.numel() < found.numel():
            self._pinned_down = torch.empty(2 * found.numel(), dtype=torch.int64, pin_memory=True)
        out = self._pinned_down[: found.numel()].view(found.shape)
        out.copy_(found, non_blocking=True)
        self._done.record(self._stream)
        with brief_gil_turns():
            self._done.synchronize()
        return out.numpy().copy()  # (the buffer is the next call's)

    def _make_room(self, slots: BatchSlots, longest: int) -> None:
        """A device copy as wide as the longest row proposed so far (a power of two, at
        least MIN_WIDTH, at most the slots' width): [max_num_seqs, max_model_len] int32 at
        once would take 0.5 GiB at 1,024 rows of 131,072 tokens, after the KV cache was
        sized. Widening keeps what was copied."""
        if self._tokens is None or self._tokens.shape[0] != slots.capacity:
            self._tokens = None
            self._owner = np.full(slots.capacity, None, dtype=object)
            self._copied = np.zeros(slots.capacity, dtype=np.int64)
        width = 0 if self._tokens is None else self._tokens.shape[1]
        if longest <= width:
            return
        wide = min(max(MIN_WIDTH, 1 << (longest - 1).bit_length()), slots.token_ids.shape[1])
        tokens = torch.zeros((slots.capacity, wide), dtype=torch.int32, device=self.device)
        if self._tokens is not None:
            tokens[:, :width] = self._tokens
        self._tokens = tokens
