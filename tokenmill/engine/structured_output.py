"""Structured output: a per-request grammar that masks the tokens it forbids.

A constraint is a JSON schema, any JSON object, a regex the whole output must match, or a
list of strings the output must be one of (structured_output_params.py: the kinds, their
canonical text and checks). The grammar engine, llguidance by default (``pip install
llguidance``; or xgrammar, see Backends below), compiles a constraint against the model's
tokenizer into a token-level matcher that fills a next-token bitmask and consumes sampled
tokens. It is imported only when a request has a constraint, so the engine runs without it
otherwise.

    SamplingParams(structured_output=schema | "json_object" | "regex:..." | "choice:[...]"
                   | StructuredOutputsParams(...))
        ─► check_structured_output: canonical text, grammar validated once (cached)
    LLMEngine.add_request ─► StructuredOutputs.add: a matcher for the request
    ModelRunner.launch ─► SamplingMetadata: the rows with a grammar ─► bitmask(requests)
        [G, ceil(V / 32)] int32, every row in one backend call (its threads) into a
        reused host buffer (pinned on CUDA), one upload ─► Sampler: -inf where a bit is 0
        (after penalties, before temperature / top-k / top-p / greedy argmax)
    a step's sampled tokens ─► feed: each constrained row's matcher consumes its token (one
        backend call); a matcher that has stopped (the JSON, the regex match or the choice
        is complete and nothing but EOS may follow) or failed ─► ended ─► the engine ends
        its request, finish_reason "stop"
    finished / aborted ─► drop

How it meets the rest of the engine:

- **Async scheduling.** Step n+1 is scheduled, and its forward pass enqueued, before step n's
  tokens reach the host; only the mask of a constrained row in step n+1 needs its token from
  step n. So the engine's ``bitmask`` callback, called by ``launch`` after the forward pass is
  enqueued, first waits for step n's tokens and feeds them, then fills step n+1's masks
  (worker processes, or llguidance's threads without the GIL) while the engine processes
  step n (the scheduler applies its tokens, finished requests are handed on) and schedules
  and flattens step n+2 (``bitmask(beside=...)``; llm_engine.py); sampling is enqueued once
  both are done, and forward n+2 right behind it:

      host:    enqueue forward n+1 ─► wait tokens n ─► feed n ─► fill masks n+1 ─►
               enqueue sampling n+1 ─► enqueue forward n+2 ─► wait tokens n+1 ...
      beside:                     [ process n, schedule + flatten n+2 ]
      GPU:     .. sampling n ][ forward n+1 .................. ][ sampling n+1 ][ forward n+2

  The host's work between two waits is the same as without grammars plus the feed and what
  of the fill outlasts that work, so steps keep overlapping. A step's tokens are
  fed exactly once, before the scheduler applies them (early, as above, or when the step is
  processed): a request's grammar is dropped the moment it finishes, so the rows whose
  request still has one are exactly the rows whose token the scheduler will apply. A row
  whose request ends with step n's token (EOS, a stop string, its grammar complete) was
  already scheduled in step n+1, as any row is with async scheduling; its mask there
  allows EOS only and its token is dropped.
- **Preemption.** Preemption recomputes: the request keeps its output tokens (they were all
  fed) and re-runs prompt + output; only its next sampled token is new to the grammar.
- **Speculative decoding.** A row with a grammar takes draft tokens like any other (a chain,
  not a tree: ``core/drafts.py``) under a method by name; not under ``auto``
  (``SchedulerConfig.constrained_drafts``). Its step's logits rows are masked by the grammar after
  its output and after each draft in turn (``bitmask(drafts=...)``: the grammar walks the
  drafts and rolls back, grammar_drafts.py), and its kept tokens (the accepted drafts and
  the one after them) are fed in turn (``feed(counts=...)``); tokens kept after the one
  that ended the grammar are cut by the engine (``took``), so the output is token-by-token
  decoding's. A row drafted ahead of the step in flight gets its drafts from where that
  step's accepted tokens put it (llm_engine.py ``_drafts_of``). A greedy row of a step
  processed at once has its masks after drafts left open where the argmax decides alone
  (``bitmask(open_rows=...)``, grammar_drafts.py): a token sampled there that its grammar
  refuses is dropped (``take_dropped``) and its position sampled again.
- **The invariant.** Each mask handed out is answered by exactly one fed token before the
  row's next mask: ``bitmask`` raises if a row's previous token was not fed, ``feed`` if no
  mask asked for the token.

**Backends.** The grammar library is the engine's ``structured_output_backend``:
llguidance (the default; grammar_llguidance.py, which compiles each constraint once per
thread so that its threads do not queue on one lexer) or xgrammar (grammar_xgrammar.py).
Both fill a step's masks and take its tokens in one call each, on their own threads; only
llguidance lets go of the GIL while it fills. With ``structured_output_processes: N`` either
library runs in N worker processes instead (grammar_processes.py), each holding its share
of the requests' matchers and writing masks straight into the mask buffers below; the
engine thread then processes step n itself while the workers fill (no worker thread, so
no turns taken at the GIL). A step's constrained rows are looked up once, by request id,
and then handled as arrays of grammar indices: counters, statuses and the rows sent to
the workers, with Python per row only where a grammar ended. The engine passes each row's
batch slot, and the lookup is by slot (grammar_slots.py: an entry per slot, taken only for
the very request it was looked up for); without slots, by request id.

JSON is generated compactly (llguidance's ``whitespace_flexible`` off; xgrammar without
free whitespace): no free whitespace between tokens, so a small model cannot wander off
into endless blank lines. With llguidance a schema may override it through its
``x-guidance`` key.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tokenmill.engine.core.runs import run_entries
from tokenmill.engine.device_copy import record_event
from tokenmill.engine.grammar_drafts import consume_runs, fill_with_drafts, mask_rows
from tokenmill.engine.grammar_processes import BACKENDS, GrammarProcesses, TokenizerNotPicklable
from tokenmill.engine.grammar_slots import GrammarSlots
from tokenmill.engine.structured_output_params import (
    DROPPED,
    JSON_OBJECT,
    REJECTED,
    StructuredOutputsParams,
    check_structured_output,
    load_llguidance,
)

if TYPE_CHECKING:
    from tokenmill.engine.core.request import Request

__all__ = [
    "JSON_OBJECT",
    "GrammarStats",
    "StructuredOutputs",
    "StructuredOutputsParams",
    "check_structured_output",
    "load_llguidance",
]

log = logging.getLogger(__name__)


@dataclass
class _PendingFeed:
    """A step's tokens for the worker processes whose answers are not read yet: the fed
    rows' request ids (as they were at the feed: the answers may come after drops), their
    backend rows, tokens and tokens per row, and the sent step (None until it goes out,
    with the next step's fill or alone)."""

    rids: np.ndarray
    rows: np.ndarray  # object
    tokens: np.ndarray
    counts: np.ndarray | None  # tokens per row (None: one each)
    sent: Any = None

    def consumed(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The consume part of a step's message (``GrammarProcesses.send_step``)."""
        return self.rows, self.tokens, self.counts

    def without(self, request_ids: set[str]) -> _PendingFeed | None:
        """This feed (unsent) less the rows of ``request_ids``; None when none is left."""
        keep = np.flatnonzero([rid not in request_ids for rid in self.rids.tolist()])
        if len(keep) == len(self.rids):
            return self
        if not len(keep):
            return None
        if self.counts is None:
            return _PendingFeed(self.rids[keep], self.rows[keep], self.tokens[keep], None)
        tokens = self.tokens[run_entries(self.counts, keep)]
        return _PendingFeed(self.rids[keep], self.rows[keep], tokens, self.counts[keep])


@dataclass
class GrammarStats:
    """Host time spent on grammars (``LLMEngine.step_profile``): filling masks and feeding
    sampled tokens, each one backend call over all constrained rows of a step.
    ``mask_ms`` is the fill's own time; ``mask_wait_ms`` what the engine's other host work
    run beside it (``bitmask(beside=...)``) outlasted it by. With worker processes the
    engine thread runs that work itself while the workers fill: ``mask_ms`` is then the
    time spent sending the fill and, after the work, waiting for it; and ``feed_ms`` the
    time spent sending the tokens and reading the answers, not the wait in between."""

    masks: int = 0  # bitmask calls (steps with a constrained row that samples)
    mask_rows: int = 0
    mask_ms: float = 0.0
    mask_wait_ms: float = 0.0
    drafts_walked: int = 0  # masks filled after a draft token (grammar_drafts.py)
    tokens_dropped: int = 0  # sampled where a mask was left open and refused (DROPPED)
    feeds: int = 0  # feed calls that fed a row
    fed_rows: int = 0
    feed_ms: float = 0.0

    def summary(self) -> dict[str, float]:
        """Mean rows and ms per mask fill and per feed."""
        return {
            "mask_calls": self.masks,
            "rows_per_mask": round(self.mask_rows / max(self.masks, 1), 1),
            "mask_ms": round(self.mask_ms / max(self.masks, 1), 3),
            "mask_wait_ms": round(self.mask_wait_ms / max(self.masks, 1), 3),
            "drafts_walked": self.drafts_walked,
            "tokens_dropped": self.tokens_dropped,
            "feed_calls": self.feeds,
            "rows_per_feed": round(self.fed_rows / max(self.feeds, 1), 1),
            "feed_ms": round(self.feed_ms / max(self.feeds, 1), 3),
        }


class _MaskBuffers:
    """Two [rows, words] int32 host buffers used in turn, pinned on CUDA: the backend writes
    a step's masks straight into one, and the upload copies from there (a pinned source
    needs no staging copy), with no allocation per step.

    The buffer filled for step m is read by a copy enqueued after it is handed out; it is
    written again for step m + 2, after waiting on an event recorded when step m + 1's masks
    were filled, which is behind that copy. By then the host has waited for step m + 1's
    tokens (sampled behind the event), so the wait costs nothing.

    With grammars in worker processes the two buffers are theirs (``allocate``: shared
    memory the workers write into, pinned on CUDA), so masks need no copy on the way.
    """

    def __init__(
        self,
        words: int,
        device: torch.device,
        allocate: Callable[[int, int, bool], np.ndarray] | None = None,
    ) -> None:
        self.words = words
        self._device = device
        self.pinned = device.type == "cuda"
        self._allocate = allocate or self._pinned_tensor
        self._tensors: list[torch.Tensor | None] = [None, None]  # owners of the memory
        self._arrays: list[np.ndarray | None] = [None, None]
        self._turn = 0
        self._fence: Any = None  # torch.cuda.Event recorded at the previous fill

    def _pinned_tensor(self, turn: int, rows: int, pinned: bool) -> np.ndarray:
        tensor = torch.empty((rows, self.words), dtype=torch.int32, pin_memory=pinned)
        self._tensors[turn] = tensor
        return tensor.numpy()

    def next(self, rows: int) -> np.ndarray:
        """A C-contiguous [rows, words] int32 view to fill now (contents undefined)."""
        if self._fence is not None:
            self._fence.synchronize()
        if self.pinned:
            self._fence = record_event(self._device)
        turn, self._turn = self._turn, 1 - self._turn
        array = self._arrays[turn]
        if array is None or array.shape[0] < rows:
            # Room for the batch at hand, rounded up: buffers are rarely replaced.
            size = max(64, 1 << (rows - 1).bit_length())
            array = self._arrays[turn] = self._allocate(turn, size, self.pinned)
        return array[:rows]


class StructuredOutputs:
    """The engine's grammars, one per running or waiting request that has one.

    The ``backend`` (llguidance or xgrammar) builds its tokenizer from the model's (fast HF)
    tokenizer on the first request with a grammar (about half a second); ``vocab_size`` is
    the model's logits width. ``device`` is where the masks go (pinned host buffers on
    CUDA). Its length (``len``) is the number of requests with a grammar.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        device: torch.device | None = None,
        backend: str = "llguidance",
        processes: int = 0,
        fallback: bool = False,
    ) -> None:
        self.vocab_size = vocab_size
        if backend not in BACKENDS:
            raise ValueError(
                f"structured_output_backend must be one of {sorted(BACKENDS)}, got {backend!r}"
            )
        if processes:
            self.backend = GrammarProcesses(
                backend, tokenizer, vocab_size, eos_token_ids, processes
            )
        else:
            self.backend = BACKENDS[backend](tokenizer, vocab_size, eos_token_ids)
        self._worker: ThreadPoolExecutor | None = None  # runs bitmask's ``beside``
        # A grammar is an index into these: its request id, the backend's row (matcher),
        # how many masks it has handed out and tokens it has consumed (equal between
        # steps: each mask's token is fed before the next mask). A step's rows are looked
        # up once and then handled as index arrays.
        self._index: dict[str, int] = {}
        self._free: list[int] = []
        self._rids: np.ndarray = np.empty(0, dtype=object)
        self._owners: np.ndarray = np.empty(0, dtype=object)  # the Request (None: free)
        self._by_slot = GrammarSlots()
        self._rows: np.ndarray = np.empty(0, dtype=object)
        self._num_masked = np.zeros(0, dtype=np.int64)
        self._num_fed = np.zeros(0, dtype=np.int64)
        # in this process: the positions each grammar's last fill left open, as bits
        # (grammar_drafts.py; worker processes keep their own)
        self._opened = np.zeros(0, dtype=np.int64)
        self._ended: list[str] = []  # fed to a stop or an error, not yet taken
        self._rejections: dict[str, str] = {}  # ended requests whose grammar rejected a token
        self._took: dict[str, int] = {}  # ended requests' tokens taken of a several-token feed
        self._dropped: list[str] = []  # fed a refused token where a mask was left open
        self._fed_pending: _PendingFeed | None = None
        # While ``bitmask`` runs ``beside`` with worker processes: the step sent to them
        # (``masks_in`` asks whether they have answered).
        self._filling: Any = None
        shared = self.backend.shared_masks if self._processes else None
        self._buffers = _MaskBuffers(-(-vocab_size // 32), device or torch.device("cpu"), shared)
        self.stats = GrammarStats()
        # With ``fallback`` (processes chosen by default, not asked for), a tokenizer the
        # workers cannot get keeps the grammars in this process instead of raising.
        self._fallback = fallback
        self._in_process_args = (backend, tokenizer, vocab_size, eos_token_ids, device)

    def __len__(self) -> int:
        return len(self._index)

    @property
    def words(self) -> int:
        """int32 words per mask row: ceil(vocab_size / 32)."""
        return self._buffers.words

    @property
    def _processes(self) -> bool:
        """Whether the grammars live in worker processes."""
        return isinstance(self.backend, GrammarProcesses)

    @property
    def processes(self) -> int:
        """The worker processes holding the grammars; 0 when they are in this process."""
        return self.backend.num_processes if self._processes else 0

    @property
    def leaves_masks_open(self) -> bool:
        """Whether the backend can leave a drafted row's masks open (grammar_drafts.py)."""
        return bool(getattr(self.backend, "leaves_masks_open", False))

    def add(self, request: Request) -> None:
        """Give ``request`` (whose SamplingParams has ``structured_output``) its matcher.

        Raises ValueError when the model has no tokenizer or the backend rejects the grammar
        for this tokenizer, ImportError without the backend's package; nothing is added then.
        """
        spec = request.sampling_params.structured_output
        if spec is None:
            raise ValueError(f"request {request.request_id} has no structured_output")
        if request.request_id in self._index:
            # (its old grammar would linger under a stale index: drop it first)
            raise ValueError(f"request {request.request_id} already has a grammar")
        try:
            row = self.backend.matcher(spec)
        except TokenizerNotPicklable as exc:
            if not self._fallback:
                raise
            log.warning("structured output: %s; the grammars stay in the engine's process", exc)
            self._keep_in_process()
            row = self.backend.matcher(spec)
        if not self._free:
            self._grow()
        index = self._free.pop()
        self._index[request.request_id] = index
        self._rids[index] = request.request_id
        self._owners[index] = request
        self._rows[index] = row
        self._num_masked[index] = self._num_fed[index] = self._opened[index] = 0

    def _keep_in_process(self) -> None:
        """The in-process backend instead of worker processes that never started (the
        first request failed to start them, so no mask was handed out yet)."""
        name, tokenizer, vocab_size, eos_token_ids, device = self._in_process_args
        self.backend = BACKENDS[name](tokenizer, vocab_size, eos_token_ids)
        self._buffers = _MaskBuffers(self._buffers.words, device or torch.device("cpu"))

    def _grow(self) -> None:
        """Twice the room for grammars (at least 64)."""
        size = len(self._rows)
        new = max(64, 2 * size)
        self._rids = np.concatenate([self._rids, np.empty(new - size, dtype=object)])
        self._owners = np.concatenate([self._owners, np.full(new - size, None, dtype=object)])
        self._rows = np.concatenate([self._rows, np.empty(new - size, dtype=object)])
        self._num_masked = np.concatenate([self._num_masked, np.zeros(new - size, np.int64)])
        self._num_fed = np.concatenate([self._num_fed, np.zeros(new - size, np.int64)])
        self._opened = np.concatenate([self._opened, np.zeros(new - size, np.int64)])
        self._free += range(new - 1, size - 1, -1)  # lowest first

    def close(self) -> None:
        """Stop the worker thread that runs ``bitmask``'s ``beside`` (started on first use)
        and the grammar processes, if any."""
        self.settle()
        if self._processes:
            self.backend.close()

    def settle(self) -> None:
        """Wait for ``bitmask``'s ``beside`` if it still runs on the worker thread (a call cut
        short while it ran)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def reset(self) -> None:
        """Forget every grammar and what was on its way to them (a call cut short, every
        request gone); worker processes start afresh, since a message may have been cut."""
        self.drop(list(self._index))
        self._by_slot.clear()
        self._fed_pending = self._filling = None
        self._ended = []
        self._dropped = []
        self._rejections.clear()
        self._took.clear()
        if self._processes:
            self.backend.restart()

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget the grammars of finished or aborted requests (unknown ids are ignored).
        The engine drops a request's grammar as soon as the request finishes."""
        request_ids = list(request_ids)
        gone = set(request_ids)
        pending = self._fed_pending
        if pending is not None and pending.sent is None:
            # A feed not yet sent would name their matchers after the drop, which the
            # workers apply first: the worker died on it (an abort between a step's feed
            # and its outcome). Their rows leave it.
            self._fed_pending = pending.without(gone)
        self._ended = [rid for rid in self._ended if rid not in gone]  # (an id reused next)
        self._dropped = [rid for rid in self._dropped if rid not in gone]
        rows, freed = [], []
        for rid in request_ids:
            self._rejections.pop(rid, None)
            self._took.pop(rid, None)
            index = self._index.pop(rid, None)
            if index is not None:
                rows.append(self._rows[index])
                self._rows[index] = self._owners[index] = None
                freed.append(index)
        if freed:
            self._by_slot.forget(freed)  # before the indices can go to other requests
            self._free += freed
            self.backend.release(rows)

    def bitmask(
        self,
        requests: Sequence[Request],
        beside: Callable[[], object] | None = None,
        drafts: tuple[np.ndarray, np.ndarray] | None = None,
        slots: np.ndarray | None = None,
        open_rows: np.ndarray | None = None,
    ) -> np.ndarray:
        """[G, ceil(vocab_size / 32)] int32: bit t of row i (little-endian within each int32)
        is set when token t may follow ``requests[i]``'s output so far. Each row counts as a
        mask handed out, which the row's next feed answers.

        ``drafts`` (counts [G], tokens: every row's one after another) gives rows draft
        tokens: row i then takes 1 + counts[i] rows in turn, the masks after its output
        and after each of its drafts (grammar_drafts.py), [G + sum(counts), words].

        ``beside()``, when given, runs while the masks are filled: on a worker thread while
        the backend fills them on its own threads (llguidance without the GIL: alongside),
        or, with worker processes, on this thread while they fill. This call returns when
        both are done (and raises what ``beside`` raised, after the workers' answers are
        read). It may drop grammars (finish requests): the fill holds its own matchers.

        ``slots`` [G] int64, the rows' batch slots, makes the grammars' lookup one by slot
        (grammar_slots.py); without it, by request id.

        ``open_rows`` [G] bool: drafted rows whose masks after drafts may be left open
        (greedy rows whose step is processed before the next is scheduled: the engine's
        call; grammar_drafts.py), with a backend that ``leaves_masks_open``. A token such
        a row samples at an open position that its grammar refuses comes back from the
        feed in ``take_dropped``.

        The array is a reused buffer: valid until the second call after this one.
        Raises RuntimeError when a request has no grammar or its last mask's token has not
        been fed (a step launched before the previous one's tokens were fed).
        """
        index = self._indices(requests, "raise", slots)
        behind = self._num_fed[index] != self._num_masked[index]
        if behind.any():
            rid = requests[int(np.argmax(behind))].request_id
            raise RuntimeError(
                f"request {rid}: its grammar is behind its output; a step with a constrained "
                "row must be launched after the previous step's tokens were fed "
                "(StructuredOutputs.feed)"
            )
        self._num_masked[index] += 1
        rows = self._rows[index]
        counts, draft_tokens = (None, None) if drafts is None else drafts
        if counts is not None and not np.any(counts):
            counts = draft_tokens = None
        size = mask_rows(counts, len(rows))
        places = np.arange(len(rows)) if counts is None else np.cumsum(counts + 1) - counts - 1
        walk = None if counts is None else (np.asarray(draft_tokens, np.int64), counts)
        if walk is None or not self.leaves_masks_open:
            open_rows = None
        mask = self._buffers.next(size)
        if self._processes:
            # The fed tokens (kept by ``feed``) go out with the masks to fill, one message
            # per worker: the workers take the tokens, answer, and go straight on to the
            # masks while this thread runs ``beside``; the feed's answers are read before
            # the fill's (each worker answers in order).
            t0 = time.perf_counter()
            pending = self._fed_pending
            fill = (rows, mask, places, walk)
            if pending is not None and pending.sent is None:
                sent = self.backend.send_step(pending.consumed(), fill, open_rows)
                pending.sent = sent
            else:
                sent = self.backend.send_step(fill=fill, open_rows=open_rows)
            t1 = time.perf_counter()
            self._filling = sent
            try:
                if beside is not None:
                    beside()
            finally:  # the answers are read whatever happened, or the next would be theirs
                self._filling = None
                self._finish_feed()
                t2 = time.perf_counter()
                self.backend.finish_fill(sent)
            mask_s = time.perf_counter() - t2 + t1 - t0
            wait_s = 0.0
        else:
            # ``beside`` goes to the worker, the fill stays here: the fill lets go of the
            # GIL within microseconds, so the worker's Python runs at once, alongside.
            side = None
            if beside is not None:
                if self._worker is None:
                    self._worker = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-engine")
                side = self._worker.submit(beside)
            t0 = time.perf_counter()
            try:
                walked = walk or (None, None)
                self._opened[index] = fill_with_drafts(
                    self.backend, rows, mask, places, *walked, open_rows
                )
            finally:
                t1 = time.perf_counter()
                if side is not None:
                    side.result()
            mask_s, wait_s = t1 - t0, time.perf_counter() - t1
        stats = self.stats
        stats.masks += 1
        stats.mask_rows += len(rows)
        stats.drafts_walked += size - len(rows)
        stats.mask_ms += mask_s * 1e3
        stats.mask_wait_ms += wait_s * 1e3
        return mask

    def masks_in(self) -> bool:
        """Called from ``bitmask``'s ``beside``: whether the worker processes have filled
        the masks already, without waiting. Always False in process, where the fill and
        ``beside`` take turns on the GIL: whether the fill has returned by then depends on
        the interpreter's switches, not on the work left."""
        return self._filling is not None and self.backend.answered(self._filling)

    def _indices(
        self, requests: Sequence[Request], missing: str, slots: np.ndarray | None = None
    ) -> np.ndarray:
        """The grammar index of each request, int64, by its batch slot ``slots[i]`` when
        given (grammar_slots.py), else by request id; a request without a grammar raises
        (``missing="raise"``) or is -1 (``"keep"``)."""
        reqs = _objects(requests)
        if slots is None:
            index = self._find(reqs)
        else:
            index = self._by_slot.lookup(reqs, slots, self._find, _constrained)
        if missing == "raise" and len(index) and index.min() < 0:
            rid = reqs[int(np.argmin(index))].request_id
            raise RuntimeError(f"request {rid} has no grammar")
        return index

    def _find(self, requests: np.ndarray) -> np.ndarray:
        """The grammar index of each request [R] int64 by its id, -1 where it has none: its
        id's grammar may be another request's (a finished one's row fed after a request of
        the same id was added)."""
        get = self._index.get
        index = np.fromiter(
            (get(req.request_id, -1) for req in requests), dtype=np.int64, count=len(requests)
        )
        found = np.flatnonzero(index >= 0)
        index[found[self._owners[index[found]] != requests[found]]] = -1
        return index

    def feed(
        self,
        requests: Sequence[Request],
        tokens: Sequence[int] | np.ndarray,
        counts: np.ndarray | None = None,
        slots: np.ndarray | None = None,
    ) -> None:
        """Give each request that still has a grammar its token ``tokens[i]`` (sampled with
        that grammar's last mask); the others (plain rows, finished requests) are skipped.
        With ``counts``, request i's tokens are its ``counts[i]`` ones in turn in ``tokens``
        (a drafted row's kept tokens: its accepted drafts and the one after them). Requests
        whose grammar now stops or rejects a token (logged) go to ``take_ended``; tokens
        after it are not taken (``took``). ``slots`` [R]: the batch slots the rows ran in, as
        for ``bitmask`` (a request may have left its slot since: the lookup allows for it).

        Call it once per step, before the scheduler applies the step's tokens. Raises
        RuntimeError for a token no mask asked for (a step's tokens fed twice).
        """
        self._finish_feed()
        t0 = time.perf_counter()
        index = self._indices(requests, "keep", slots)
        kept = np.flatnonzero(index >= 0)
        if not len(kept):
            return
        index = index[kept]
        unasked = self._num_fed[index] >= self._num_masked[index]
        if unasked.any():
            rid = self._rids[index[int(np.argmax(unasked))]]
            raise RuntimeError(
                f"request {rid}: a sampled token no grammar mask asked for (a step's tokens "
                "fed twice)"
            )
        self._num_fed[index] += 1
        rows = self._rows[index]
        tokens = np.asarray(tokens, dtype=np.int64)
        if counts is None or int(np.max(counts)) == 1:
            fed = None
            tokens_fed = tokens[kept]
        else:
            counts = np.asarray(counts, dtype=np.int64)
            fed = counts[kept]
            tokens_fed = tokens[run_entries(counts, kept)]
        rids = self._rids[index]  # as they are now: the outcome may come after drops
        if self._processes:
            # Sent with the next ``bitmask``'s fill, or alone by whatever reads the outcome
            # first.
            self._fed_pending = _PendingFeed(rids, rows, tokens_fed, fed)
            self.stats.feed_ms += (time.perf_counter() - t0) * 1e3
            return
        opened, self._opened[index] = self._opened[index], 0
        try_last = (opened >> ((1 if fed is None else fed) - 1)) & 1 == 1
        status, took = consume_runs(self.backend, rows, tokens_fed, fed, try_last)
        self._fed_outcome(rids, rows, status, t0, fed, took)

    def _finish_feed(self) -> None:
        """Read the answers of a feed sent to the worker processes, if one is pending."""
        if self._fed_pending is not None:
            t0 = time.perf_counter()
            pending, self._fed_pending = self._fed_pending, None
            if pending.sent is None:
                pending.sent = self.backend.send_step(pending.consumed())
            status, took = self.backend.finish_consume(pending.sent)
            self._fed_outcome(pending.rids, pending.rows, status, t0, pending.counts, took)

    def _fed_outcome(
        self,
        rids: np.ndarray,
        rows: np.ndarray,
        status: np.ndarray,
        t0: float,
        counts: np.ndarray | None = None,
        took: np.ndarray | None = None,
    ) -> None:
        """Requests whose grammar rejected or completed with a token go to ``take_ended``,
        with how many of their ``counts`` tokens they ``took``, those whose last token was
        refused where its mask was left open to ``take_dropped``; the feed's time since
        ``t0`` is counted."""
        for i in np.flatnonzero(status).tolist():
            index = self._index.get(rids[i])
            if index is None or self._rows[index] is not rows[i]:
                # Dropped since it was fed (worker processes answer later), maybe its id
                # given to a new request since: the outcome is no grammar's now.
                continue
            if status[i] == DROPPED:
                self._dropped.append(rids[i])
                self.stats.tokens_dropped += 1
                continue
            if status[i] == REJECTED:  # the matcher is left in its error state
                why = self.backend.error(rows[i])
                log.warning("request %s: its grammar rejected a sampled token (%s)", rids[i], why)
                self._rejections[rids[i]] = why
            if counts is not None and took is not None and counts[i] > 1:
                self._took[rids[i]] = int(took[i])
            self._ended.append(rids[i])
        stats = self.stats
        stats.feeds += 1
        stats.fed_rows += len(rows)
        stats.feed_ms += (time.perf_counter() - t0) * 1e3

    def take_ended(self) -> list[str]:
        """The ids of requests whose grammar has stopped (the output is complete: nothing
        but EOS may follow) or failed since the last call, among those not dropped since:
        the caller finishes them."""
        self._finish_feed()
        if not self._ended:
            return []
        ended = [rid for rid in self._ended if rid in self._index]
        self._ended = []
        return ended

    def take_dropped(self) -> list[str]:
        """The ids of requests (still with their grammar) whose last fed token was sampled
        where its mask was left open and the grammar refuses it, since the last call: the
        caller drops that token from the output (``bitmask(open_rows=...)``). Call it after
        ``take_ended``, which reads the feed's outcome."""
        if not self._dropped:
            return []
        dropped = [rid for rid in self._dropped if rid in self._index]
        self._dropped = []
        return dropped

    def took(self, request_id: str) -> int | None:
        """How many of the tokens last fed to an ended request's grammar it took, the one
        that ended it included, once; None unless they were several (a drafted step's). The
        tokens after it are the engine's to cut: token-by-token decoding never makes them."""
        return self._took.pop(request_id, None)

    def rejection(self, request_id: str) -> str | None:
        """Why the grammar of an ended request rejected its last token, once; None when the
        grammar completed instead."""
        return self._rejections.pop(request_id, None)


def _objects(requests: Sequence[Request]) -> np.ndarray:
    """``requests`` as an [R] object array (the engine's rows already are one)."""
    if isinstance(requests, np.ndarray) and requests.dtype == object:
        return requests
    return np.fromiter(requests, dtype=object, count=len(requests))


def _constrained(requests: np.ndarray) -> np.ndarray:
    """[R] bool: whether each request has a ``structured_output`` (only those may have a
    grammar)."""
    return np.fromiter(
        (req.sampling_params.structured_output is not None for req in requests),
        dtype=np.bool_,
        count=len(requests),
    )
