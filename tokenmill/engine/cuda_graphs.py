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

Steps whose rows carry trees of drafts (engine/core/draft_tree.py, Lookahead) get graphs
of their own, captured for the proposer's tree size T: every row goes through the prefill
kernel with its tree mask, left-padded to T tokens as above. A padding token's key index is
one of the row's real context keys (its own KV is not stored), so each real token's mask
gains the padding's bits (they are context to it) and keeps its own, shifted past them:

    row of m = 3 step tokens, T = 5:   [ p p t a b ]   masks  -1 -1 0b00111 0b01111 0b10111
                                                       (t, a, b's own 0b001, 0b011, 0b101)

A row needs T keys of context for that (its sequence holds >= T tokens); a step with a
shorter row, or a prefill chunk, runs eagerly. Rows without a tree in such a step (a row
asking for logprobs) run through the prefill kernel too, so their bits may differ from a
decode-kernel step's.

The graph ends at the final hidden states: the LM head runs eagerly on just the rows that
sample, so no graph holds a [bucket x Q, vocab] logits buffer. All graphs share one memory
pool and one set of static buffers, sized for the largest bucket and query length. Graphs
need a backend with ``cuda_graphs`` (no host syncs, a grid sized from fixed maxima).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from tokenmill.engine.attention.interface import AttentionBackend
from tokenmill.engine.attention.metadata import CommonAttentionMetadata
from tokenmill.engine.host_batch import HostBatch
from tokenmill.engine.sampled_rows import SampledRows, shift_inputs


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
    tree_mask: torch.Tensor  # [N * Q] int64 (tree graphs only)

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
            tree_mask=torch.full((tokens,), -1, dtype=torch.int64, device=device),
        )


class DecodeGraphRunner:
    """Captures the model body for each (bucket, query length); replays it for decode steps.

    ``query_lens`` are the query lengths to capture: 1, and 1 + the most drafts a proposer
    gives when there is one (rows with fewer drafts are left-padded up to it). ``tree_size``
    (0: none): the step tokens a row's tree of drafts may have, captured as tree graphs.
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
        tree_size: int = 0,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.buckets = graph_buckets(max_num_seqs)
        self.max_bs = self.buckets[-1]
        self.query_lens = sorted(set(query_lens))
        self.tree_size = tree_size
        max_blocks = -(-max_model_len // block_size)
        lens = sorted(set(self.query_lens + ([tree_size] if tree_size else [])))
        self.static = StaticDecodeInputs.allocate(self.max_bs, lens, max_blocks, device)
        # (bucket, query length, tree) -> the graph and its hidden-state output
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def _meta(self, bs: int, q: int, tree: bool):
        s = self.static
        common = CommonAttentionMetadata(
            query_start_loc=s.query_start_loc[q][: bs + 1],
            seq_lens=s.seq_lens[:bs],
            block_tables=s.block_tables[:bs],
            slot_mapping=s.slot_mapping[: bs * q],
            query_lens_host=np.full(bs, q, dtype=np.int64),
            seq_lens_host=np.zeros(bs, dtype=np.int64),  # any length up to max_model_len
            block_size=self.block_size,
            num_decodes=0 if tree else bs,  # tree rows: the prefill kernel, masked
            tree_mask=s.tree_mask[: bs * q] if tree else None,
            tree_mask_host=np.full(bs * q, -1, dtype=np.int64) if tree else None,
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
            kinds = [(q, False) for q in self.query_lens]
            if self.tree_size:
                kinds.append((self.tree_size, True))
            for q, tree in sorted(kinds, reverse=True):
                for bs in reversed(self.buckets):
                    meta = self._meta(bs, q, tree)
                    self._forward(bs, q, meta)  # compiles the kernels outside the capture
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                        out = self._forward(bs, q, meta)
                    self.graphs[(bs, q, tree)] = (graph, out)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def kind(self, batch: HostBatch) -> tuple[int, bool] | None:
        """(query length, tree) of the graphs that can run ``batch``; None: run it eagerly."""
        if not (0 < batch.num_reqs <= self.max_bs and self.graphs):
            return None
        if batch.num_trees == 0 and batch.decode_only:
            q = next((x for x in self.query_lens if x >= batch.max_query_len), None)
            return None if q is None else (q, False)
        t = self.tree_size
        if (
            t
            and batch.num_decodes + batch.num_trees == batch.num_reqs
            and batch.max_query_len <= t
            and int(batch.seq_lens.min()) >= t  # room to left-pad into the context
        ):
            return t, True
        return None

    def layout(self, batch: HostBatch, kind: tuple[int, bool]) -> np.ndarray | None:
        """[T] where each of ``batch``'s tokens sits in the graphs of ``kind`` (None: in
        order): what ``run`` takes as ``dest``."""
        return _padded_rows(batch.query_lens, kind[0])

    def run(
        self,
        batch: HostBatch,
        kind: tuple[int, bool],
        upload_groups: Callable[..., list[list[torch.Tensor]]],
        last: SampledRows | None = None,
        *,
        dest: np.ndarray | None,
        shift: Sequence[np.ndarray] = (),
        after: Sequence[np.ndarray] = (),
    ) -> Replayed:
        """``batch`` replayed in the graphs of ``kind`` (what ``kind(batch)`` said; not None),
        its tokens placed as ``dest`` (``layout(batch, kind)``) says.

        ``upload_groups`` sends the step's host arrays to the device in one copy (the
        model runner's ``UploadRing.upload_groups``); they are then copied into the static
        buffers. The input tokens at ``batch.pending_rows``, which the host does not know
        yet, are ``last.tokens[batch.pending_src]`` (the previous step's sampled rows, on
        the device); rows behind a drafted step move where it put them (``shift``: the
        arrays of sampled_rows.shift_arrays). ``after``: more arrays for the step's later
        work, sent in the same copy (``Replayed.after``)."""
        q, tree = kind
        b = batch.num_reqs
        bs = next(x for x in self.buckets if x >= b)
        input_ids, positions, slots = batch.input_ids, batch.positions, batch.slot_mapping
        if dest is not None:
            input_ids, positions, slots = (
                _scatter(x, dest, b * q, fill)
                for x, fill in ((input_ids, 0), (positions, 0), (slots, -1))
            )
        s = self.static
        width = batch.block_tables.shape[1]
        n = b * q
        statics = [s.input_ids[:n], s.positions[:n], s.slot_mapping[:n], s.seq_lens[:b]]
        statics.append(s.block_tables[:b, :width])
        arrays = [input_ids, positions, slots, batch.seq_lens, batch.block_tables]
        if tree:
            statics.append(s.tree_mask[:n])
            arrays.append(_padded_masks(batch, q, dest))
        rows = batch.logits_rows if dest is None else dest[batch.logits_rows]
        gather_rows = not (dest is None and len(rows) == b)  # else hidden[:b], a view
        extra = [rows] if gather_rows else []
        if last is not None:
            extra += [batch.pending_src]
            extra += [batch.pending_rows if dest is None else dest[batch.pending_rows]]
        dev, shift_d, after_d = upload_groups(arrays + extra, shift, after)
        for dst, src in zip(statics, dev[: len(statics)], strict=True):
            dst.copy_(src)
        dev_rows = dev[len(arrays)] if gather_rows else None
        pending = None
        if last is not None:
            pending = last.tokens[dev[-2]]
            s.input_ids.index_copy_(0, dev[-1], pending)
        shift_inputs(
            batch, last, shift_d, s.input_ids, s.positions, s.slot_mapping, s.seq_lens,
            s.block_tables, self.block_size,
        )  # fmt: skip
        if bs > b:  # padding requests: no KV write
            s.slot_mapping[n : bs * q].fill_(-1)
            # decode kernel: no keys (zeros); prefill kernel (trees): q keys of any block,
            # finite, so the dropped rows stay free of NaN
            s.seq_lens[b:bs].fill_(q if tree else 0)
            if tree:
                s.tree_mask[n : bs * q].fill_(-1)
        graph, hidden = self.graphs[(bs, q, tree)]
        graph.replay()
        # every row sampling its one token in order: a view, no gather
        hidden = hidden[:b] if dev_rows is None else hidden[dev_rows]
        return Replayed(hidden, pending, s.input_ids, after_d)


class Replayed(NamedTuple):
    """What ``DecodeGraphRunner.run`` gives: hidden states [N, H] at the step's logits
    rows, the pending input tokens [P] (None: none), the input ids as replayed, and the
    device copies of its ``after`` arrays."""

    hidden: torch.Tensor
    pending: torch.Tensor | None
    input_ids: torch.Tensor
    after: list[torch.Tensor]


def _padded_masks(batch: HostBatch, q: int, dest: np.ndarray | None) -> np.ndarray:
    """[B * q] the step's tree masks in the left-padded layout: each real token's own bits
    shifted past its row's padding, whose bits it gains (see the top); -1 (causal) stays."""
    lens = batch.query_lens.astype(np.int64)
    masks = batch.tree_mask
    if masks is None:
        masks = np.full(int(lens.sum()), -1, dtype=np.int64)
    pad = np.repeat(q - lens, lens).astype(np.uint64)  # [T] its row's padding
    own = masks.view(np.uint64)
    shifted = ((own << pad) | ((np.uint64(1) << pad) - np.uint64(1))).view(np.int64)
    padded = np.where(masks == -1, masks, shifted)
    if dest is None:
        return padded
    return _scatter(padded, dest, len(lens) * q, -1)


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
