"""OutputBuilder: finished requests become RequestOutputs, their text decoded off the step loop.

    step n:    the scheduler finishes requests ─► submit(finished) ──► worker thread:
                                                                        batch decode, outputs
    step n+1:  collect() ◄── the outputs built so far, in submission order

With async scheduling (on CUDA) the worker decodes while the main thread schedules and
launches the next steps: the tokenizer's Rust decoding releases the GIL (``decode_rows``
goes to it directly, with transformers' space clean-up where transformers applies it).
Without a device to overlap (CPU) it builds inline, where a thread would only add
switching. The worker has its own copy of the tokenizer, so it never shares one with code
that encodes on another thread.
Text is decoded once per request, in one batch per ``skip_special_tokens`` setting; requests
with stop strings already have theirs (their IncrementalDetokenizer). The text of an EOS or
stop token that ended a request is left out unless ``include_stop_str_in_output``, as vLLM
leaves it out; the token stays in ``token_ids``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.core.request import Request, RequestStatus
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.logprob_texts import logprob_texts
from tokenmill.engine.outputs import RequestOutput, TokenLogprob
from tokenmill.engine.space_cleanup import cleanup_policy

__all__ = ["Finished", "OutputBuilder"]


@dataclass(frozen=True)
class Finished:
    """A finished request and what the engine gathered for it while it ran."""

    request: Request
    detokenizer: IncrementalDetokenizer | None  # only for requests with stop strings
    logprobs: list[TokenLogprob] | None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # SamplingParams.prompt_logprobs


class OutputBuilder:
    """Builds RequestOutputs inline or on one worker thread (``background``)."""

    def __init__(self, tokenizer: Any, background: bool) -> None:
        self._pool = None
        if background:
            tokenizer = copy.deepcopy(tokenizer)
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-outputs")
        self.tokenizer = tokenizer
        self._cleanup = None if tokenizer is None else cleanup_policy(tokenizer)
        # Outputs being built, each batch with its number (``submit`` calls before it).
        self._queued: deque[tuple[int, Future[list[RequestOutput]]]] = deque()
        self._ready: list[RequestOutput] = []
        self._submits = 0
        # Aborted ids -> the submits before their abort: outputs of those batches are
        # dropped; a request added again with the id is a later batch's, kept.
        self._dropped: dict[str, int] = {}

    @property
    def pending(self) -> bool:
        """Whether outputs were submitted and not collected yet."""
        return bool(self._queued or self._ready)

    def submit(self, finished: list[Finished]) -> None:
        if not finished:
            return
        if self._pool is None:
            self._ready += self.build(finished)
        else:
            self._queued.append((self._submits, self._pool.submit(self.build, finished)))
        self._submits += 1

    def collect(self, wait: bool = False) -> list[RequestOutput]:
        """The outputs built so far (all of them when ``wait``); re-raises a worker's error."""
        outputs, self._ready = self._ready, []
        while self._queued and (wait or self._queued[0][1].done()):
            number, built = self._queued.popleft()
            if self._dropped:
                dropped = self._dropped
                outputs += [o for o in built.result() if dropped.get(o.request_id, 0) <= number]
            else:
                outputs += built.result()
        if not self.pending:
            self._dropped.clear()
        return outputs

    def drop(self, request_ids: Iterable[str]) -> None:
        """Never return the outputs of these ids submitted so far (aborted requests); a
        request added later with one of the ids gets its output."""
        ids = set(request_ids)
        self._ready = [o for o in self._ready if o.request_id not in ids]
        if self._queued:
            self._dropped.update(dict.fromkeys(ids, self._submits))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def build(self, finished: list[Finished]) -> list[RequestOutput]:
        texts = self._decode([f.request for f in finished if f.detokenizer is None])
        outputs = []
        for f in finished:
            req, detok = f.request, f.detokenizer
            if detok is not None and detok.stop_string is None and detok.flush() is not None:
                req.stop_reason = detok.stop_string
                req.status = RequestStatus.FINISHED_STOPPED
            outputs.append(
                RequestOutput(
                    request_id=req.request_id,
                    prompt_token_ids=req.prompt_token_ids,
                    text=detok.output_text if detok is not None else texts.get(req.request_id, ""),
                    token_ids=req.output_token_ids,
                    finish_reason=req.status.value,
                    stop_reason=req.stop_reason,
                    num_cached_tokens=req.num_cached_prompt_tokens,
                    logprobs=self._with_texts(f.logprobs),
                    prompt_logprobs=self._with_texts(f.prompt_logprobs),
                    error=req.error,
                )
            )
        return outputs

    def _with_texts(self, entries: list[Any] | None) -> Any:
        """Logprobs entries (None where a prompt position has none) with their tokens' texts,
        for ``Logprob.decoded_token``: special tokens spelled out, as vLLM fills it in
        whatever ``skip_special_tokens`` says (that setting is the completion text's)."""
        if not entries or self.tokenizer is None:
            return entries
        texts = logprob_texts([e for e in entries if e is not None], self.tokenizer, False)
        return [None if e is None else dataclasses.replace(e, texts=texts) for e in entries]

    def _decode(self, requests: list[Request]) -> dict[str, str]:
        """{request id: text}, decoded in one batch per ``skip_special_tokens`` setting."""
        if self.tokenizer is None or not requests:
            return {}
        texts: dict[str, str] = {}
        for skip in (True, False):
            group = [r for r in requests if r.sampling_params.skip_special_tokens is skip]
            if group:
                # a stop token's text is not output (Request.stop_token_hidden)
                rows = [r.output_token_ids[: -1 if r.stop_token_hidden else None] for r in group]
                decoded = decode_rows(self.tokenizer, rows, skip, self._cleanup)
                texts.update(zip((r.request_id for r in group), decoded, strict=True))
        return texts


def decode_rows(
    tokenizer: Any, rows: list[list[int]], skip_special_tokens: bool, cleanup: bool | None
) -> list[str]:
    """``tokenizer.batch_decode(rows, ...)`` given its ``cleanup_policy``. For a fast
    tokenizer the rows go to its Rust tokenizer in one batch, which releases the GIL, and get
    the space clean-up transformers would apply: transformers itself first walks every token
    id of every row in Python (``to_py_obj``; 4,096 rows x 62 tokens: 118 ms of the GIL
    against 6 ms) and then decodes them one row at a time. A tokenizer whose text the policy
    cannot tell (None) goes through transformers."""
    if cleanup is None:
        return tokenizer.batch_decode(rows, skip_special_tokens=skip_special_tokens)
    texts = tokenizer.backend_tokenizer.decode_batch(rows, skip_special_tokens=skip_special_tokens)
    return [tokenizer.clean_up_tokenization(t) for t in texts] if cleanup else texts
