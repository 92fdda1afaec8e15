"""A vLLM offline-inference script runs against tokenmill with only its import changed.

The script below is written the way vLLM's own examples read (LLM(model=...),
SamplingParams with n / temperature / top_p / logprobs, llm.generate over text prompts,
llm.chat over a conversation, results read through ``outputs[i]`` and the per-position
logprob mappings). Only ``from vllm import`` becomes ``from tokenmill import``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.tiny_models import save_tiny_model

VLLM_SCRIPT = """
from vllm import LLM, SamplingParams

prompts = ["Hello, my name is", "The capital of France is", "The future of AI is"]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, n=2, seed=1, max_tokens=12,
                                 logprobs=2)
llm = LLM(model=MODEL, dtype="float32", max_model_len=256)
outputs = llm.generate(prompts, sampling_params)
report = []
for output in outputs:
    prompt = output.prompt
    for completion in output.outputs:
        generated_text = completion.text
        best = [max(position.values(), key=lambda lp: lp.logprob)
                for position in completion.logprobs]
        chosen = [position[token].logprob for position, token in
                  zip(completion.logprobs, completion.token_ids)]
        report.append((prompt, completion.index, generated_text, len(completion.token_ids),
                       completion.finish_reason, completion.cumulative_logprob, best, chosen))

conversation = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Write an essay about the importance of higher education."},
]
chat_outputs = llm.chat(conversation, sampling_params=SamplingParams(temperature=0,
                                                                     max_tokens=10))
chat_text = chat_outputs[0].outputs[0].text
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("migration") / "m")


def test_a_vllm_script_runs_with_only_the_import_changed(model: Path) -> None:
    script = VLLM_SCRIPT.replace("from vllm import", "from tokenmill import")
    assert script.count("tokenmill") == 1  # nothing else was adapted
    scope = {"MODEL": str(model)}
    exec(compile(script, "vllm_offline_example.py", "exec"), scope)  # noqa: S102

    report = scope["report"]
    assert len(report) == 3 * 2  # two completions a prompt
    for prompt, index, text, n_tokens, finish, cumulative, best, chosen in report:
        assert prompt in ("Hello, my name is", "The capital of France is", "The future of AI is")
        assert index in (0, 1) and isinstance(text, str) and finish in ("stop", "length")
        assert len(best) == len(chosen) == n_tokens > 0
        assert math.isclose(cumulative, sum(chosen), rel_tol=1e-5, abs_tol=1e-5)
        assert all(b.rank == 1 and b.logprob <= 0 for b in best)
    assert isinstance(scope["chat_text"], str) and scope["chat_text"]
