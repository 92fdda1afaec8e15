"""Paged attention with the Triton kernels (the GPU path).

Per layer: the step's K/V go into the paged cache (``store_kv``), then
  * the decode rows (the runner puts them first): split-K flash-decoding over each request's
    blocks, all query heads of a KV head's GQA group and all of the row's query tokens (its
    last token and its drafts, up to MAX_DECODE_QUERY) together;
  * the rows with a prefill chunk: the varlen prefill kernel.

    q rows:  [ d d d3 d d | p p p p p p p p | p p p ]     num_decodes = 5 (one has 2 drafts)
               decode kernel   prefill kernel (first_req = 5)

A mixed step thus reads each decode row's keys with the decode kernel, as a pure decode step
does (the prefill kernel would give each of them a whole tile of query rows), and a decode
row's result does not depend on which kind of step it ran in, eager or a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.engine.attention.interface import AttentionBackend
from tokenmill.engine.attention.metadata import CommonAttentionMetadata


@dataclass(frozen=True)
class TritonAttentionMetadata:
    common: CommonAttentionMetadata
    num_decodes: int  # leading decode rows
    decode_query_len: int  # most query tokens of a decode row (1 + drafts)
    decode_tokens: int  # query tokens of the decode rows
    num_splits: int  # decode splits, covering the longest decode row
    split_programs: int  # programs a (decode row, KV head), each taking a run of its splits
    prefill_max_query_len: int
    prefills_fresh: bool  # no prefill row has keys from earlier steps (a new prompt each)

    @property
    def decode_only(self) -> bool:
        return self.num_decodes == self.common.num_reqs


# More query tokens than this in a decode row go to the prefill kernel: the decode kernel's
# tile has query_len * GQA-group rows, and past ~64 of them its registers spill.
MAX_DECODE_QUERY = 8


# Keys of a request's first decode splits (later ones grow: kernels/paged_decode_attention.py,
# SPLITS_PER_TIER). Fixed for every engine, so a request's result depends only on its own
# length; the programs sharing a request's splits follow the batch (choose_split_programs).
DECODE_SPLIT_KEYS = 256


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    fused_layers = True
    cuda_graphs = True
    max_decode_query_len = MAX_DECODE_QUERY

    def __init__(self, num_kv_heads: int) -> None:
        # Imported here so the CPU path never needs Triton.
        from tokenmill.kernels.kv_store import store_kv
        from tokenmill.kernels.paged_decode_attention import (
            DecodeWorkspace,
            choose_split_programs,
            fixed_split_count,
            paged_decode_attention,
        )
        from tokenmill.kernels.paged_prefill_attention import paged_prefill_attention

        self._store_kv = store_kv
        self._decode = paged_decode_attention
        self._split_count = fixed_split_count
        self._split_programs = choose_split_programs
        self._workspace_nbytes = DecodeWorkspace.nbytes
        self._prefill = paged_prefill_attention
        self.num_kv_heads = num_kv_heads
        self.split_keys = DECODE_SPLIT_KEYS
        self.num_sms = 1  # set by set_engine_limits

    def workspace_bytes(
        self, max_model_len: int, max_decode_tokens: int, num_q_heads: int, head_dim: int
    ) -> int:
        """The decode kernel's split partials (DecodeWorkspace) for ``max_decode_tokens`` rows
        with the splits of a ``max_model_len``-key request: at 256 rows of 32 heads, d = 128
        and 131,072 keys (49 splits), 207 MB. A decode call allocates them (one layer's at a
        time), eager or in the CUDA graphs' pool; 0 when one split covers every request (the
        kernel then writes its output directly)."""
        splits = self._split_count(max_model_len, self.split_keys)
        if splits <= 1 or max_decode_tokens <= 0:
            return 0
        return self._workspace_nbytes(max_decode_tokens, num_q_heads, splits, head_dim)

    def set_engine_limits(
        self, max_model_len: int, max_num_seqs: int, device: torch.device
    ) -> None:
        """Take the SM count of ``device``, the GPU the engine runs on (the decode grid fills
        it; the current CUDA device may be another); a CPU device leaves ``num_sms`` as it
        is. A request's decode splits are fixed (``split_keys``, growing), so its result
        depends on nothing but its own length: eager and CUDA-graph steps, any batch, give
        the same tokens; only how many programs share its splits follows the step's batch."""
        if device.type == "cuda":
            # "cuda" without an index is the current device, where its tensors go.
            index = torch.cuda.current_device() if device.index is None else device.index
            self.num_sms = torch.cuda.get_device_properties(index).multi_processor_count

    def build(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        nd = common.num_decodes
        query_len = common.max_decode_query_len
        if query_len > MAX_DECODE_QUERY:
            nd, query_len = 0, 0  # every row through the prefill kernel
        longest = int(common.seq_lens_host[:nd].max(initial=0))
        splits = max(1, self._split_count(longest, self.split_keys))
        programs = self._split_programs(nd, self.num_kv_heads, splits, self.num_sms)
        prefill_max = int(common.query_lens_host[nd:].max(initial=0))
        fresh = bool((common.seq_lens_host[nd:] == common.query_lens_host[nd:]).all())
        decode_tokens = int(common.query_lens_host[:nd].sum())
        return TritonAttentionMetadata(
            common, nd, query_len, decode_tokens, splits, programs, prefill_max, fresh
        )

    def rope_kv_slots(self, meta: object) -> torch.Tensor | None:
        """The step's slot mapping: the fused rope kernel stores K/V with the rotation (one
        kernel fewer a layer; kernels/rope.py). Not in a graph capture's split (a piece of
        the piecewise graphs has no step's slots; the eager attention stores there)."""
        return meta.common.slot_mapping if isinstance(meta, TritonAttentionMetadata) else None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: TritonAttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        # Every kernel here goes through kernels.launch_log.launch: a piecewise step launches
        # the first layer's again for the others (LaunchLog), so device work done any other
        # way (a torch op) would run for the first layer only.
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        c = meta.common
        if not kv_stored:
            self._store_kv(k, v, k_cache, v_cache, c.slot_mapping)
        nd = meta.num_decodes
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Hq, d]
        if nd:
            multi = meta.decode_query_len > 1
            rows = meta.decode_tokens
            self._decode(
                q[:rows],
                k_cache,
                v_cache,
                c.block_tables[:nd],
                c.seq_lens[:nd],
                scale,
                meta.num_splits,
                split_keys=self.split_keys,
                split_programs=meta.split_programs,
                out=out[:rows],
                query_start_loc=c.query_start_loc[: nd + 1] if multi else None,
                max_query_len=meta.decode_query_len,
            )
        if meta.decode_only:
            return out
        self._prefill(
            q,
            k_cache,
            v_cache,
            c.block_tables,
            c.query_start_loc,
            c.seq_lens,
            meta.prefill_max_query_len,
            scale,
            out=out,
            first_req=nd,
            # A tree step's keys all come through the cache: in a CUDA graph its rows are
            # left-padded into their context, and a padding token's key is the context's
            # (in the cache), not the padding's own (in k).
            k_new=k if c.tree_mask is None else None,
            v_new=v if c.tree_mask is None else None,
            fresh=meta.prefills_fresh,
            tree_mask=c.tree_mask,  # rows with a tree of drafts (None: every row causal)
        )
        return out
