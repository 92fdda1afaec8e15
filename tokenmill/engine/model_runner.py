"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

Per step it flattens the scheduled requests into a HostBatch (varlen arrays, see
host_batch.py), then either replays a captured CUDA graph (decode-only steps on the GPU) or
uploads the arrays and runs the model eagerly; logits only at the sampling rows; then samples.

``launch`` only enqueues: it returns a LaunchedStep whose tokens arrive later, so the engine
can schedule step n+1 while the GPU runs step n. Input tokens the host does not know yet
(sampled by the previous launch) are copied on the device from that launch's sampled tokens:

    step n:    sampled_n = sampler(...)                      [S_n] on the device
    step n+1:  input_ids[pending_rows] = sampled_n[pending_src]

After drafts, the row's kept token and its next step's position depend on what it
accepted, which the device works out right after sampling (sampled_rows.py).

``prepare`` builds a step's HostBatch ahead of its launch: from the moment a launch knows
which rows it samples (before its sampling is enqueued), the next step can be flattened
against them. The engine does so while grammar masks fill (llm_engine.py), so the next
forward pass is enqueued right behind this step's sampling.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.engine.attention.backend import AttentionBackend
from tokenmill.engine.attention.metadata import CommonAttentionMetadata
from tokenmill.engine.core.draft_tree import branch_drafts
from tokenmill.engine.core.request import Request
from tokenmill.engine.core.runs import within_runs
from tokenmill.engine.core.scheduler_output import SchedulerOutput
from tokenmill.engine.host_batch import HostBatch
from tokenmill.engine.launched_step import LaunchedStep
from tokenmill.engine.min_tokens import banned_stop_tokens
from tokenmill.engine.model_config import ModelConfig
from tokenmill.engine.model_output import ModelOutput
from tokenmill.engine.parallel import ParallelConfig
from tokenmill.engine.prompt_logprobs import PromptLogitsPlan, compute_prompt_logprobs
from tokenmill.engine.sampled_rows import (
    SampledRows,
    accept_arrays,
    sampled_rows,
    shift_arrays,
    shift_inputs,
)
from tokenmill.engine.sampler import Sampler
from tokenmill.engine.sampling_metadata import SamplingMetadata
from tokenmill.engine.sampling_reuse import SamplingReuse
from tokenmill.engine.seeds import generator_seed
from tokenmill.engine.step_profile import StepProfiler
from tokenmill.engine.upload_ring import UploadRing

__all__ = ["ModelOutput", "ModelRunner", "kv_bytes_per_block", "kv_cache_shape"]


@dataclass(frozen=True)
class PreparedStep:
    """A step flattened ahead of its launch (``ModelRunner.prepare``), against the sampled
    rows ``source`` of the launch before it (None: that launch samples nothing)."""

    sched: SchedulerOutput
    batch: HostBatch
    source: np.ndarray | None


def kv_cache_shape(
    config: ModelConfig,
    backend: AttentionBackend,
    num_blocks: int,
    block_size: int,
    parallel: ParallelConfig | None = None,
) -> tuple[int, ...]:
    """[layers, *the backend's layer layout] for this rank's share of the KV heads."""
    heads = (parallel or ParallelConfig()).per_rank(
        config.num_key_value_heads, "num_key_value_heads"
    )
    layer = backend.kv_cache_shape(num_blocks, block_size, heads, config.head_dim)
    return (config.num_hidden_layers, *layer)


def kv_bytes_per_block(
    config: ModelConfig,
    backend: AttentionBackend,
    block_size: int,
    dtype: torch.dtype,
    parallel: ParallelConfig | None = None,
) -> int:
    """Bytes of one KV block on this rank (its share of the KV heads), all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return math.prod(kv_cache_shape(config, backend, 1, block_size, parallel)) * elem


class ModelRunner:
    """Owns the model's weights, the paged KV cache tensors, and the sampler.

    ``parallel`` is this rank's place in the tensor-parallel group: the KV cache holds the
    rank's KV heads (the model was built with the same config). One rank of one today.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        backend: AttentionBackend,
        device: torch.device,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        seed: int = 0,
        parallel: ParallelConfig | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.parallel = parallel or ParallelConfig()
        self.model = model
        self.config = config
        self.backend = backend
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        # kv: [layers, *the backend's layout], e.g. [layers, 2, num_blocks, block_size, Hkv,
        # d]. Zeroed: masked-out slots are still multiplied by a zero weight, and garbage NaNs
        # would leak through.
        self.kv_cache = torch.zeros(
            kv_cache_shape(config, backend, num_blocks, block_size, self.parallel),
            dtype=kv_dtype or dtype,
            device=device,
        )
        self.kv_caches = list(self.kv_cache.unbind(0))
        self.sampler = Sampler()
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(generator_seed(seed, device.type))
        self.graphs = None  # a DecodeGraphRunner once enable_cuda_graphs() captured them
        self.pieces = None  # a PiecewiseGraphRunner (the other steps), likewise
        self.profiler = StepProfiler(device)
        self.uploads = UploadRing(device, depth=6)  # per step: inputs in one copy, sampling in one
        self._sampling_reuse = SamplingReuse(self.uploads)
        self._last: SampledRows | None = None
        # The sampled rows of the latest launch (its ``row_of_slot``), known before its
        # sampling is enqueued: what the next step's pending inputs are read from.
        self._source: np.ndarray | None = None

    def forget_launches(self) -> None:
        """Forget the last launch (no request is left that has a token pending from it): the
        next launch starts from the host's state alone."""
        self._last = self._source = None

    def enable_cuda_graphs(
        self,
        max_num_seqs: int,
        max_model_len: int,
        max_drafts: int = 0,
        trees: bool = False,
        max_num_batched_tokens: int = 0,
    ) -> None:
        """Capture decode-step graphs (CUDA and a backend with ``cuda_graphs`` only; a no-op
        elsewhere): for one token a request, and for 1 + ``max_drafts`` when a proposer gives
        drafts (as far as the backend's decode path takes them; longer rows run eagerly);
        with ``trees``, for steps whose rows carry trees of up to ``max_drafts`` drafts. With
        ``max_num_batched_tokens``, also the piecewise graphs that run every other step of up
        to that many tokens around eager attention (piecewise_graphs.py)."""
        if self.device.type != "cuda" or not self.backend.cuda_graphs:
            return
        from tokenmill.engine.cuda_graphs import DecodeGraphRunner
        from tokenmill.engine.piecewise_graphs import PiecewiseGraphRunner

        if max_num_batched_tokens:
            self.pieces = PiecewiseGraphRunner(
                self.model, self.backend, self.kv_caches, max_num_batched_tokens, self.device
            )
            self.pieces.capture()

        query_lens = (1,) if trees else (1, min(1 + max_drafts, self.backend.max_decode_query_len))

        self.graphs = DecodeGraphRunner(
            self.model,
            self.backend,
            self.kv_caches,
            max_num_seqs,
            max_model_len,
            self.block_size,
            self.device,
            query_lens,
            tree_size=1 + max_drafts if trees and max_drafts else 0,
        )
        self.graphs.capture()

    def prepare(self, sched: SchedulerOutput) -> PreparedStep:
        """Flatten ``sched`` now, for the launch right after the latest one: callable from
        the moment that launch knows its sampled rows (its ``token_bitmask`` call), so the
        host work is done while its forward pass runs. Raises as ``HostBatch.build``."""
        return PreparedStep(
            sched, HostBatch.build(sched, self.block_size, self._source), self._source
        )

    @torch.inference_mode()
    def launch(
        self,
        sched: SchedulerOutput | PreparedStep,
        token_bitmask: Callable[[Sequence[Request], np.ndarray, np.ndarray], np.ndarray]
        | None = None,
        prompt_logits: Callable[[SchedulerOutput, HostBatch], PromptLogitsPlan | None]
        | None = None,
    ) -> LaunchedStep:
        """Enqueue one step (forward, sampling, the copy of its tokens to the host).

        ``token_bitmask(requests, slots, drafts)`` gives the allowed-token bitmasks of the
        requests with a grammar (structured output), 1 + drafts[i] rows of ceil(V / 32)
        int32 for request i in its slot; it is called only when a row that samples has one,
        after the forward pass is enqueued. ``prompt_logits(sched, batch)``
        names the prompt positions to score for prompt logprobs (prompt_logprobs.py); a step
        with some runs eagerly and carries their scores in ``LaunchedStep.prompt_logprobs``.
        """
        t0 = time.perf_counter()
        prepared = sched if isinstance(sched, PreparedStep) else None
        if prepared is not None:
            sched = prepared.sched
        if sched.is_empty:
            return LaunchedStep.empty()
        last = self._last
        if last is not None and last.row_of_slot is not self._source:
            raise RuntimeError(
                "ModelRunner.launch: the previous launch stopped between knowing its sampled "
                "rows and sampling them (it raised); this runner cannot launch again"
            )
        if prepared is not None and prepared.source is self._source:
            batch = prepared.batch
        else:
            batch = HostBatch.build(sched, self.block_size, self._source)
        # The previous launch's sampled rows, where this step's pending inputs are (build
        # raised if some are pending and there is no previous launch)
        if not len(batch.pending_rows):
            last = None
        plan = None if prompt_logits is None else prompt_logits(sched, batch)
        scored = None  # plan's prompt logprobs
        kind = None if self.graphs is None or plan is not None else self.graphs.kind(batch)
        index_of = None if kind is None else self.graphs.layout(batch, kind)
        # Sent with the step's inputs: where to move rows behind a drafted step, and what
        # to check drafts with.
        shift = shift_arrays(batch, index_of, last)
        after = accept_arrays(batch, index_of)
        if kind is not None:
            self.profiler.begin(t0, batch, graph=True)
            hidden, pending, input_ids, after_d = self.graphs.run(
                batch, kind, self.uploads.upload_groups, last, dest=index_of, shift=shift,
                after=after,
            )  # fmt: skip
            logits = self.model.compute_logits(hidden)  # [N, V]
        else:
            piecewise = self.pieces is not None and self.pieces.fits(batch.num_tokens)
            self.profiler.begin(t0, batch, graph=piecewise)
            common, input_ids, positions, rows, pending, after_d = self._upload(
                batch, last, shift, after
            )
            attn_meta = self.backend.build(common)
            if piecewise:
                hidden = self.pieces.run(input_ids, positions, attn_meta)  # [T, H]
            else:
                hidden = self.model(input_ids, positions, self.kv_caches, attn_meta)  # [T, H]
            if plan is not None:
                scored = compute_prompt_logprobs(self.model, hidden, plan, self.config.vocab_size)
            if not len(batch.sample_rows):
                self._last = self._source = None
                self.profiler.end()
                empty = LaunchedStep.empty()
                empty.prompt_logprobs = scored
                return empty
            logits = self.model.compute_logits(hidden[rows])  # [S, V]
        table = sched.table
        slots = batch.sample_slots
        counts = batch.sample_counts  # 1 + drafts per row that samples
        row_slots = np.repeat(slots, counts)  # [N] the slot of each logits row
        row_of_slot = np.full(table.capacity, -1, dtype=np.int64)
        row_of_slot[slots] = np.arange(len(slots))  # a pending token is its row's kept one
        self._source = row_of_slot  # before the masks: the next step may be prepared then
        masks = None if token_bitmask is None else self._masks(sched, batch, token_bitmask)
        outputs = (  # [N] each logits row's output position (pending tokens not counted)
            table.num_tokens[row_slots].astype(np.int64)
            - table.num_prompt[row_slots]
            + batch.logits_depth
        )
        banned = None
        if table.min_tokens[row_slots].any():
            at = outputs.copy()
            at[batch.pending_sampling_rows] += 1
            banned = banned_stop_tokens(table, row_slots, at, logits.shape[-1])
        meta = None if banned is not None else self._sampling_reuse.get(table.sampling, row_slots)
        if meta is not None and meta.allowed_token_rows is not None:  # this step's masks
            structured = table.sampling.columns["structured"][row_slots]
            meta = meta.with_token_bitmask(masks, structured)
        elif meta is None:
            version = table.sampling.version  # the masks' fill may admit a request
            meta = SamplingMetadata.from_rows(
                table.sampling.gather(row_slots),
                outputs,
                lambda: self._histories(sched, batch),
                vocab_size=logits.shape[-1],
                device=self.device,
                generator=self.generator,
                pending_rows=batch.pending_sampling_rows,
                pending_token_ids=pending,
                token_bitmask=masks,
                upload_many=self.uploads.upload,
                banned=banned,
            )
            self._sampling_reuse.keep(table.sampling, row_slots, meta, version)
        out = self.sampler(logits, meta, mutable=True)  # the step's own, read no more
        self._last = sampled_rows(out.sampled_token_ids, batch, input_ids, row_of_slot, after_d)
        step = LaunchedStep.start(batch.sample_rows, counts, out)
        step.prompt_logprobs = scored
        self.profiler.end()
        return step

    @staticmethod
    def _masks(
        sched: SchedulerOutput,
        batch: HostBatch,
        token_bitmask: Callable[[Sequence[Request], np.ndarray, np.ndarray], np.ndarray],
    ) -> Callable[[np.ndarray], np.ndarray]:
        """Logits rows with a grammar [G] -> their masks: a constrained row's logits rows
        (1 + its drafts, one after another) are its request's masks after its output and
        after each draft (``token_bitmask(requests, slots, drafts per request)``)."""

        def masks(rows: np.ndarray) -> np.ndarray:
            row_of = np.repeat(np.arange(len(batch.sample_rows)), batch.sample_counts)  # [N]
            sampled = row_of[rows]
            first = np.flatnonzero(np.diff(sampled, prepend=-1) != 0)
            constrained = sampled[first]  # the sampling rows, each once, in order
            drafts = np.diff(np.append(first, len(rows))) - 1
            return token_bitmask(
                sched.requests[batch.sample_rows[constrained]],
                batch.sample_slots[constrained],
                drafts,
            )

        return masks

    @staticmethod
    def _histories(
        sched: SchedulerOutput, batch: HostBatch
    ) -> tuple[list[list[int]], list[list[int]]]:
        """(prompt, output token ids) per logits row: read only when a row has a penalty.
        A drafted row's logits row j follows the drafts before it on its branch (a chain's
        first j drafts; a tree node's ancestors): they are its output there."""
        counts = batch.sample_counts
        requests = np.repeat(sched.requests[batch.sample_rows], counts)
        prompts = [r.prompt_token_ids for r in requests]
        outputs = [r.output_token_ids for r in requests]
        table = sched.table
        slots = np.repeat(batch.sample_slots, counts)
        within = within_runs(counts)
        for i in np.flatnonzero(within).tolist():
            slot, n = slots[i], int(table.num_tokens[slots[i]])
            if table.draft_tree[slot]:
                branch = branch_drafts(table.draft_parent[slot], int(within[i]))
            else:
                branch = list(range(within[i]))
            outputs[i] = outputs[i] + table.token_ids[slot, [n + j for j in branch]].tolist()
        return prompts, outputs

    def _upload(
        self,
        batch: HostBatch,
        last: SampledRows | None,
        shift: Sequence[np.ndarray],
        after: Sequence[np.ndarray],
    ) -> tuple[
        CommonAttentionMetadata,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor | None,
        list[torch.Tensor],
    ]:
        """The step's inputs on the device in one copy: (attention metadata, input ids with
        the pending tokens filled in, positions, logits rows, the pending tokens [P], the
        device copies of ``after``); rows behind a drafted step moved where it put them
        (``shift``: sampled_rows.shift_arrays)."""
        qsl = np.zeros(batch.num_reqs + 1, dtype=np.int32)
        np.cumsum(batch.query_lens, out=qsl[1:])
        arrays = [
            qsl,
            batch.seq_lens,
            batch.block_tables,
            batch.slot_mapping,
            batch.input_ids,
            batch.positions,
            batch.logits_rows,
        ]
        if last is not None:
            arrays += [batch.pending_src, batch.pending_rows]
        if batch.tree_mask is not None:
            arrays.append(batch.tree_mask)
        dev, shift_d, after_d = self.uploads.upload_groups(arrays, shift, after)
        qsl_d, seq_lens, block_tables, slot_mapping, input_ids, positions, rows = dev[:7]
        pending = None
        if last is not None:
            pending = last.tokens[dev[7]]
            input_ids.index_copy_(0, dev[8], pending)
        shift_inputs(
            batch, last, shift_d, input_ids, positions, slot_mapping, seq_lens, block_tables,
            self.block_size,
        )  # fmt: skip
        common = CommonAttentionMetadata(
            query_start_loc=qsl_d,
            seq_lens=seq_lens,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            query_lens_host=batch.query_lens,
            seq_lens_host=batch.seq_lens,
            block_size=self.block_size,
            num_decodes=batch.num_decodes,
            tree_mask=None if batch.tree_mask is None else dev[-1],
            tree_mask_host=batch.tree_mask,
        )
        return common, input_ids, positions, rows, pending, after_d
