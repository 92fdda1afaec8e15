"""How a constrained request ends, on both grammar libraries: a token its grammar rejects
makes it an error (never a "stop" that passes a broken output off as complete), and an
output completed by the token that reaches max_tokens is "stop", not "length"."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from tests.tiny_models import save_tiny_model
from tokenmill import LLM, SamplingParams

BACKENDS = ["llguidance", "xgrammar"]
PROMPT = [11, 42, 73, 104, 135, 166]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("endings") / "m")


def _llm(path: Path, backend: str, **kwargs: Any) -> LLM:
    if backend == "xgrammar":
        pytest.importorskip("xgrammar")
    return LLM(
        str(path), device="cpu", dtype="float32", structured_output_backend=backend, **kwargs
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rejected_token_ends_the_request_as_an_error(tiny_path: Path, backend: str) -> None:
    """The choice's only token is a stop token that min_tokens bans: every logit is masked,
    so a token the grammar rejects is drawn."""
    llm = _llm(tiny_path, backend)
    a = llm.tokenizer.encode("a", add_special_tokens=False)[0]
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=0, min_tokens=3,
                            stop_token_ids=[a], structured_output='choice:["aa"]')  # fmt: skip
    out, plain = llm.generate([PROMPT, PROMPT], [params, SamplingParams(max_tokens=5)])
    assert out.finish_reason == "error" and out.outputs[0].finish_reason == "error"
    assert out.error is not None and "grammar rejected a sampled token" in out.error
    assert plain.error is None and len(plain.token_ids) == 5
    assert len(llm.engine._grammars) == 0
    # With n = 2 the prompt fails too (a job writes it as an error row, not "length").
    (both,) = llm.generate([PROMPT], dataclasses.replace(params, n=2))
    assert [c.finish_reason for c in both.outputs] == ["error", "error"]
    assert both.error is not None and both.error.startswith("completion 0: structured output")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("workers", [None, 2], ids=["in_process", "worker_processes"])
def test_an_output_completed_by_its_last_allowed_token_is_stop(
    tiny_path: Path, backend: str, workers: int | None
) -> None:
    """In the engine's process and with worker processes answering while the next step's
    masks fill (async scheduling): the grammar's end is known when the token is applied."""
    schema = {"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    llm = _llm(tiny_path, backend, async_scheduling=True, structured_output_processes=workers)
    roomy = llm.generate([PROMPT], SamplingParams(max_tokens=32, structured_output=schema))[0]
    assert roomy.finish_reason == "stop" and json.loads(roomy.text) == {"a": 1}
    # A longer constrained row beside them keeps the steps after theirs constrained (the
    # step in flight is then processed while the next masks fill).
    long = {"type": "array", "items": {"type": "integer"}, "minItems": 40}
    exact, short, _ = llm.generate(
        [PROMPT, PROMPT, PROMPT],
        [SamplingParams(max_tokens=n, structured_output=schema)
         for n in (len(roomy.token_ids), len(roomy.token_ids) - 1)]
        + [SamplingParams(max_tokens=64, structured_output=long)],
    )  # fmt: skip
    assert (exact.finish_reason, exact.text) == ("stop", roomy.text)
    assert short.finish_reason == "length"
