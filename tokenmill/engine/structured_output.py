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
  (llguidance's threads, without the GIL) while a worker thread processes step n (the
  scheduler applies its tokens, finished requests are handed on: ``bitmask(beside=...)``);
  sampling is enqueued once both are done:

      host:    schedule n+1 ─► enqueue forward n+1 ─► wait tokens n ─► feed n ─► fill masks
               n+1 ─► enqueue sampling n+1 ─► schedule n+2 ...
      worker:                                                 [ process n ]
      GPU:     .. sampling n ][ forward n+1 .................... ][ sampling n+1 ] ...

  The host's work between two waits is the same as without grammars plus the feed and what
  of the fill outlasts processing step n, so steps keep overlapping. A step's tokens are
  fed exactly once, before the scheduler applies them (early, as above, or when the step is
  processed): a request's grammar is dropped the moment it finishes, so the rows whose
  request still has one are exactly the rows whose token the scheduler will apply. A row
  whose request ends with step n's token (EOS, a stop string, its grammar complete) was
  already scheduled in step n+1, as any row is with async scheduling; its mask there
  allows EOS only and its token is dropped.
- **Preemption.** Preemption recomputes: the request keeps its output tokens (they were all
  fed) and re-runs prompt + output; only its next sampled token is new to the grammar.
- **Speculative decoding.** Rows with a grammar take no drafts (``core/drafts.py``), like
  rows that ask for logprobs: every step samples one token for them.
- **The invariant.** Each mask handed out is answered by exactly one fed token before the
  row's next mask: ``bitmask`` raises if a row's previous token was not fed, ``feed`` if no
  mask asked for the token.

**Backends.** The grammar library is the engine's ``structured_output_backend``:
llguidance (the default; grammar_llguidance.py, which compiles each constraint once per
thread so that its threads do not queue on one lexer) or xgrammar (grammar_xgrammar.py).
Both fill a step's masks and take its tokens in one call each, on their own threads; only
llguidance lets go of the GIL while it fills. With ``structured_output_processes: N`` either
library runs in N worker processes instead (grammar_processes.py), each holding its share
of the requests' matchers and writing masks straight into the mask buffers below.

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

from tokenmill.engine.device_copy import record_event
from tokenmill.engine.grammar_processes import BACKENDS, GrammarProcesses
from tokenmill.engine.structured_output_params import (
    JSON_OBJECT,
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
class _Grammar:
    """One request's matcher; how many masks it has handed out and tokens it has consumed
    (equal between steps: each mask's token is fed before the next mask)."""

    matcher: Any  # the backend's matcher
    group: int  # llguidance's lexer group (which compiled copy it came from); 0 otherwise
    num_masked: int = 0
    num_fed: int = 0


@dataclass
class GrammarStats:
    """Host time spent on grammars (``LLMEngine.step_profile``): filling masks and feeding
    sampled tokens, each one backend call over all constrained rows of a step.
    ``mask_ms`` is the fill's own time; ``mask_wait_ms`` what the engine's other host work
    run beside it (``bitmask(beside=...)``) outlasted it by."""

    masks: int = 0  # bitmask calls (steps with a constrained row that samples)
    mask_rows: int = 0
    mask_ms: float = 0.0
    mask_wait_ms: float = 0.0
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
        self._grammars: dict[str, _Grammar] = {}
        self._ended: list[str] = []  # fed to a stop or an error, not yet taken
        # A feed sent to the worker processes, not yet answered: (fed rows, sent, start)
        self._fed_pending: tuple[list[tuple[str, _Grammar, int]], Any, float] | None = None
        shared = self.backend.shared_masks if processes else None
        self._buffers = _MaskBuffers(-(-vocab_size // 32), device or torch.device("cpu"), shared)
        self.stats = GrammarStats()

    def __len__(self) -> int:
        return len(self._grammars)

    def add(self, request: Request) -> None:
        """Give ``request`` (whose SamplingParams has ``structured_output``) its matcher.

        Raises ValueError when the model has no tokenizer or the backend rejects the grammar
        for this tokenizer, ImportError without the backend's package; nothing is added then.
        """
        spec = request.sampling_params.structured_output
        if spec is None:
            raise ValueError(f"request {request.request_id} has no structured_output")
        matcher, group = self.backend.matcher(spec)
        self._grammars[request.request_id] = _Grammar(matcher, group)

    def close(self) -> None:
        """Stop the worker thread that runs ``bitmask``'s ``beside`` (started on first use)
        and the grammar processes, if any."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        if isinstance(self.backend, GrammarProcesses):
            self.backend.close()

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget the grammars of finished or aborted requests (unknown ids are ignored).
        The engine drops a request's grammar as soon as the request finishes."""
        dropped = [self._grammars.pop(rid, None) for rid in request_ids]
        rows = [(g.matcher, g.group) for g in dropped if g is not None]
        if rows:
            self.backend.release(rows)

    def bitmask(
        self, requests: Sequence[Request], beside: Callable[[], object] | None = None
    ) -> np.ndarray:
        """[G, ceil(vocab_size / 32)] int32: bit t of row i (little-endian within each int32)
        is set when token t may follow ``requests[i]``'s output so far. Each row counts as a
        mask handed out, which the row's next fed token answers.

        ``beside()``, when given, runs on a worker thread while the backend fills the masks
        on its own threads (llguidance without the GIL: alongside); this call returns when
        both are done (and raises what ``beside`` raised). It may drop grammars (finish
        requests): the fill holds its own matchers.

        The array is a reused buffer: valid until the second call after this one.
        Raises RuntimeError when a request has no grammar or its last mask's token has not
        been fed (a step launched before the previous one's tokens were fed).
        """
        masked: list[_Grammar] = []
        for req in requests:
            grammar = self._grammars.get(req.request_id)
            if grammar is None:
                raise RuntimeError(f"request {req.request_id} has no grammar")
            if grammar.num_fed != grammar.num_masked:
                raise RuntimeError(
                    f"request {req.request_id}: its grammar is behind its output; a step with "
                    "a constrained row must be launched after the previous step's tokens "
                    "were fed (StructuredOutputs.feed)"
                )
            masked.append(grammar)
        rows = [(grammar.matcher, grammar.group) for grammar in masked]
        mask = self._buffers.next(len(rows))
        for grammar in masked:
            grammar.num_masked += 1
        # ``beside`` goes to the worker, the fill stays here: the fill lets go of the GIL
        # within microseconds, so the worker's Python runs at once, alongside.
        # With worker processes the fill is sent first: the workers take the fed tokens
        # (sent by ``feed``) and go straight on to the masks while the feed's answers are
        # read here; ``beside`` starts once they are (it finishes the ended requests).
        sent = None
        if isinstance(self.backend, GrammarProcesses):
            sent = self.backend.send_fill(rows, mask)
            self._finish_feed()  # its time counts as the feed's, not the fill's
        side = None
        if beside is not None:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-engine")
            side = self._worker.submit(beside)
        t0 = time.perf_counter()
        try:
            if sent is not None:
                self.backend.finish_fill(sent)
            else:
                self.backend.fill(rows, mask)
        finally:
            t1 = time.perf_counter()
            if side is not None:
                side.result()
        stats = self.stats
        stats.masks += 1
        stats.mask_rows += len(rows)
        stats.mask_ms += (t1 - t0) * 1e3
        stats.mask_wait_ms += (time.perf_counter() - t1) * 1e3
        return mask

    def feed(self, requests: Sequence[Request], tokens: Sequence[int]) -> None:
        """Give each request that still has a grammar its token ``tokens[i]`` (sampled with
        that grammar's last mask); the others (plain rows, finished requests) are skipped.
        Requests whose grammar now stops or rejects its token (logged) go to ``take_ended``.

        Call it once per step, before the scheduler applies the step's tokens. Raises
        RuntimeError for a token no mask asked for (fed twice, or a drafted row).
        """
        self._finish_feed()
        t0 = time.perf_counter()
        grammars = self._grammars
        fed: list[tuple[str, _Grammar, int]] = []
        for req, token in zip(requests, tokens, strict=True):
            grammar = grammars.get(req.request_id)
            if grammar is None:
                continue
            if grammar.num_fed >= grammar.num_masked:
                raise RuntimeError(
                    f"request {req.request_id}: a sampled token no grammar mask asked for "
                    "(a step's tokens fed twice, or drafts on a constrained row)"
                )
            grammar.num_fed += 1
            fed.append((req.request_id, grammar, int(token)))
        if not fed:
            return
        rows = [(grammar.matcher, grammar.group) for _, grammar, _ in fed]
        tokens_fed = [token for _, _, token in fed]
        if isinstance(self.backend, GrammarProcesses):
            # Sent now, answered when needed: by the next ``bitmask`` (after it has sent
            # the masks to fill) or whatever reads the outcome first.
            self._fed_pending = (fed, self.backend.send_consume(rows, tokens_fed), t0)
            return
        self._fed_outcome(fed, self.backend.consume(rows, tokens_fed), t0)

    def _finish_feed(self) -> None:
        """Read the answers of a feed sent to the worker processes, if one is pending."""
        if self._fed_pending is not None:
            fed, sent, t0 = self._fed_pending
            self._fed_pending = None
            self._fed_outcome(fed, self.backend.finish_consume(sent), t0)

    def _fed_outcome(
        self, fed: list[tuple[str, _Grammar, int]], accepted: Sequence[bool], t0: float
    ) -> None:
        """Requests whose grammar rejected or completed with its token go to ``take_ended``."""
        backend = self.backend
        for (rid, grammar, _), ok in zip(fed, accepted, strict=True):
            if not ok:  # a rejected token leaves the matcher in its error state
                log.warning(
                    "request %s: its grammar rejected a sampled token (%s); ending it",
                    rid,
                    backend.error(grammar.matcher),
                )
                self._ended.append(rid)
            elif backend.is_stopped(grammar.matcher):
                self._ended.append(rid)
        stats = self.stats
        stats.feeds += 1
        stats.fed_rows += len(fed)
        stats.feed_ms += (time.perf_counter() - t0) * 1e3

    def take_ended(self) -> list[str]:
        """The ids of requests whose grammar has stopped (the output is complete: nothing
        but EOS may follow) or failed since the last call, among those not dropped since:
        the caller finishes them."""
        self._finish_feed()
        if not self._ended:
            return []
        ended = [rid for rid in self._ended if rid in self._grammars]
        self._ended = []
        return ended
