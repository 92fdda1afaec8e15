"""LLMEngine: requests in, finished RequestOutputs out, one ``step`` at a time.

add_request ─► Scheduler.schedule ─► ModelRunner.launch ─► Scheduler.update_from_output
                                        ─► stop strings (incremental text, only where asked)
                                        ─► finished: OutputBuilder (text decoded once)

Text is off the hot path: a request's output is decoded once, when it finishes, together
with the other requests finishing that step, on the output builder's worker thread with
async scheduling (output_builder.py). Only requests with stop strings decode as they go
(``IncrementalDetokenizer``), since their text decides when they stop.

With async scheduling (the default on CUDA) each ``step`` call overlaps host and device:

    call n:   schedule n ─► launch n ─► process n-1 (wait for its tokens, update)
    GPU:                  [ .. step n-1 .. ][ .. step n .. ]
    worker:                                   [ decode the requests n-1 finished ]

Steps with drafts of a small batch (``draft_ahead_below`` rows) keep overlapping when the
proposer can draft ahead of the step in flight (n-gram, suffix: core/drafts.py); larger
ones, and those of other proposers (trees, test ones), run synchronously: launch n, then
process n at once. Steps with
structured output (rows with a grammar) keep overlapping: launch n+1 enqueues the forward
pass, then waits for step n's tokens, feeds them to the grammars, and while the grammars
fill step n+1's masks it processes step n and schedules and flattens step n+2 ("ahead");
then it enqueues sampling n+1, and the next call enqueues forward n+2 right behind it. All
of that host work runs while forward n+1 does (structured_output.py):

    host:  launch n+1: fwd ─► wait tokens n ─► feed ─► process n, schedule + flatten n+2 ─►
           masks in ─► sample n+1 │ launch n+2: fwd ─► wait tokens n+1 ...
    GPU:   .. sample n ][ forward n+1 ...................... ][ sample n+1 ][ forward n+2 ..
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmill.engine.activation_reserve import ActivationReserve, activation_reserve
from tokenmill.engine.attention.backend import (
    AttentionBackend,
    check_backend_takes,
    default_backend_name,
    get_attention_backend,
)
from tokenmill.engine.batch_slot_memory import check_slots_fit
from tokenmill.engine.constrained_drafts import kept_tokens, step_drafts
from tokenmill.engine.core import KVCacheManager
from tokenmill.engine.core.drafts import DraftProposer, PredictsAhead
from tokenmill.engine.core.request import Request, RequestStatus
from tokenmill.engine.core.runs import run_entries
from tokenmill.engine.core.scheduler import Scheduler, SchedulerConfig
from tokenmill.engine.core.scheduler_output import SchedulerOutput
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.engine_config import EngineConfig, EngineSettingError
from tokenmill.engine.grammar_processes import auto_processes
from tokenmill.engine.launched_step import LaunchedStep
from tokenmill.engine.loader import ModelSource, resolve_model_source
from tokenmill.engine.loader.checkpoint_quant import layer_quantization
from tokenmill.engine.loader.gguf_blocks import BLOCK_TYPES, NATIVE_TYPES
from tokenmill.engine.loader.safetensors_loader import load_hf_config
from tokenmill.engine.model_config import context_limit
from tokenmill.engine.model_loader import build_model
from tokenmill.engine.model_output import ModelOutput
from tokenmill.engine.model_runner import ModelRunner, PreparedStep, kv_bytes_per_block
from tokenmill.engine.output_builder import Finished, OutputBuilder
from tokenmill.engine.outputs import RequestOutput, TokenLogprob
from tokenmill.engine.parallel import ParallelConfig
from tokenmill.engine.prompt_logprobs import PromptLogprobs
from tokenmill.engine.prompts import check_prompt_ids
from tokenmill.engine.sampling_columns import NO_LOGPROBS
from tokenmill.engine.sampling_params import SamplingParams, check_vocab_ids
from tokenmill.engine.spec_decode import LearnsFromOutputs, build_proposer
from tokenmill.engine.spec_decode.policy import SpeculationPolicy, StepSample
from tokenmill.engine.structured_output import GrammarStats, StructuredOutputs

log = logging.getLogger(__name__)

LOOKAHEAD_ROWS = 16  # the batches Lookahead's trees suit (spec_decode/lookahead.py)


@dataclass
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer | None  # only for requests with stop strings
    logprobs: list[TokenLogprob] | None
    num_detokenized: int = 0  # output tokens given to ``detokenizer`` so far


class ContextCutError(ValueError):
    """The KV cache holds fewer tokens than the context the settings give, and the engine
    was asked not to lower its ``max_model_len`` to it (``LLMEngine(lower_context=False)``).
    ``held``: the tokens the KV cache holds; ``wanted``: the context."""

    def __init__(self, held: int, wanted: int, why: str) -> None:
        super().__init__(f"max_model_len {wanted} is more than {why}")
        self.held, self.wanted = held, wanted


class LLMEngine:
    """One engine replica: the model, its KV cache, the scheduler and the tokenizer."""

    def __init__(
        self,
        config: EngineConfig,
        proposer: DraftProposer | None = None,
        *,
        lower_context: bool = True,
    ) -> None:
        """Load the model and size the KV cache; where the cache holds less than the context
        (``max_model_len``, else the model's), lower the context to it with a warning, or,
        without ``lower_context``, raise ContextCutError before the cache is allocated (a
        caller that refuses to run then had the warning of a lowering that never ran, and
        waited for a KV cache and CUDA graphs it did not use). ``proposer`` gives decode
        rows draft tokens on every step (multi-token steps, see core/drafts.py); None: the one
        ``config.speculative`` names, if any, drafting on every step (a method by name) or
        where the goodput policy expects it to pay (``auto``). Drafted steps of fewer than
        ``draft_ahead_below`` rows keep async scheduling where the proposer drafts ahead
        (``PredictsAhead``) and the attention backend's decode path takes its 1 + k tokens;
        else they run synchronously."""
        self.config = config
        self._closed = False
        # What an exception raised mid-step (the state it left is part-updated), until
        # ``cut_short`` starts afresh: ``step`` refuses meanwhile.
        self._torn: str | None = None
        self.policy: SpeculationPolicy | None = None
        # Drafted steps of fewer running rows than this draft ahead (async) where they can;
        # larger ones run synchronously. On the H200 (SmolLM2, k = 4, BENCHMARKS session
        # 24) drafting ahead won at 1 row (ngram 1.26x of off vs 1.11x synchronous) and lost
        # from 8 rows on (auto 1.06x vs 1.36x at 8, ngram 0.81x vs 0.91x at 64): its drafts
        # are a step older, so fewer are accepted and more compute is wasted.
        self.draft_ahead_below = 8
        # Greedy constrained rows of a drafted step processed before the next is scheduled
        # leave their masks after drafts open where they can (grammar_drafts.py: a half to
        # a third of a drafted row's grammar work on a JSON schema, BENCHMARKS session 57);
        # False fills every one (a benchmark's A/B).
        self.leave_draft_masks_open = True
        self._processed_now = False  # whether the step being launched is processed at once
        auto = proposer is None and config.speculative.method == "auto"
        if proposer is None:
            proposer = build_proposer(config.speculative)
        if config.speculative.method == "lookahead" and config.max_num_seqs > LOOKAHEAD_ROWS:
            log.warning(
                "speculative.method lookahead with max_num_seqs %d: each row's step carries "
                "its whole tree of drafts (tens of tokens), which costs the GPU at hundreds "
                "of rows; it is for batches of up to %d (suffix or auto fit larger)",
                config.max_num_seqs,
                LOOKAHEAD_ROWS,
            )
        self._learner = proposer if isinstance(proposer, LearnsFromOutputs) else None
        if config.load_format == "random":
            source = None
            self.model_config = load_hf_config(Path(config.model))  # config.json alone
            self.tokenizer = None
            model_path = config.model
        else:
            source = resolve_model_source(config.model)
            self.model_config = source.load_config()
            self.tokenizer = source.load_tokenizer()
            model_path = str(source.path)
        self.model_path = model_path  # the resolved file or folder (an alias's GGUF file)
        self.device = config.resolve_device()
        async_scheduling = config.resolve_async_scheduling(self.device)
        if auto:
            # Synchronous steps lose no overlap by drafting: probe drafting more often.
            self.policy = SpeculationPolicy(
                probe_drafts_every=50 if async_scheduling else 10, max_drafts=proposer.max_drafts
            )
        self.dtype = config.resolve_dtype(self.model_config, self.device)
        mc = self.model_config
        max_len, self._max_len_why = context_limit(mc)
        if config.max_model_len is not None and config.max_model_len > max_len:
            log.warning(
                "max_model_len %d lowered to %d: %s", config.max_model_len, max_len,
                self._max_len_why,
            )  # fmt: skip
        elif config.max_model_len is not None:
            max_len, self._max_len_why = config.max_model_len, "as set"
        elif mc.sliding_window is not None and max_len == mc.sliding_window:
            log.warning("max_model_len %d: %s", max_len, self._max_len_why)
        check_slots_fit(
            config.max_num_seqs,
            max_len,
            host_logits_vocab=mc.vocab_size if self.device.type == "cpu" else 0,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        backend_name = config.attention_backend
        if backend_name == "auto":
            backend_name = default_backend_name(self.device, mc.head_dim)
        check_backend_takes(backend_name, mc.head_dim)
        # One rank of one today; the layers, the KV cache and the runner take their rank's
        # share of the heads from it.
        parallel = ParallelConfig()
        num_kv_heads = parallel.per_rank(mc.num_key_value_heads, "num_key_value_heads")
        backend = get_attention_backend(backend_name, num_kv_heads)
        # A quantized checkpoint (FP8, GPTQ, AWQ) runs as it is, whatever was asked for.
        quantization = layer_quantization(mc.quantization, config.quantization)
        native = quantization if quantization in NATIVE_TYPES else None  # GGUF blocks as they are
        model = build_model(
            mc,
            backend,
            max_len,
            self.device,
            self.dtype,
            None if source is None else source.iter_weights(native),
            source=model_path,
            seed=config.seed,
            parallel=parallel,
            quantization=quantization,
        )

        # An FP8 KV cache holds e4m3 values (kernels/fp8_kv.py): twice the blocks.
        kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else self.dtype
        block_bytes = kv_bytes_per_block(mc, backend, config.block_size, kv_dtype, parallel)
        # The decode workspace at the longest request the settings allow: the KV cache's
        # size can only lower that length.
        workspace = self._attention_workspace(backend, max_len, proposer, parallel)
        activations = activation_reserve(
            mc, self.dtype, config.max_num_batched_tokens, config.max_num_seqs
        )
        reserve = activations.nbytes + workspace
        budget = config.kv_cache_budget(self.device, reserve, activations.why())
        num_blocks = budget // block_bytes
        if config.kv_cache_memory is None and self.device.type == "cpu":
            # The 2 GiB default is zeroed at start: a small model would hold far more blocks
            # than it could use. Twice what max_num_seqs requests of full length hold is room
            # for them and for cached prefixes.
            num_blocks = min(num_blocks, 2 * config.max_num_seqs * -(-max_len // config.block_size))
        if num_blocks < 2:  # the setting's fault, not the model's: named as the setting
            raise EngineSettingError(
                "kv_cache_memory",
                config.kv_cache_memory,
                f"room for at least 2 KV blocks of {block_bytes} bytes (it leaves room for "
                f"{max(num_blocks, 0)}: raise it, or lower block_size"
                + _reserve_hint(config, self.device, budget, reserve, block_bytes, activations)
                + ")"
                + _gpu_use_hint(self.device),
            )
        self.max_model_len = min(max_len, num_blocks * config.block_size)
        if self.max_model_len < max_len:
            self._max_len_why = (
                f"all the KV cache holds ({num_blocks} blocks of {config.block_size} tokens; "
                "raise kv_cache_memory for longer sequences)"
            )
            if not lower_context:
                del model  # (the exception's frames would hold its weights while it lives)
                raise ContextCutError(self.max_model_len, max_len, self._max_len_why)
            log.warning("max_model_len %d lowered to %d: %s", max_len, self.max_model_len,
                        self._max_len_why)  # fmt: skip
        self.runner = ModelRunner(
            model,
            mc,
            backend,
            self.device,
            self.dtype,
            num_blocks,
            config.block_size,
            seed=config.seed,
            parallel=parallel,
            kv_dtype=kv_dtype,
        )
        backend.set_engine_limits(self.max_model_len, config.max_num_seqs, self.device)
        self.runner.profiler.enabled = config.profile_steps
        if config.cuda_graphs:
            self.runner.enable_cuda_graphs(
                config.max_num_seqs,
                self.max_model_len,
                max_drafts=0 if proposer is None else proposer.max_drafts,
                trees=getattr(proposer, "makes_trees", False),
                max_num_batched_tokens=config.max_num_batched_tokens,
            )
        kv = KVCacheManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            extra_keys=(model_path,),
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                self.max_model_len,
                async_scheduling=async_scheduling,
                # Few, large prefilling steps between graph-replayed decode steps.
                admit_batch=max(1, config.max_num_seqs // 8) if self.runner.graphs else 1,
                drafts_ahead=(
                    async_scheduling
                    and isinstance(proposer, PredictsAhead)
                    and 1 + proposer.max_drafts <= backend.max_decode_query_len
                ),
                constrained_drafts=not auto,
            ),
            kv,
            proposer,
        )
        eos = set(mc.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = tuple(sorted(eos))
        self._tracked: dict[str, _Tracked] = {}
        self._watched: dict[str, _Tracked] = {}  # the tracked ones with a detokenizer
        # Grammars of the requests with structured_output (llguidance loads on the first).
        processes = config.structured_output_processes
        self._grammars = StructuredOutputs(
            self.tokenizer,
            mc.vocab_size,
            self.eos_token_ids,
            self.device,
            config.structured_output_backend,
            auto_processes(self.device.type) if processes is None else processes,
            fallback=processes is None,
        )
        # The last step processed inside the next one's launch (``_token_bitmask``).
        self._processed_early: LaunchedStep | None = None
        self._fed: LaunchedStep | None = None  # the last step whose tokens the grammars have
        # slot -> drafts its row accepted in the step fed last (``_drafts_of``), and request
        # id -> its output's length before the drafted step fed last (``_end_grammars``)
        self._accepted_ahead: dict[int, int] = {}
        self._fed_from: dict[str, int] = {}
        self._launch_wait_ms = 0.0  # of the current launch, blocked on the step in flight
        self._num_sync_steps = 0  # steps launched and processed in one call
        # Requests with prompt_logprobs: their prompt positions' logits (prompt_logprobs.py).
        self._prompt_logprobs = PromptLogprobs(config.block_size)
        # Async scheduling: the step launched by the last ``step`` call, processed by the next.
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None
        # With grammars, the next step, scheduled and flattened while the masks of the one
        # being launched filled (``_while_masks_fill``): the next ``step`` call launches it.
        # Requests aborted since it was scheduled have no grammar left to mask their rows.
        self._ahead: tuple[SchedulerOutput, PreparedStep | None] | None = None
        self._aborted_ahead: set[str] = set()
        self._arrivals = 0
        # Steps the policy has timed, until they are processed (what they accepted).
        self._unscored: deque[tuple[StepSample, LaunchedStep]] = deque()
        self._last_sync = 0  # rows of the last step launched if it ran synchronously, else 0
        self._outputs = OutputBuilder(self.tokenizer, self.scheduler.config.async_scheduling)
        log.info(
            "engine ready: %s on %s (%s), linear layers %s, %d KV blocks x %d tokens%s, "
            "max_model_len %d",
            Path(model_path).name,
            self.device,
            self.dtype,
            _linear_weights(source, quantization, self.dtype),
            num_blocks,
            config.block_size,
            " (fp8)" if config.kv_cache_dtype == "fp8" else "",
            self.max_model_len,
        )

    def _attention_workspace(
        self,
        backend: AttentionBackend,
        max_model_len: int,
        proposer: DraftProposer | None,
        parallel: ParallelConfig,
    ) -> int:
        # Bytes of the attention backend's scratch at the engine's limits: every row a
        # decode row, each with its drafts as far as the decode path takes them (longer
        # rows go to the prefill kernel).
        drafts = 0 if proposer is None else proposer.max_drafts
        query_len = min(1 + drafts, backend.max_decode_query_len)
        mc = self.model_config
        return backend.workspace_bytes(
            max_model_len,
            self.config.max_num_seqs * query_len,
            parallel.per_rank(mc.num_attention_heads, "num_attention_heads"),
            mc.head_dim,
        )

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        """Queue a request (its prompt cut to its last ``params.truncate_prompt_tokens``
        tokens when set). Raises ValueError (the request is not queued) when the prompt is
        empty, holds ids outside the vocabulary, or leaves no room in the context, and when
        ``params`` asks for more than one completion (LLM expands n / best_of into requests),
        biases ids outside the vocabulary (``logit_bias``) or its ``structured_output`` does
        not compile for this model's tokenizer; TypeError when ``params`` is not a
        SamplingParams (None included: vLLM's ``add_request`` takes no default either, and
        a forgotten one run as ``SamplingParams()``, 16 tokens, would cut outputs short)."""
        self._check_open()
        if not isinstance(params, SamplingParams):
            raise TypeError(
                f"add_request's params must be a SamplingParams, got {type(params).__name__}: "
                "pass SamplingParams() for the defaults"
            )
        if params.num_samples != 1:
            raise ValueError(
                f"an engine request makes one completion: SamplingParams n={params.n}, "
                f"best_of={params.best_of} must be 1 here; LLM.generate / LLM.chat expand them"
            )
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in flight")
        keep = params.truncate_prompt_tokens
        if keep is not None:  # vLLM's left truncation; -1: what the context leaves room for
            prompt_token_ids = prompt_token_ids[-(self.max_model_len - 1 if keep == -1 else keep) :]
        check_prompt_ids(prompt_token_ids, self.model_config.vocab_size)
        check_vocab_ids(params, self.model_config.vocab_size)
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens; the engine's max_model_len is "
                f"{self.max_model_len} ({self._max_len_why}), leaving no room to generate"
            )
        req = Request(
            request_id,
            list(prompt_token_ids),
            params,
            eos_token_ids=self.eos_token_ids,
            arrival_index=self._arrivals,
        )
        watch = self.tokenizer is not None and bool(params.stop)
        tracked = _Tracked(
            req,
            IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params) if watch else None,
            [] if params.logprobs is not None else None,
        )
        if params.structured_output is not None:
            self._grammars.add(req)  # first: a grammar that fails leaves nothing queued
        try:
            if params.prompt_logprobs is not None:
                self._prompt_logprobs.add(req)
            self._tracked[request_id] = tracked
            if watch:
                self._watched[request_id] = tracked
            # Last: a request the scheduler has is tracked (an interrupt before this line
            # leaves none of it behind; a step that finished an untracked one raised).
            self.scheduler.add_request(req)
        except BaseException:
            self.abort_requests([request_id])
            raise
        self._arrivals += 1

    def has_unfinished(self) -> bool:
        return (
            self.scheduler.has_unfinished()
            or self._in_flight is not None
            or self._ahead is not None  # launched even when all its requests were aborted
            or self._outputs.pending
        )

    @property
    def num_unfinished_output_tokens(self) -> int:
        """Output tokens generated so far by the requests that have not finished (waiting,
        running or preempted). Read-only; O(requests in flight): for progress reports, not
        for every step."""
        return sum(t.request.num_output_tokens for t in self._tracked.values())

    def unfinished_output_tokens(self) -> dict[str, int]:
        """{request id: output tokens generated so far} of the requests that have not
        finished; O(requests), like ``num_unfinished_output_tokens``."""
        return {rid: t.request.num_output_tokens for rid, t in self._tracked.items()}

    def close(self) -> None:
        """Stop the output worker (outputs not collected yet are dropped) and the grammars'
        workers. The engine takes no requests and runs no steps after it; closing twice
        is fine."""
        self.stop()
        self._outputs.close()
        self._grammars.close()
        if self._learner is not None:
            self._learner.close()

    def stop(self) -> None:
        """Refuse every later step and request (the closed engine's error) and release
        nothing yet: a step loop in another thread stops at its next step; ``close``
        releases once it has."""
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                "this engine was closed (LLMEngine.close / LLM.close): make a new LLM to "
                "generate again"
            )

    def cut_short(self, request_ids: list[str]) -> None:
        """A call was cut short inside ``step`` (Ctrl-C, an error) and its requests go: wait
        for the grammars' background work, abort ``request_ids``, and, when no other request
        is left, forget every request and step (``_start_afresh``), so that the next call
        runs as on a fresh engine (the interrupt may have landed between any two updates:
        the runner then refused every later launch, a half-sent message left the grammar
        workers out of step, the prefix cache held blocks without their KV)."""
        # (a second interrupt, landing in the cleanup, skips none of it)
        try:
            self._grammars.settle()
        finally:
            try:
                self.abort_requests(request_ids)
            finally:
                if not self.scheduler.has_unfinished():
                    self._start_afresh()

    def _start_afresh(self) -> None:
        """Forget every request and step (no request is left), as on a fresh engine. First
        the scheduler's queues, batch slots and KV blocks, the prefix cache with them: a
        prompt's full blocks enter the cache when its step is scheduled, before the forward
        pass writes their KV, so the step a cut landed in, or one scheduled ahead and never
        launched, left cached blocks holding none of it (the next call's hits computed from
        garbage); and an interrupt inside the scheduler's own update may have left a slot or
        blocks held by no queued request."""
        self.scheduler.clear()
        self._tracked.clear()
        self._watched.clear()
        self._prompt_logprobs.clear()
        self._in_flight = self._ahead = self._processed_early = self._fed = None
        self._torn = None
        self._aborted_ahead = set()
        self._unscored.clear()
        self._last_sync = 0
        self.runner.forget_launches()
        self._grammars.reset()
        self._outputs.collect(wait=True)  # the aborted requests' (dropped)

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (vLLM's ``llm.llm_engine.get_tokenizer()``); None with
        ``load_format='random'``, which loads none."""
        return self.tokenizer

    def abort_requests(self, request_ids: list[str]) -> None:
        """Drop requests (finished or not) and free their KV blocks; nothing is returned.
        Also after ``close`` (a release, as a second close is): a call stopped by a close
        in another thread aborts its requests after it (``cut_short``), and cleanup code
        aborting after a close in a finally block would else hide the error it handles."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self._outputs.drop(request_ids)
        for rid in request_ids:
            self._tracked.pop(rid, None)
            self._watched.pop(rid, None)
        self._grammars.drop(request_ids)
        self._prompt_logprobs.drop(request_ids)
        if self._ahead is not None:
            self._aborted_ahead.update(request_ids)

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return the outputs of requests that finished.

        With async scheduling the step launched here is processed by the next call, and the
        outputs of its finished requests are built on a worker thread: they come one or more
        calls later, and ``has_unfinished`` stays True until they have.

        Raises RuntimeError when an earlier call raised inside its step (its scheduler,
        runner and grammar state are then part-updated: each later step raised an error
        naming some other cause, such as a KV cache too small), until ``cut_short`` is
        given the requests in flight."""
        self._check_open()
        if self._torn is not None:
            raise RuntimeError(
                f"an earlier LLMEngine.step raised ({self._torn}) and left its requests "
                "part-updated: call cut_short with the ids of the requests in flight (they "
                "are aborted and the engine starts afresh), or make a new engine"
            )
        try:
            wait = self._step()
        except BaseException as exc:
            self._torn = f"{type(exc).__name__}: {exc}"
            raise
        if wait is None:  # (nothing changed: aborting the waiting prompt is enough)
            raise RuntimeError(
                "the scheduler could not schedule any request: the KV cache is too small for "
                "the waiting prompt"
            )
        return self._outputs.collect(wait=wait)

    def _step(self) -> bool | None:
        """``step`` up to collecting the outputs: whether to wait for all of them; None
        when nothing could be scheduled while requests wait."""
        # A step scheduled ahead (``_while_masks_fill``) was decided plain there.
        draft = self._ahead is None and self._wants_drafts()
        # Unless drafted ahead, a drafted row's inputs need every earlier token on the host:
        # such steps run synchronously. (A constrained row's mask needs them too, but only
        # once the forward pass is enqueued: ``_token_bitmask`` waits for them there.)
        drafts_ahead = (
            self.scheduler.config.drafts_ahead
            and self.scheduler.num_running < self.draft_ahead_below
        )
        sync = draft and not drafts_ahead
        self._processed_now = sync or not self.scheduler.config.async_scheduling
        switch_in_ms = 0.0
        if sync and self._in_flight is not None:
            # Finish the step in flight first (its host time is that step's; the synchronous
            # step's own time starts after it; the policy counts this processing, which
            # async steps overlap with the device's work, as the switch's cost).
            switch_in_ms = self._process(*self._in_flight)
            self.runner.profiler.add_host_ms(switch_in_ms)
            self._in_flight = None
        t0 = time.perf_counter()
        scheduled, self._ahead = self._ahead, None
        aborted, self._aborted_ahead = self._aborted_ahead, set()  # of that step's requests
        if scheduled is None:
            sched, prepared = self.scheduler.schedule(draft=draft, ahead=drafts_ahead), None
        else:  # scheduled (and its time counted) in the last launch
            sched, prepared = scheduled
        host_ms = (time.perf_counter() - t0) * 1e3
        if sched.is_empty and self._in_flight is None:
            return None if self.scheduler.has_unfinished() else True
        launched = None
        if not sched.is_empty:
            # Only while a request has prompt positions left to score.
            plan = self._prompt_logprobs.plan if self._prompt_logprobs.pending else None
            self._launch_wait_ms = 0.0
            step = prepared or sched
            # Rows with a grammar mask their logits; rows of requests aborted after this
            # step was scheduled ahead still hold theirs (no grammar left: every token).
            if len(self._grammars) or aborted:
                masks = functools.partial(self._token_bitmask, aborted=aborted)
                launched = (sched, self.runner.launch(step, masks, plan))
            else:
                launched = (sched, self.runner.launch(step, prompt_logits=plan))
            # The launch's host time counts none of its wait for the step in flight.
            host_ms -= self._launch_wait_ms
        mine = launched
        if self.scheduler.config.async_scheduling and not sync:
            launched, self._in_flight = self._in_flight, launched
        elif launched is not None:
            self._num_sync_steps += 1
        if launched is not None and launched[1] is not self._processed_early:
            host_ms += self._process(*launched)  # (else the launch's host time counted it)
        self.runner.profiler.add_host_ms(host_ms)
        # The call's wall time is a step's when it ran one whole (synchronous) or processed
        # the decode step launched before this one (async). An async call right after a
        # synchronous step timed only its own launch, with the device idle: a cost of the
        # drafted step before it, not a plain step's time. Prefills would skew the times.
        wall_ms = (time.perf_counter() - t0) * 1e3
        after_sync = self._last_sync
        if mine is not None:
            self._last_sync = sched.num_rows if sync else 0
        if self.policy is not None and mine is not None and sched.decode_only:
            timed = sync or not self.scheduler.config.async_scheduling
            timed = timed or (launched is not None and launched[0].decode_only)
            if timed:
                # The drafts it accepted are known once it is processed: this call
                # (synchronous) or the next.
                sample = StepSample(
                    batch=sched.num_rows,
                    drafted=draft,
                    wall_ms=wall_ms,
                    drafted_rows=int(np.count_nonzero(sched.drafts)),
                    switch_ms=switch_in_ms,
                )
                self._unscored.append((sample, mine[1]))
            elif after_sync and launched is None:
                self.policy.charge_switch_back(after_sync, wall_ms)
        while self._unscored and self._unscored[0][1].accepted is not None:
            sample, step = self._unscored.popleft()
            self.policy.record(dataclasses.replace(sample, accepted=step.accepted))
        return not self.scheduler.has_unfinished() and self._in_flight is None

    def _wants_drafts(self) -> bool:
        """Whether this step gives decode rows drafts: never while no running row may take
        any (all ask for logprobs); always with a proposer and no policy; else as the policy
        says for the running batch (and, once nothing waits, for its slowest row)."""
        scheduler = self.scheduler
        if scheduler.proposer is None:
            return False
        running = scheduler.num_running
        if running == 0:
            return False
        if self.policy is not None:
            slowest = None if scheduler.waiting else scheduler.slowest_yield()
            if not self.policy.wants_drafts(running, slowest):
                return False
        # Asked last: it reads every running row's settings (~5 us at 256 rows, CPU), and
        # most of auto's steps are decided plain before it.
        return scheduler.can_draft()

    def _token_bitmask(
        self,
        requests: Sequence[Request],
        slots: np.ndarray,
        drafts: np.ndarray,
        aborted: set[str] | None = None,
    ) -> np.ndarray:
        """The grammar masks of a step's constrained rows (``ModelRunner.launch`` calls it
        once the step's forward pass is enqueued): 1 + drafts[i] for request i (in slot
        ``slots[i]``), after its output and after each of its drafts. With a step in flight
        (async scheduling), its tokens are waited for and fed to the grammars first: the
        masks follow them. Rows of the ``aborted`` requests (aborted after their step was
        scheduled ahead) allow every token: their grammars are gone, their tokens dropped."""
        if not aborted:
            return self._live_bitmask(requests, slots, drafts)
        keep = np.array([r.request_id not in aborted for r in requests], dtype=bool)
        masks = np.full((len(requests) + int(drafts.sum()), self._grammars.words), -1, np.int32)
        if keep.any():  # (else the step in flight is fed when it is processed)
            rows = np.repeat(keep, drafts + 1)
            masks[rows] = self._live_bitmask(
                np.asarray(requests, dtype=object)[keep], slots[keep], drafts[keep]
            )
        return masks

    def _live_bitmask(
        self, requests: Sequence[Request], slots: np.ndarray, drafts: np.ndarray
    ) -> np.ndarray:
        """``_token_bitmask`` of rows whose requests all have their grammar."""
        if self._in_flight is None:
            return self._grammars.bitmask(
                requests,
                drafts=self._drafts_of(slots, drafts),
                slots=slots,
                open_rows=self._open_rows(requests, slots, drafts),
            )
        sched, launched = self._in_flight
        t0 = time.perf_counter()
        launched.output()  # the wait, timed by the step itself
        self._launch_wait_ms += (time.perf_counter() - t0) * 1e3
        self._feed_grammars(sched, launched)
        # The step in flight is processed, and the next one scheduled, while the grammars
        # fill the masks: the sampling metadata has read every row's settings by now.
        masks = self._grammars.bitmask(
            requests,
            beside=lambda: self._while_masks_fill(sched, launched),
            drafts=self._drafts_of(slots, drafts),
            slots=slots,
        )
        self._processed_early = launched
        return masks

    def _open_rows(
        self, requests: Sequence[Request], slots: np.ndarray, drafts: np.ndarray
    ) -> np.ndarray | None:
        """[G] bool: the drafted constrained rows whose masks after drafts may be left open
        (grammar_drafts.py), or None for none: only where the step is processed before the
        next is scheduled (a token dropped there is no later step's input yet), and only
        greedy rows without logprobs (an open argmax is the masked one where allowed; a
        distribution is not), without stop strings or stop ids (a token dropped after it
        ended the output would leave it ended), and with room for every token of the step
        before max_tokens or the context (likewise)."""
        if not (self.leave_draft_masks_open and self._processed_now and drafts.any()):
            return None
        if not self._grammars.leaves_masks_open:
            return None
        columns = self.scheduler.slots.sampling.columns
        eligible = (drafts > 0) & columns["greedy"][slots]
        eligible &= columns["logprobs"][slots] == NO_LOGPROBS
        max_len = self.scheduler.config.max_model_len
        for i in np.flatnonzero(eligible).tolist():
            req, room = requests[i], 1 + int(drafts[i])  # the most tokens the step gives it
            params = req.sampling_params
            limit = params.max_tokens if params.max_tokens is not None else max_len
            eligible[i] = not (
                req.request_id in self._watched
                or params.stop_token_ids
                or req.num_output_tokens + room >= limit
                or req.num_tokens + room >= max_len
            )
        return eligible if eligible.any() else None

    def _drafts_of(
        self, slots: np.ndarray, counts: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The drafts the step being launched gives its constrained rows (constrained_drafts
        .py), for their masks to walk."""
        return step_drafts(self.scheduler.slots, slots, counts, self._accepted_ahead)

    def _while_masks_fill(self, sched: SchedulerOutput, launched: LaunchedStep) -> None:
        """Host work done while the grammars fill the masks of the step being launched:
        process the step in flight (``launched``); then, if the masks are still not in,
        schedule the next step and flatten it, so that the next ``step`` call enqueues its
        forward pass right behind this step's sampling instead of leaving the device idle
        meanwhile. Once the masks are in, the sampling goes to the device first and the
        next ``step`` call schedules as usual: scheduling ahead then only held the sampling
        back (the host's work is the same either way). With a proposer only when the next
        step will not draft (decided here, from the state now; ``step`` then takes it as it
        is): a drafted step is scheduled when it is launched, its drafts from the state
        then. (``auto`` on a batch of constrained rows, which take no drafts, had lost this
        overlap: 0.3 ms more host a step on an H100, BENCHMARKS.md session 52.)"""
        self._process(sched, launched)
        if self._grammars.masks_in():
            return
        if self.scheduler.proposer is not None and self._wants_drafts():
            return
        ahead = self.scheduler.schedule(draft=False)
        self._ahead = (ahead, None if ahead.is_empty else self.runner.prepare(ahead))

    def _feed_grammars(self, sched: SchedulerOutput, launched: LaunchedStep) -> None:
        """Give a step's kept tokens to the grammars of its constrained rows, once per step
        and before the scheduler applies them (structured_output.py says why then): one
        token a row, or a drafted row's accepted drafts and the token after them (the
        accepted counts are kept for the drafts of the step scheduled ahead of it:
        ``_drafts_of``)."""
        if launched is self._fed or not len(self._grammars):
            return
        self._fed = launched
        out = launched.output()
        if not len(out.rows):
            return
        self._accepted_ahead, self._fed_from = {}, {}
        slots = sched.slots[out.rows]
        if int(out.counts.max()) == 1:  # no row drafted: one token each
            self._grammars.feed(sched.requests[out.rows], out.sampled_token_ids, slots=slots)
            return
        mine = np.flatnonzero(self.scheduler.slots.sampling.columns["structured"][slots])
        if not len(mine):
            return
        rows = run_entries(out.counts, mine)
        kept, tokens, accepted = kept_tokens(
            self.scheduler.slots, slots[mine], out.sampled_token_ids[rows], out.counts[mine]
        )
        self._accepted_ahead = dict(zip(slots[mine].tolist(), accepted.tolist(), strict=True))
        requests = sched.requests[out.rows[mine]]
        for req in requests[kept > 1]:  # where ``_end_grammars`` may cut its output
            self._fed_from[req.request_id] = req.num_output_tokens
        self._grammars.feed(requests, tokens, kept, slots=slots[mine])

    def _process(self, sched: SchedulerOutput, launched: LaunchedStep) -> float:
        """Apply a step's sampled tokens and hand its finished requests on; return the host
        ms spent (not counting the wait for the device)."""
        out = launched.output()
        t0 = time.perf_counter()
        self.runner.profiler.add_wait_ms(launched.wait_ms)
        if launched.prompt_logprobs is not None:  # before a request it ends is handed on
            self._prompt_logprobs.record(launched.prompt_logprobs)
        self._feed_grammars(sched, launched)
        accepted = self.scheduler.stats.num_accepted_tokens
        update = self.scheduler.update_from_output(
            sched, out.rows, out.sampled_token_ids, out.counts
        )
        finished = update.finished
        if out.sampler_output is not None and out.sampler_output.logprobs is not None:
            self._record_logprobs(sched, out, update.applied)
        if self._watched:
            finished += self._check_stop_strings()
        # (after the stop strings: drafts past the token that completed one are not counted)
        launched.accepted = self.scheduler.stats.num_accepted_tokens - accepted
        if len(self._grammars):
            finished += self._end_grammars()
        self._finish(finished)
        return (time.perf_counter() - t0) * 1e3

    def _check_stop_strings(self) -> list[Request]:
        """Give the watched requests' new tokens to their detokenizers; finish the ones whose
        text now holds a stop string and return them (ones already finished are relabelled)."""
        stopped: list[str] = []
        for rid, tracked in self._watched.items():
            req, detokenizer = tracked.request, tracked.detokenizer
            if detokenizer is None or req.num_output_tokens == tracked.num_detokenized:
                continue
            new = req.output_token_ids[tracked.num_detokenized :]
            tracked.num_detokenized += len(new)
            if req.finished and req.stop_token_hidden:
                new = new[:-1]  # the stop token's text is not output (nor searched)
            match = detokenizer.append(new)
            if match is None:
                continue
            # a drafted step's tokens after the one that completed the stop string go, and
            # the drafts among them were not accepted (they saved no step)
            req.truncate_output(len(detokenizer.output_token_ids))
            self.scheduler.uncount_accepted(req, tracked.num_detokenized - req.num_output_tokens)
            tracked.num_detokenized = req.num_output_tokens
            req.stop_reason = match
            if req.finished:
                req.status = RequestStatus.FINISHED_STOPPED
            else:
                stopped.append(rid)
        if not stopped:
            return []
        requests = [self._tracked[rid].request for rid in stopped]
        self.scheduler.finish(requests, RequestStatus.FINISHED_STOPPED)
        return requests

    def _end_grammars(self) -> list[Request]:
        """Finish the requests whose grammar the fed tokens completed, "stop", or that
        rejected one, "error" (the output does not follow the constraint: it is never passed
        off as complete), and return them. Those the step already ended keep their ending,
        except that one cut by its length on the token that completed its output stopped,
        and one whose last token was rejected failed."""
        done: dict[RequestStatus, list[Request]] = {}
        for rid in self._grammars.take_ended():
            tracked = self._tracked[rid]
            req, why = tracked.request, self._grammars.rejection(rid)
            took = self._grammars.took(rid)
            kept = None if took is None else self._fed_from[rid] + took
            if kept is not None and kept > req.num_output_tokens and req.finished:
                # the token that ended the grammar came after a stop string or stop token
                # had ended the output: token-by-token decoding never sampled it
                continue
            if kept is not None and kept < req.num_output_tokens:
                # a drafted step kept tokens after the one that ended the grammar: they
                # saved no step either
                self.scheduler.uncount_accepted(req, req.num_output_tokens - kept)
                req.truncate_output(kept)
                req.stop_reason = None
                if tracked.detokenizer is not None and tracked.num_detokenized > kept:
                    # its text holds the cut tokens: decode the kept ones afresh
                    tracked.detokenizer = IncrementalDetokenizer(
                        self.tokenizer, req.prompt_token_ids, req.sampling_params
                    )
                    tracked.detokenizer.append(req.output_token_ids)
                    tracked.num_detokenized = kept
            if why is not None:
                req.error = f"structured output: the grammar rejected a sampled token ({why})"
            status = RequestStatus.FINISHED_STOPPED if why is None else RequestStatus.FINISHED_ERROR
            if not req.finished:
                done.setdefault(status, []).append(req)
            elif why is not None or req.status is RequestStatus.FINISHED_LENGTH:
                req.status = status
        for rid in self._grammars.take_dropped():
            # sampled where its mask was left open, and not what the mask would have let
            # through: the next step samples its position again under a filled mask
            req = self._tracked[rid].request
            if req.finished:  # (_open_rows leaves no way to: never passed off as complete)
                req.error = "structured output: a token sampled without its mask was refused"
                req.status = RequestStatus.FINISHED_ERROR
                continue
            req.retract_output_token()
        for status, reqs in done.items():
            self.scheduler.finish(reqs, status)
        return [req for reqs in done.values() for req in reqs]

    def reset_step_profile(self) -> None:
        """Start ``step_profile`` afresh (a benchmark calls it after its warm-up)."""
        self.runner.profiler.records.clear()
        self._num_sync_steps = 0
        self._grammars.stats = GrammarStats()

    def step_profile(self) -> dict:
        """Mean per-step CPU and GPU ms (needs ``profile_steps=True``); see step_profile.py.
        Also ``synchronous_steps`` (counted whether profiled or not), with
        structured output ``structured_output`` (grammar mask and feed ms per step, and the
        grammar worker processes, 0 when the grammars are in the engine's process), and with
        a proposer ``speculative``: its draft and acceptance counts."""
        profile = self.runner.profiler.summary()
        # Steps that did not overlap the next one's scheduling (all without async scheduling).
        profile["synchronous_steps"] = self._num_sync_steps
        if self._grammars.stats.masks:
            profile["structured_output"] = self._grammars.stats.summary()
            profile["structured_output"]["processes"] = self._grammars.processes
        if self.scheduler.proposer is not None:
            profile["speculative"] = self.scheduler.stats.speculative()
            if self.policy is not None:
                profile["speculative"]["policy"] = self.policy.estimates()
        return profile

    def _record_logprobs(
        self, sched: SchedulerOutput, out: ModelOutput, applied: np.ndarray
    ) -> None:
        """Append each applied row's logprobs to its request, if it asked for them."""
        lp = out.sampler_output.logprobs if out.sampler_output is not None else None
        if lp is None:
            return
        rows = lp.to_lists()
        first = np.cumsum(out.counts) - out.counts  # rows asking for logprobs take no drafts
        for i in np.flatnonzero(applied).tolist():
            tracked = self._tracked.get(sched.requests[out.rows[i]].request_id)
            if tracked is None or tracked.logprobs is None:
                continue
            n = tracked.request.sampling_params.logprobs or 0
            token_id, logprob, rank, top_ids, top_lps = rows[first[i]]
            tracked.logprobs.append(
                TokenLogprob(
                    token_id, logprob, rank, dict(zip(top_ids[:n], top_lps[:n], strict=True))
                )
            )

    def _finish(self, finished: list[Request]) -> None:
        """Hand ``finished`` requests to the output builder (their text is decoded there)."""
        if self._learner is not None and finished:
            t0 = time.perf_counter()
            self._learner.observe([req.output_token_ids for req in finished])
            self.scheduler.stats.observe_seconds += time.perf_counter() - t0
        items = []
        for req in finished:
            tracked = self._tracked.pop(req.request_id)
            self._watched.pop(req.request_id, None)
            prompt_lps = None
            if req.sampling_params.prompt_logprobs is not None:
                prompt_lps = self._prompt_logprobs.pop(req.request_id)
            items.append(Finished(req, tracked.detokenizer, tracked.logprobs, prompt_lps))
        if finished and len(self._grammars):
            # one call for them all: a drop's bookkeeping costs the same for one or many
            self._grammars.drop([req.request_id for req in finished])
        self._outputs.submit(items)


def _linear_weights(source: ModelSource | None, quantization: str, dtype: torch.dtype) -> str:
    """What the linear layers hold, for the start-up line; a GGUF file's blocks that are
    dequantized at load say so, and which setting would run them as they are."""
    kept = str(dtype).removeprefix("torch.")
    if quantization not in ("none", *NATIVE_TYPES) or source is None:
        return quantization if quantization != "none" else kept
    types = source.linear_weight_types()
    listed = "/".join(sorted(types))
    if quantization != "none":
        return f"{quantization} (the file's {listed} blocks as they are)"
    if not types & BLOCK_TYPES:
        return kept
    runs = next((m for m, native in NATIVE_TYPES.items() if types <= set(native)), None)
    hint = f"; quantization {runs} runs them as they are" if runs else ""
    return f"{kept} (the file's {listed} weights dequantized at load{hint})"


def _reserve_hint(
    config: EngineConfig,
    device: torch.device,
    budget: int,
    reserve: int,
    block_bytes: int,
    activations: ActivationReserve,
) -> str:
    """What the activation reserve took, when the KV cache would have had its 2 blocks
    without it (the settings behind it are what to lower, not only kv_cache_memory). A
    budget the reserve does not change (a byte count, the CPU's default) gets no hint."""
    without = config.kv_cache_budget(device)  # (this error's path only)
    if without == budget or without // block_bytes < 2:
        return ""
    return f"; {reserve / 2**30:.2f} GiB of it is held back for {activations.why()}"


def _gpu_use_hint(device: torch.device) -> str:
    """What holds the GPU when its share leaves no KV cache (another engine still alive in
    this process, or another process)."""
    if device.type != "cuda":
        return ""
    free, total = torch.cuda.mem_get_info(device)
    mine = torch.cuda.memory_allocated(device)
    return (
        f" (the GPU has {free / 2**30:.1f} of {total / 2**30:.1f} GiB free; this process "
        f"holds {mine / 2**30:.1f} GiB: close other engines or processes using it)"
    )
