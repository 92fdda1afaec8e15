"""Prompt logprobs (vLLM's ``SamplingParams(prompt_logprobs=k)``): every prompt position's
logprob and top-k equal log_softmax of HF transformers' logits (fp32, tiny random Llama),
whether the prompt is prefilled in one step or in chunks, with async scheduling and under
preemption; a prompt served from the prefix cache is recomputed in full; rows that do not
ask are untouched."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.tiny_models import save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine.outputs import RequestOutput, TokenLogprob

BLOCK = 4
# Both sides run fp32 on the CPU; the kernels differ (paged attention, fused RMSNorm), so
# logprobs agree to float32 rounding of a few dozen sums, far below this.
ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("prompt_lp") / "m")


@pytest.fixture(scope="module")
def hf_logprobs(tiny_path):
    """log_softmax of HF's logits for one prompt: [L, V] (row p scores token p + 1)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)

    return run


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, 280, (n,), generator=g).tolist() for n in (1, 2, 9, 23, 14, 31)]


def _llm(path: Path, **kwargs: Any) -> LLM:
    settings = dict(device="cpu", dtype="float32", block_size=BLOCK, kv_cache_memory=1 << 24)
    return LLM(str(path), **{**settings, **kwargs})


def _check_against_hf(out: RequestOutput, ids: list[int], k: int, hf_logprobs) -> None:
    """Every position: the token's logprob and rank, and the top-k logprobs, as HF's."""
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(ids) and entries[0] is None
    if len(ids) == 1:
        return
    ref = hf_logprobs(ids)  # [L, V]
    for pos in range(1, len(ids)):
        entry, row, token = entries[pos], ref[pos - 1], ids[pos]
        assert isinstance(entry, TokenLogprob) and entry.token_id == token
        assert entry.logprob == pytest.approx(row[token].item(), abs=ATOL)
        # Rank: 1 + the tokens more likely, allowing for near-ties within the tolerance.
        above = int((row > row[token] + ATOL).sum()) + 1
        above_or_tied = int((row > row[token] - ATOL).sum()) + 1
        assert above <= entry.rank <= above_or_tied
        want = row.topk(k).values.tolist()
        assert sorted(entry.top.values(), reverse=True) == pytest.approx(want, abs=ATOL)
        for t, v in entry.top.items():  # the ids go with their values
            assert row[t].item() == pytest.approx(v, abs=ATOL)
        # vLLM's shape: token id -> Logprob over the token and the top-k.
        assert entry[token].logprob == entry.logprob and len(entry) in (k, k + 1)


@pytest.mark.parametrize(
    "settings",
    [
        {"max_num_batched_tokens": 512, "async_scheduling": False},
        # Chunks of at most 7 tokens: the 31-token prompt takes five steps, and chunks start
        # in the middle of a block; with async scheduling the plans run a step ahead.
        {"max_num_batched_tokens": 7, "async_scheduling": True},
    ],
    ids=["one-step", "chunked-async"],
)
def test_prompt_logprobs_match_hf(tiny_path, hf_logprobs, settings: dict[str, Any]) -> None:
    prompts = _prompts()
    llm = _llm(tiny_path, **settings)
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=4))
    for ids, out in zip(prompts, outs, strict=True):
        _check_against_hf(out, ids, 4, hf_logprobs)
    assert len(llm.engine._prompt_logprobs._states) == 0  # all handed on


def test_cached_prefix_is_recomputed_and_other_rows_are_untouched(tiny_path, hf_logprobs) -> None:
    """A prompt whose blocks are all cached still gets every position (it skips the cache);
    a plain request after it still hits the cache; plain rows beside it give what they give
    alone; ``prompt_logprobs=0`` holds just the prompt token."""
    llm = _llm(tiny_path, enable_prefix_caching=True)
    prompt = _prompts()[3]  # 23 tokens: five full blocks
    plain = SamplingParams(max_tokens=5, temperature=0)
    asked = dataclasses.replace(plain, prompt_logprobs=0)
    first = llm.generate([prompt], plain)[0]
    assert first.prompt_logprobs is None
    again, beside = llm.generate([prompt, _prompts()[4]], [asked, plain])
    assert again.num_cached_tokens == 0 and again.token_ids == first.token_ids
    _check_against_hf(again, prompt, 0, hf_logprobs)
    assert all(len(e) == 1 for e in again.prompt_logprobs[1:])  # the token alone
    assert beside.prompt_logprobs is None
    assert beside.token_ids == llm.generate([_prompts()[4]], plain)[0].token_ids
    later = llm.generate([prompt], plain)[0]
    assert later.num_cached_tokens == 20 and later.token_ids == first.token_ids


def test_preemption_computes_each_position_once(tiny_path) -> None:
    """40 tokens of KV for five requests: preempted requests recompute their prompts (the
    23-token one is preempted in the middle of its prompt, several times), and their prompt
    logprobs are those of a run without pressure."""
    prompts = _prompts()[:5]  # the longest, 23 tokens, + 12 fits in 40
    params = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=2)
        if i % 2 == 1
        else SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    want = _llm(tiny_path).generate(prompts, params)
    tight = _llm(tiny_path, kv_cache_memory=20480, max_num_batched_tokens=16)
    got = tight.generate(prompts, params)
    assert tight.engine.scheduler.stats.num_preemptions > 0
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        if w.prompt_logprobs is None:
            assert g.prompt_logprobs is None
            continue
        assert [e and (e.token_id, e.rank, sorted(e.top)) for e in g.prompt_logprobs] == [
            e and (e.token_id, e.rank, sorted(e.top)) for e in w.prompt_logprobs
        ]
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=ATOL)


@pytest.mark.parametrize("chunk", [None, 8], ids=["one-step", "mid-prefill"])
def test_an_aborted_requests_id_reused_while_its_step_is_in_flight(
    tiny_path, hf_logprobs, chunk: int | None
) -> None:
    """A retry through LLMEngine: a request with prompt_logprobs aborted while the step
    prefilling (a chunk of) its prompt is in flight, its id added again at once with another
    prompt. That step's positions were recorded into the new request's (the engine raised
    "arrived after": the new prompt's came from 0 again)."""
    settings = {} if chunk is None else {"max_num_batched_tokens": chunk}
    engine = _llm(tiny_path, async_scheduling=True, **settings).engine
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2)
    old, new = _prompts()[3], _prompts()[5]
    engine.add_request("x", old, params)
    engine.step()  # launches its (first) prefill step, processed by the next call
    assert engine._in_flight is not None
    engine.abort_requests(["x"])
    engine.add_request("x", new, params)
    outs: list[RequestOutput] = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.request_id for o in outs] == ["x"]
    _check_against_hf(outs[0], new, 2, hf_logprobs)
    assert outs[0].token_ids == _llm(tiny_path).generate([new], params)[0].token_ids
    engine.close()


def test_n_completions_share_one_set_of_prompt_logprobs(tiny_path) -> None:
    llm = _llm(tiny_path)
    prompt = _prompts()[2]
    one = llm.generate([prompt], SamplingParams(max_tokens=4, prompt_logprobs=1, seed=5))[0]
    three = llm.generate([prompt], SamplingParams(n=3, max_tokens=4, prompt_logprobs=1, seed=5))[0]
    assert len(three.outputs) == 3 and three.outputs[0].token_ids == one.token_ids
    got = [e and (e.token_id, e.rank) for e in three.prompt_logprobs]
    assert got == [e and (e.token_id, e.rank) for e in one.prompt_logprobs]


@pytest.mark.parametrize("value", [-1, 21, 2.0, True])
def test_out_of_range_prompt_logprobs_are_refused(value: Any) -> None:
    with pytest.raises(ValueError, match=r"SamplingParams.prompt_logprobs must be None or an"):
        SamplingParams(prompt_logprobs=value)


def test_more_logprobs_than_the_vocabulary_has_gives_them_all(tmp_path: Path) -> None:
    """k up to 20 is valid whatever the vocabulary: with 12 tokens, k = 20 lists all 12 (it
    raised inside the step, failing every request of the call)."""
    path = save_tiny_model("llama", tmp_path / "m", vocab_size=12)
    llm = LLM(str(path), device="cpu", dtype="float32")
    asks = SamplingParams(max_tokens=2, temperature=0, logprobs=20, prompt_logprobs=20)
    out, other = llm.generate([[1, 5, 6, 7], [1, 4]], [asks, SamplingParams(max_tokens=2)])
    assert other.error is None and len(other.token_ids) == 2
    assert out.logprobs is not None and all(len(lp.top) == 12 for lp in out.logprobs)
    prompt = out.prompt_logprobs
    assert prompt is not None and prompt[0] is None
    assert all(entry is not None and len(entry) >= 12 for entry in prompt[1:])
