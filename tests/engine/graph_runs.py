"""The same generate run eagerly and with CUDA graphs (decode graphs and the piecewise ones),
for the GPU tests that compare the two."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams


def eager_and_graph_runs(
    path: Path,
    prompts: list[list[int]],
    params: list[SamplingParams],
    dtype: str,
    max_num_seqs: int,
) -> tuple[list[list[int]], list[list[int]], dict]:
    """(eager token ids, graph token ids, the graph engine's step profile) of one generate,
    each engine freed before the next sizes its KV cache (it takes most of the GPU)."""
    outs, profile = {}, {}
    for graphs in (False, True):
        llm = LLM(
            str(path),
            device="cuda",
            dtype=dtype,
            cuda_graphs=graphs,
            max_num_seqs=max_num_seqs,
            attention_backend="triton",
            profile_steps=True,
        )
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
        if graphs:
            profile = llm.engine.step_profile()
        del llm
        torch.cuda.empty_cache()
    return outs[False], outs[True], profile
