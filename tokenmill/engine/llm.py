"""tokenmill.LLM: the offline API. Give it prompts, get results back in input order."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from tokenmill.engine.engine_config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.prompts import encode_chat, encode_prompt
from tokenmill.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """An engine replica with a batch-at-a-time API.

    >>> llm = LLM("smollm2-135m-instruct", max_num_seqs=64, enable_prefix_caching=False)
    >>> llm.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=8))
    """

    def __init__(self, model: str = "smollm2-135m-instruct", **engine_settings: Any) -> None:
        """Load ``model`` (an alias, an HF directory or a .gguf file) into one engine.

        ``engine_settings`` are the fields of :class:`~tokenmill.EngineConfig` (dtype, device,
        max_num_seqs, max_num_batched_tokens, max_model_len, block_size, kv_cache_memory,
        enable_prefix_caching, ...), which declares each one, its default and what it
        accepts. Raises TypeError for an unknown setting (naming it and listing the valid
        ones) and EngineSettingError, a ValueError, for a value out of range.
        """
        self.config = EngineConfig.from_settings(str(model), **engine_settings)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._batches = 0

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Complete text prompts (tokenized with the model's BOS rules) or token-id lists.

        Returns one RequestOutput per prompt, in input order; a prompt that cannot run (too
        long, empty) gets ``error`` set instead of failing the batch.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        token_lists = [
            p if not isinstance(p, str) else encode_prompt(self.tokenizer, p) for p in prompts
        ]
        return self._run(token_lists, sampling_params)

    def chat(
        self,
        conversations: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Answer conversations (lists of {"role", "content"} messages) with the model's chat
        template. A single conversation may be passed without the outer list."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        return self._run(
            [self.encode_chat(c, add_generation_prompt) for c in conversations], sampling_params
        )

    def encode_chat(
        self, messages: Sequence[Message], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of ``messages`` rendered with the model's chat template."""
        return encode_chat(self.tokenizer, messages, add_generation_prompt)

    def _run(
        self,
        token_lists: list[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[RequestOutput]:
        params = _per_prompt(sampling_params, len(token_lists))
        batch = self._batches
        self._batches += 1
        results: dict[str, RequestOutput] = {}
        ids = [f"{batch}-{i}" for i in range(len(token_lists))]
        for rid, tokens, p in zip(ids, token_lists, params, strict=True):
            try:
                self.engine.add_request(rid, tokens, p)
            except ValueError as exc:
                results[rid] = RequestOutput(rid, list(tokens), "", [], "error", error=str(exc))
        start = time.perf_counter()
        while self.engine.has_unfinished():
            for out in self.engine.step():
                results[out.request_id] = out
        elapsed = time.perf_counter() - start
        n_out = sum(r.num_completion_tokens for r in results.values())
        log.info(
            "generated %d tokens for %d prompts in %.2fs (%.1f tok/s)",
            n_out,
            len(token_lists),
            elapsed,
            n_out / max(elapsed, 1e-9),
        )
        return [results[rid] for rid in ids]


def _per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; pass one or {n}")
    return params
