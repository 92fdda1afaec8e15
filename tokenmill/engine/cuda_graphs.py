"""CUDA graphs for decode-only steps.

A decode step (every request adds one token) is the same sequence of kernels whatever the
tokens, so it is captured once per batch-size bucket and replayed: the step's inputs are
copied into static buffers and one ``replay`` launches every layer's kernels. A batch of B
requests runs in the smallest bucket >= B; the padding rows are inert:

    rows:        [ r0 r1 ... r(B-1) | pad ... pad ]      bucket size
    slot_mapping:  real slots        | -1  (the KV store skips them)
    seq_lens:      real lengths      |  0  (decode attention writes zeros)

All buckets share one memory pool and one set of static buffers, sized for the largest.
Graphs need the Triton backend (its decode path has no host syncs and a grid sized from
fixed maxima); the torch backend runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.engine.attention.metadata import CommonAttentionMetadata
from tokenmill.engine.device_copy import upload, upload_into
from tokenmill.engine.host_batch import HostBatch


def graph_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_num_seqs`` (always included)."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    buckets += list(range(16, max_num_seqs, 16))
    return sorted(set(buckets + [max_num_seqs]))


@dataclass(frozen=True)
class StaticDecodeInputs:
    """The buffers every captured graph reads; sized for the largest bucket N."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    slot_mapping: torch.Tensor  # [N] int64
    seq_lens: torch.Tensor  # [N] int32
    query_start_loc: torch.Tensor  # [N + 1] int32, always 0..N (one token a row)
    block_tables: torch.Tensor  # [N, max_blocks_per_seq] int32

    @classmethod
    def allocate(cls, n: int, max_blocks: int, device: torch.device) -> StaticDecodeInputs:
        return cls(
            input_ids=torch.zeros(n, dtype=torch.int64, device=device),
            positions=torch.zeros(n, dtype=torch.int64, device=device),
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=device),
            seq_lens=torch.zeros(n, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
            block_tables=torch.zeros((n, max_blocks), dtype=torch.int32, device=device),
        )


class DecodeGraphRunner:
    """Captures ``model`` + LM head for each bucket and replays them for decode steps."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend,
        kv_caches: list[torch.Tensor],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.buckets = graph_buckets(max_num_seqs)
        self.max_bs = self.buckets[-1]
        max_blocks = -(-max_model_len // block_size)
        self.static = StaticDecodeInputs.allocate(self.max_bs, max_blocks, device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def _meta(self, bs: int):
        s = self.static
        common = CommonAttentionMetadata(
            query_start_loc=s.query_start_loc[: bs + 1],
            seq_lens=s.seq_lens[:bs],
            block_tables=s.block_tables[:bs],
            slot_mapping=s.slot_mapping[:bs],
            query_lens_host=np.ones(bs, dtype=np.int64),
            seq_lens_host=np.full(bs, self.max_model_len),  # sizes split-K for the longest
            block_size=self.block_size,
        )
        return self.backend.build(common)

    def _forward(self, bs: int, meta) -> torch.Tensor:
        s = self.static
        hidden = self.model(s.input_ids[:bs], s.positions[:bs], self.kv_caches, meta)
        return self.model.compute_logits(hidden)  # [bs, V] fp32

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (later graphs reuse the pool's memory)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in reversed(self.buckets):
                meta = self._meta(bs)
                self._forward(bs, meta)  # compiles the kernels outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    out = self._forward(bs, meta)
                self.graphs[bs] = (graph, out)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def can_run(self, batch: HostBatch) -> bool:
        return batch.decode_only and 0 < batch.num_reqs <= self.max_bs and bool(self.graphs)

    def run(self, batch: HostBatch, pending: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, V] of a decode-only batch (a view into the graph's output).

        ``pending`` ([P], on the device) are the input tokens at ``batch.pending_rows``
        that the host does not know yet."""
        b = batch.num_reqs
        bs = next(x for x in self.buckets if x >= b)
        s = self.static
        width = batch.block_tables.shape[1]
        for dst, src in (
            (s.input_ids[:b], batch.input_ids),
            (s.positions[:b], batch.positions),
            (s.slot_mapping[:b], batch.slot_mapping),
            (s.seq_lens[:b], batch.seq_lens),
            (s.block_tables[:b, :width], batch.block_tables),
        ):
            upload_into(dst, torch.from_numpy(src))
        if pending is not None:
            rows = upload(torch.from_numpy(batch.pending_rows), s.input_ids.device)
            s.input_ids.index_copy_(0, rows, pending)
        if bs > b:  # padding rows: no KV write, no keys
            s.slot_mapping[b:bs].fill_(-1)
            s.seq_lens[b:bs].zero_()
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:b]
