"""Piecewise CUDA graphs: the model body between attention calls, captured per token count.

The decode graphs (cuda_graphs.py) replay whole steps whose rows all decode. Every other step
(prompt chunks, mixed steps, rows with more drafts than a decode graph holds, trees of drafts)
ran eagerly, and an eager forward is bound by Python's kernel launches: on SmolLM2 (30 layers)
~20-28 ms of host time whatever its token count, against ~2 ms for a replayed decode step.
Only attention depends on the step's layout (which rows, how long, their block tables); the
rest of the model depends on the token count alone. So, for each bucket of token counts:

    piece 0     embed, rope tables, layer 0 up to its q/k/v     -> q, k, v buffers
    attention   layer 0, eager, on the step's own metadata      -> o buffer
    piece 1     layer 0 after attention, layer 1 up to q/k/v    -> q, k, v buffers
    ...
    piece L     layer L-1 after attention, the final norm       -> hidden [T, H]

A step of n tokens runs in the smallest bucket T >= n: its input ids and positions go into the
first n rows of static buffers (the rows past n keep earlier, valid values), every piece runs
over T rows, and attention over the real n rows only (it never reads the padding, whose rows of
the output are dropped). The split happens where the model calls ``attend`` (see
attention/graph_split.py): while a bucket is captured its metadata is a GraphSplit that ends
one graph and begins the next. All pieces of all buckets share one memory pool; a bucket's
pieces replay in the order they were captured and no two buckets interleave, so the pool's
reuse of memory across pieces and buckets is what capture-time liveness allowed.

Every layer's attention takes the same static q/k/v/o buffers and the same metadata; only
its KV cache differs. So the first layer's Triton launches are recorded and the later layers
launch the same compiled kernels over their own caches (kernels/launch_log.py), without
binding and checking ~30 arguments a launch again.
"""

from __future__ import annotations

import torch

from tokenmill.engine.attention.graph_split import GraphSplit
from tokenmill.engine.attention.interface import AttentionBackend
from tokenmill.kernels.launch_log import LaunchLog

__all__ = ["PiecewiseGraphRunner", "piecewise_buckets"]


def piecewise_buckets(max_tokens: int) -> list[int]:
    """Token counts to capture: 16 to 512 by doubling, then every 256 to 2,048, then every 512
    up to ``max_tokens`` (always included). Past 512 tokens a step pads less than half its
    tokens, past 1,024 at most a quarter: the pieces' GEMMs do that much more work, which
    costs less than the eager launches they replace on small models and little on large ones.
    """
    sizes = [b for b in (16, 32, 64, 128, 256, 512) if b < max_tokens]
    sizes += list(range(768, min(2048, max_tokens - 1) + 1, 256))
    sizes += list(range(2560, max_tokens, 512))
    return sorted(set(sizes + [max_tokens]))


class _Capture(GraphSplit):
    """Captures one bucket's pieces: each split copies the layer's q/k/v into the static
    buffers (inside the piece), closes the piece's graph and opens the next."""

    def __init__(self, runner: PiecewiseGraphRunner, tokens: int, record: bool) -> None:
        self.runner = runner
        self.tokens = tokens
        self.record = record  # False: a warm-up pass (compiles kernels), no graphs
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.layers: list[tuple[torch.Tensor, float]] = []  # (kv cache, scale) per split
        self._graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        if self.record:
            self._graph = torch.cuda.CUDAGraph()
            self._graph.capture_begin(pool=self.runner.pool)

    def end(self) -> None:
        if self._graph is not None:
            self._graph.capture_end()
            self.graphs.append(self._graph)
            self._graph = None

    def split(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        t = self.tokens
        r = self.runner
        r.buffers(q, k, v)
        r.q[:t].copy_(q)
        r.k[:t].copy_(k)
        r.v[:t].copy_(v)
        self.end()
        self.layers.append((kv_cache, scale))
        self.begin()
        return r.o[:t]


class PiecewiseGraphRunner:
    """Captures the pieces for every bucket up to ``max_tokens``; ``run`` replays them around
    eager attention. CUDA and a backend with ``cuda_graphs`` only (the model runner checks)."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        kv_caches: list[torch.Tensor],
        max_tokens: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.device = device
        self.buckets = piecewise_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        self.input_ids = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)
        # q/k/v in, attention output o, the last piece's hidden states: sized at capture
        self.q = self.k = self.v = self.o = self.hidden = torch.empty(0, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        # bucket -> (its pieces, the (kv cache, scale) of each attention between two pieces)
        self.pieces: dict[int, tuple[list[torch.cuda.CUDAGraph], list[tuple[torch.Tensor, float]]]]
        self.pieces = {}
        self._views: dict[tuple, torch.Tensor] = {}  # LaunchLog.replay's views of the caches

    def buffers(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Allocate the static q/k/v/o buffers on the first split (their head counts and
        dtype are the model's), outside any capture's pool."""
        if self.q.numel():
            return
        n = self.max_tokens
        self.q = torch.zeros((n, *q.shape[1:]), dtype=q.dtype, device=self.device)
        self.k = torch.zeros((n, *k.shape[1:]), dtype=k.dtype, device=self.device)
        self.v = torch.zeros((n, *v.shape[1:]), dtype=v.dtype, device=self.device)
        self.o = torch.zeros((n, *q.shape[1:]), dtype=q.dtype, device=self.device)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (the smaller ones then fit in the pool's
        memory). The first pass of each is a warm-up outside any graph: Triton compiles its
        kernels for that shape there, never inside a capture."""
        warm = _Capture(self, self.buckets[-1], record=False)
        hidden = self.model(self.input_ids, self.positions, self.kv_caches, warm)
        self.hidden = torch.zeros_like(hidden)  # q/k/v/o were sized by the splits
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for t in reversed(self.buckets):
                self.model(self.input_ids[:t], self.positions[:t], self.kv_caches,
                           _Capture(self, t, record=False))  # fmt: skip
                cap = _Capture(self, t, record=True)
                cap.begin()
                hidden = self.model(self.input_ids[:t], self.positions[:t], self.kv_caches, cap)
                self.hidden[:t].copy_(hidden)  # the pool may reuse ``hidden`` for other buckets
                cap.end()
                self.pieces[t] = (cap.graphs, cap.layers)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def fits(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.max_tokens and bool(self.pieces)

    def run(
        self,
        input_ids: torch.Tensor,  # [n] on the device
        positions: torch.Tensor,  # [n]
        attn_meta: object,
    ) -> torch.Tensor:
        """Hidden states [n, H] of the step, its attention run eagerly on ``attn_meta``."""
        n = input_ids.shape[0]
        t = next(b for b in self.buckets if b >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        graphs, layers = self.pieces[t]
        q, k, v, o = self.q[:n], self.k[:n], self.v[:n], self.o[:n]
        log: LaunchLog | None = None  # the first recorded layer's attention launches
        log_scale = None  # (its softmax scale: a layer with another is launched itself)
        for graph, (kv_cache, scale) in zip(graphs[:-1], layers, strict=True):
            graph.replay()
            if log is not None and scale == log_scale:
                log.replay(kv_cache, self._views)
                continue
            with LaunchLog.recording() as recorded:
                self.backend.forward(q, k, v, kv_cache, attn_meta, scale, out=o)
            if log is None and recorded.replayable and recorded.launches:
                recorded.swaps(kv_cache)
                log, log_scale = recorded, scale
        graphs[-1].replay()
        return self.hidden[:n]
