"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

Per step it flattens the scheduled requests into a HostBatch (varlen arrays, see
host_batch.py), then either replays a captured CUDA graph (decode-only steps on the GPU) or
uploads the arrays and runs the model eagerly; logits only at the sampling rows; then samples.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.engine.attention.backend import AttentionBackend
from tokenmill.engine.attention.metadata import CommonAttentionMetadata
from tokenmill.engine.host_batch import HostBatch
from tokenmill.engine.model_config import ModelConfig
from tokenmill.engine.sampler import Sampler, SamplerOutput
from tokenmill.engine.sampling_metadata import SamplingMetadata
from tokenmill.engine.step_profile import StepProfiler
from tokenmill.scheduling.scheduler_output import SchedulerOutput


@dataclass(frozen=True)
class ModelOutput:
    """Sampled tokens of the requests that sampled this step, in batch order."""

    request_ids: tuple[str, ...]
    sampled_token_ids: list[int]
    sampler_output: SamplerOutput | None

    def as_dict(self) -> dict[str, list[int]]:
        return {
            rid: [tok] for rid, tok in zip(self.request_ids, self.sampled_token_ids, strict=True)
        }


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return (
        2
        * config.num_hidden_layers
        * block_size
        * config.num_key_value_heads
        * config.head_dim
        * elem
    )


class ModelRunner:
    """Owns the model's weights, the paged KV cache tensors, and the sampler."""

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
    ) -> None:
        self.model = model
        self.config = config
        self.backend = backend
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        # kv: [layers, 2, num_blocks, block_size, Hkv, d]. Zeroed: masked-out slots are still
        # multiplied by a zero weight, and garbage NaNs would leak through.
        self.kv_cache = torch.zeros(
            (
                config.num_hidden_layers,
                2,
                num_blocks,
                block_size,
                config.num_key_value_heads,
                config.head_dim,
            ),
            dtype=dtype,
            device=device,
        )
        self.kv_caches = list(self.kv_cache.unbind(0))
        self.sampler = Sampler()
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.graphs = None  # a DecodeGraphRunner once enable_cuda_graphs() captured them
        self.profiler = StepProfiler(device)

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture decode-step graphs (CUDA + Triton backend only; a no-op elsewhere)."""
        if self.device.type != "cuda" or self.backend.name != "triton":
            return
        from tokenmill.engine.cuda_graphs import DecodeGraphRunner

        self.graphs = DecodeGraphRunner(
            self.model,
            self.backend,
            self.kv_caches,
            max_num_seqs,
            max_model_len,
            self.block_size,
            self.device,
        )
        self.graphs.capture()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        if not sched.scheduled:
            return ModelOutput((), [], None)
        t0 = time.perf_counter()
        batch = HostBatch.build(sched, self.block_size)
        if self.graphs is not None and self.graphs.can_run(batch):
            self.profiler.begin(t0, batch, graph=True)
            logits = self.graphs.run(batch)  # [B, V]
            if len(batch.logits_rows) != batch.num_reqs:
                logits = logits[torch.from_numpy(batch.logits_rows).to(self.device)]
        else:
            self.profiler.begin(t0, batch, graph=False)
            common, input_ids, positions = self._upload(batch)
            attn_meta = self.backend.build(common)
            hidden = self.model(input_ids, positions, self.kv_caches, attn_meta)  # [T, H]
            if not batch.sampling:
                self.profiler.end()
                return ModelOutput((), [], None)
            rows = torch.from_numpy(batch.logits_rows).to(self.device, non_blocking=True)
            logits = self.model.compute_logits(hidden[rows])  # [S, V]
        reqs = [s.request for s in batch.sampling]
        meta = SamplingMetadata.build(
            [r.sampling_params for r in reqs],
            [r.prompt_token_ids for r in reqs],
            [r.output_token_ids for r in reqs],
            vocab_size=logits.shape[-1],
            device=self.device,
            generator=self.generator,
        )
        out = self.sampler(logits, meta)
        self.profiler.end()
        tokens = out.sampled_token_ids.tolist()  # the step's one device-to-host read
        return ModelOutput(tuple(r.request_id for r in reqs), tokens, out)

    def _upload(
        self, batch: HostBatch
    ) -> tuple[CommonAttentionMetadata, torch.Tensor, torch.Tensor]:
        dev = self.device
        qsl = np.zeros(batch.num_reqs + 1, dtype=np.int32)
        np.cumsum(batch.query_lens, out=qsl[1:])
        common = CommonAttentionMetadata(
            query_start_loc=torch.from_numpy(qsl).to(dev, non_blocking=True),
            seq_lens=torch.from_numpy(batch.seq_lens).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(batch.block_tables).to(dev, non_blocking=True),
            slot_mapping=torch.from_numpy(batch.slot_mapping).to(dev, non_blocking=True),
            query_lens_host=tuple(batch.query_lens.tolist()),
            seq_lens_host=tuple(batch.seq_lens.tolist()),
            block_size=self.block_size,
        )
        return (
            common,
            torch.from_numpy(batch.input_ids).to(dev, non_blocking=True),
            torch.from_numpy(batch.positions).to(dev, non_blocking=True),
        )
