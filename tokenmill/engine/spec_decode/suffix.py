"""SuffixProposer: drafts from the row's own tokens or from earlier rows' outputs.

Two sources, the longer matching suffix wins:
  * the row itself (prompt and output so far): NgramProposer's per-slot index (or the
    matcher given as ``own``), grams of ``min_n`` .. ``max_n`` tokens;
  * every output finished before in this engine (a job's earlier rows): OutputCorpus, grams
    of ``corpus_min_n`` .. ``corpus_max_n`` tokens, so only a long shared context drafts
    from another row (a short one would often guess wrong).

The engine calls ``observe`` with the outputs of requests as they finish. Indexing them
(hashing every gram of every new token: ~0.4 us a token, 40 ms of a 1 s run of 97k tokens
on an H100 host, on the engine thread between two steps, whether the policy drafted or
not) runs on a worker thread, beside the steps, in batches of ``INDEX_BATCH_TOKENS``:
handed the outputs of each step's finished rows instead (~500 small batches a run), it
could take the GIL from the engine's thread as often. A proposal looks up what was handed
over before it (waiting for the worker to finish that), then hands over the rest observed
so far, to be indexed beside the step it drafts for: the next proposal sees it. Drafts
never depend on timing, and no proposal waits for outputs indexed at once. A drafted step
had waited for the outputs the step before it finished, and a drafting probe for up to a
batch of them observed in the plain steps before it: on an H100 (open chat, 256 rows,
BENCHMARKS session 42) the proposer's ms a call went from 2.06-2.52 to 1.88-1.92 with every
step drafted, and `auto`'s drafted steps as the batch drained to 64-128 rows from 8.9-18.4
ms (one a bucket) to 4.6-7.2 in three runs of four (medians of 4-8; the fourth's 10.9-11.1).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tokenmill.engine.core.batch_slots import BatchSlots
from tokenmill.engine.spec_decode.ngram import NgramProposer
from tokenmill.engine.spec_decode.output_corpus import OutputCorpus

__all__ = ["INDEX_BATCH_TOKENS", "SuffixProposer"]

INDEX_BATCH_TOKENS = 16_384  # observed tokens handed to the indexing worker at once


class SuffixProposer:
    def __init__(
        self,
        max_drafts: int,
        min_n: int = 2,
        max_n: int = 4,
        corpus_min_n: int = 3,
        corpus_max_n: int = 8,
        corpus_tokens: int = 1 << 20,
        own: NgramProposer | None = None,
    ) -> None:
        """``own``: the row's own matcher (default a host-indexed NgramProposer; a
        DeviceNgramProposer searches on the device instead, not the engine's default)."""
        self.max_drafts = max_drafts
        self.own = own if own is not None else NgramProposer(max_drafts, min_n, max_n)
        self.corpus = OutputCorpus(corpus_tokens, corpus_min_n, corpus_max_n)
        self._indexer = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-suffix-index")
        self._queued = False  # outputs handed to the worker since the last proposal
        self._failure: BaseException | None = None  # the worker's first, until raised
        self._pending: list[list[int]] = []  # observed, not yet handed over
        self._pending_tokens = 0

    def observe(self, outputs: list[list[int]]) -> None:
        """Outputs of requests that just finished: later rows may draft from them (indexed
        on the worker thread in batches, in the order observed; copied here, as they are
        now). Copied as lists: the worker makes the arrays (``np.asarray`` of a 128-token
        list took ~4 us, a list copy 0.2: at 256 rows, 10-20 us of each plain step of
        ``auto``'s engine thread, CPU)."""
        copies = [list(o) for o in outputs if len(o)]
        self._pending += copies
        self._pending_tokens += sum(len(c) for c in copies)
        if self._pending_tokens >= INDEX_BATCH_TOKENS:
            self._hand_over()

    def _hand_over(self) -> None:
        batch, self._pending, self._pending_tokens = self._pending, [], 0
        self._queued = True  # (before the hand-over: an interrupt between loses none)
        self._indexer.submit(self._index, batch)

    def _index(self, outputs: list[list[int]]) -> None:
        try:
            self.corpus.add(outputs)
        except BaseException as exc:  # raised by the next proposal, on the engine's thread
            self._failure = self._failure or exc

    def _wait_for_index(self) -> None:
        """Return once everything handed over is indexed (the worker runs in order: a no-op
        queued now runs after it); raise, once, what indexing raised."""
        if self._queued:
            self._indexer.submit(lambda: None).result()
            self._queued = False
        failure, self._failure = self._failure, None
        if failure is not None:
            raise RuntimeError(
                f"the suffix proposer failed indexing finished outputs: {failure!r}"
            ) from failure

    def close(self) -> None:
        """Stop the indexing worker once its current batch is done (the rest is dropped)."""
        self._indexer.shutdown(wait=True, cancel_futures=True)

    def propose(self, slots: BatchSlots, rows: np.ndarray) -> np.ndarray:
        """[R, max_drafts] drafts for the slots ``rows`` (-1 past a row's drafts)."""
        return self.predict(slots, rows, self.max_drafts)

    def predict(self, slots: BatchSlots, rows: np.ndarray, count: int) -> np.ndarray:
        """[R, count]: what followed each row's suffix, from the row itself or from the
        outputs handed over before this call (the longer match wins), for as many tokens as
        asked (-1 past them); then hands over the outputs observed since."""
        rows = np.asarray(rows, dtype=np.int64)
        tokens, n = slots.token_ids, slots.num_tokens[rows].astype(np.int64)
        start, own_len = self.own.match(slots, rows)
        drafts = self.own.drafts_from(tokens, rows, start, n, count)
        self._wait_for_index()  # what was handed over before this call is indexed first
        if self.corpus.written:
            back = self.corpus.hasher.back
            pos = n[:, None] - 1 - back  # [R, corpus max_n] the rows' last tokens, oldest first
            at = rows[:, None] * tokens.shape[1] + np.maximum(pos, 0)
            suffix = np.where(pos >= 0, tokens.reshape(-1).take(at), -1)  # short: separator
            shared, shared_len = self.corpus.lookup(suffix, count)
            drafts = np.where((shared_len > own_len)[:, None], shared, drafts)
        if self._pending:  # after the lookup: the corpus is the worker's until the next one
            self._hand_over()
        return drafts
