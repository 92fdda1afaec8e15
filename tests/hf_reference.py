"""HF transformers as the reference implementation in tests."""

from __future__ import annotations

import torch


def hf_greedy_choices(model, prompt_ids: list[int], output_ids: list[int]) -> list[int]:
    """HF's greedy choice at each position of ``output_ids`` given everything before it: one
    forward pass over the prompt and the output (teacher forcing), the argmax of the logits
    that predict each output token.

    An output equals HF ``generate``'s greedy continuation exactly when it equals these
    choices and stops where generate would (at EOS, or at max_new_tokens): each step of
    generate takes the argmax given the tokens before it, which are then the same. One pass
    instead of one ``generate`` call per prompt, token by token; the logits come from one
    full-sequence forward instead of the cache's incremental ones, the same arithmetic in
    another order (fp32 rounding)."""
    ids = torch.tensor([prompt_ids + output_ids[:-1]])
    with torch.inference_mode():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0]
    return logits[len(prompt_ids) - 1 :].argmax(-1).tolist()
