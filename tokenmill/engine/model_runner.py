"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

Per step it flattens the scheduled requests into varlen tensors

    input_ids, positions, slot_mapping:  [T]        (T = tokens scheduled this step)
    query_start_loc:                     [B + 1]
    seq_lens:                            [B]
    block_tables:                        [B, max_blocks]
    logits_indices:                      [S]        last token of each request that samples

runs the model once, computes logits only at ``logits_indices`` and samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.engine.attention.backend import AttentionBackend
from tokenmill.engine.attention.metadata import CommonAttentionMetadata
from tokenmill.engine.model_config import ModelConfig
from tokenmill.engine.sampler import Sampler, SamplerOutput
from tokenmill.engine.sampling_metadata import SamplingMetadata
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

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        common, input_ids, positions, logits_idx, sampling_rows = self._prepare(sched)
        if not sched.scheduled:
            return ModelOutput((), [], None)
        attn_meta = self.backend.build(common)
        hidden = self.model(input_ids, positions, self.kv_caches, attn_meta)  # [T, hidden]
        if not sampling_rows:
            return ModelOutput((), [], None)
        logits = self.model.compute_logits(hidden[logits_idx])  # [S, V]
        reqs = [s.request for s in sampling_rows]
        meta = SamplingMetadata.build(
            [r.sampling_params for r in reqs],
            [r.prompt_token_ids for r in reqs],
            [r.output_token_ids for r in reqs],
            vocab_size=logits.shape[-1],
            device=self.device,
            generator=self.generator,
        )
        out = self.sampler(logits, meta)
        tokens = out.sampled_token_ids.tolist()  # the step's one device-to-host read
        return ModelOutput(tuple(r.request_id for r in reqs), tokens, out)

    def _prepare(self, sched: SchedulerOutput):
        bs = self.block_size
        n = len(sched.scheduled)
        query_lens = [s.num_new_tokens for s in sched.scheduled]
        seq_lens = [s.end for s in sched.scheduled]
        total = sum(query_lens)
        input_ids = np.empty(total, dtype=np.int64)
        positions = np.empty(total, dtype=np.int64)
        max_blocks = max((len(s.block_ids) for s in sched.scheduled), default=1)
        block_tables = np.zeros((n, max(max_blocks, 1)), dtype=np.int32)
        logits_idx: list[int] = []
        sampling_rows = []
        offset = 0
        for i, s in enumerate(sched.scheduled):
            end = offset + s.num_new_tokens
            input_ids[offset:end] = s.request.all_token_ids[s.start : s.end]
            positions[offset:end] = np.arange(s.start, s.end)
            block_tables[i, : len(s.block_ids)] = s.block_ids
            if s.sample:
                logits_idx.append(end - 1)
                sampling_rows.append(s)
            offset = end
        # slot of position p in row b: block_tables[b, p // bs] * bs + p % bs
        row_of_token = np.repeat(np.arange(n), query_lens)
        slots = block_tables[row_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        qsl = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(query_lens, out=qsl[1:])

        dev = self.device
        common = CommonAttentionMetadata(
            query_start_loc=torch.from_numpy(qsl).to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(block_tables).to(dev, non_blocking=True),
            slot_mapping=torch.from_numpy(slots).to(dev, non_blocking=True),
            query_lens_host=tuple(query_lens),
            seq_lens_host=tuple(seq_lens),
            block_size=bs,
        )
        return (
            common,
            torch.from_numpy(input_ids).to(dev, non_blocking=True),
            torch.from_numpy(positions).to(dev, non_blocking=True),
            torch.tensor(logits_idx, dtype=torch.long).to(dev, non_blocking=True),
            sampling_rows,
        )
