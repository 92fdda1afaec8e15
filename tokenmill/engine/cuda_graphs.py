"""CUDA graphs for decode-only steps.

A decode step (every request adds its last token, and its draft tokens if it has some) is
the same sequence of kernels whatever the tokens, so the model body is captured once per
(batch-size bucket, query length) and replayed: the step's inputs are copied into static
buffers and one ``replay`` launches every layer's kernels. A batch of B requests with up to
q query tokens each runs in the smallest bucket >= B captured for the smallest query length
Q >= q. Every request gets Q token rows, its real tokens at the end (left padding), and the
padding is inert:

    tokens (Q = 3):  [ p t t | t t t | p p t | pad pad pad ... ]   bucket size x Q rows
    slot_mapping:      -1 real  real    -1 -1 real | -1 ...       (the KV store skips -1)
    seq_lens:          real lengths per request     |  0          (no keys: zeros)

A padding token before a request's tokens attends to a prefix of the request's keys (the
decode kernel's causal rule), so it reads nothing it should not; its output is dropped.

The graph ends at the final hidden states: the LM head runs eagerly on just the rows that
sample, so no graph holds a [bucket x Q, vocab] logits buffer. All graphs share one memory
pool and one set of static buffers, sized for the largest bucket and query length. Graphs
need a backend with ``cuda_graphs`` (no host syncs, a grid sized from fixed maxima).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.engine.attention.interface import AttentionBackend
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
    """The buffers every captured graph reads; sized for the largest bucket N and the
    longest query length Q."""

    input_ids: torch.Tensor  # [N * Q] int64
    positions: torch.Tensor  # [N * Q] int64
    slot_mapping: torch.Tensor  # [N * Q] int64
    seq_lens: torch.Tensor  # [N] int32
    block_tables: torch.Tensor  # [N, max_blocks] int32
    query_start_loc: dict[int, torch.Tensor]  # q -> [N + 1] int32: 0, q, 2q, ..

    @classmethod
    def allocate(
        cls, n: int, query_lens: list[int], max_blocks: int, device: torch.device
    ) -> StaticDecodeInputs:
        tokens = n * max(query_lens)
        return cls(
            input_ids=torch.zeros(tokens, dtype=torch.int64, device=device),
            positions=torch.zeros(tokens, dtype=torch.int64, device=device),
            slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=device),
            seq_lens=torch.zeros(n, dtype=torch.int32, device=device),
            block_tables=torch.zeros((n, max_blocks), dtype=torch.int32, device=device),
            query_start_loc={
                q: torch.arange(0, n * q + 1, q, dtype=torch.int32, device=device)
                for q in query_lens
            },
        )


class DecodeGraphRunner:
    """Captures the model body for each (bucket, query length); replays it for decode steps.

    ``query_lens`` are the query lengths to capture: 1, and 1 + the most drafts a proposer
    gives when there is one (rows with fewer drafts are left-padded up to it).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        kv_caches: list[torch.Tensor],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        query_lens: tuple[int, ...] = (1,),
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.buckets = graph_buckets(max_num_seqs)
        self.max_bs = self.buckets[-1]
        self.query_lens = sorted(set(query_lens))
        max_blocks = -(-max_model_len // block_size)
        self.static = StaticDecodeInputs.allocate(self.max_bs, self.query_lens, max_blocks, device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def _meta(self, bs: int, q: int):
        s = self.static
        common = CommonAttentionMetadata(
            query_start_loc=s.query_start_loc[q][: bs + 1],
            seq_lens=s.seq_lens[:bs],
            block_tables=s.block_tables[:bs],
            slot_mapping=s.slot_mapping[: bs * q],
            query_lens_host=np.full(bs, q, dtype=np.int64),
            seq_lens_host=np.zeros(bs, dtype=np.int64),  # any length up to max_model_len
            block_size=self.block_size,
            num_decodes=bs,
        )
        return self.backend.capture_metadata(common, self.max_model_len)

    def _forward(self, bs: int, q: int, meta) -> torch.Tensor:
        s = self.static
        n = bs * q
        return self.model(s.input_ids[:n], s.positions[:n], self.kv_caches, meta)  # [n, H]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (bucket, query length), largest first (later graphs reuse the
        pool's memory)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for q in reversed(self.query_lens):
                for bs in reversed(self.buckets):
                    meta = self._meta(bs, q)
                    self._forward(bs, q, meta)  # compiles the kernels outside the capture
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                        out = self._forward(bs, q, meta)
                    self.graphs[(bs, q)] = (graph, out)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def can_run(self, batch: HostBatch) -> bool:
        return (
            batch.decode_only
            and 0 < batch.num_reqs <= self.max_bs
            and batch.max_query_len <= self.query_lens[-1]
            and bool(self.graphs)
        )

    def run(self, batch: HostBatch, pending: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [N, H] at ``batch.logits_rows`` of a decode-only batch.

        ``pending`` ([P], on the device) are the input tokens at ``batch.pending_rows``
        that the host does not know yet."""
        b = batch.num_reqs
        bs = next(x for x in self.buckets if x >= b)
        q = next(x for x in self.query_lens if x >= batch.max_query_len)
        dest = _padded_rows(batch.query_lens, q)  # [T] each token's row in the padded layout
        input_ids, positions, slots = batch.input_ids, batch.positions, batch.slot_mapping
        if dest is not None:
            input_ids, positions, slots = (
                _scatter(x, dest, b * q, fill)
                for x, fill in ((input_ids, 0), (positions, 0), (slots, -1))
            )
        s = self.static
        width = batch.block_tables.shape[1]
        n = b * q
        for dst, src in (
            (s.input_ids[:n], input_ids),
            (s.positions[:n], positions),
            (s.slot_mapping[:n], slots),
            (s.seq_lens[:b], batch.seq_lens),
            (s.block_tables[:b, :width], batch.block_tables),
        ):
            upload_into(dst, torch.from_numpy(src))
        device = s.input_ids.device
        if pending is not None:
            rows = batch.pending_rows if dest is None else dest[batch.pending_rows]
            s.input_ids.index_copy_(0, upload(torch.from_numpy(rows), device), pending)
        if bs > b:  # padding requests: no KV write, no keys
            s.slot_mapping[n : bs * q].fill_(-1)
            s.seq_lens[b:bs].zero_()
        graph, hidden = self.graphs[(bs, q)]
        graph.replay()
        rows = batch.logits_rows if dest is None else dest[batch.logits_rows]
        if dest is None and len(rows) == b:
            return hidden[:b]  # every row samples its one token: a view, no gather
        return hidden[upload(torch.from_numpy(rows), device)]


def _padded_rows(query_lens: np.ndarray, q: int) -> np.ndarray | None:
    """[T] where each token of the varlen batch goes when every request gets ``q`` rows,
    its tokens last; None when that is where it already is (one token a request, q = 1)."""
    if q == 1:
        return None
    lens = query_lens.astype(np.int64)
    starts = np.cumsum(lens) - lens  # [B] first token of each request
    row = np.repeat(np.arange(len(lens)), lens)  # [T] request of each token
    return row * q + (q - lens)[row] + np.arange(int(lens.sum())) - starts[row]


def _scatter(values: np.ndarray, dest: np.ndarray, size: int, fill: int) -> np.ndarray:
    out = np.full(size, fill, dtype=values.dtype)
    out[dest] = values
    return out
