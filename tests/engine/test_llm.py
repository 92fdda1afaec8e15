"""End-to-end engine behaviour on the real SmolLM2 model (CPU, fp32)."""

from __future__ import annotations

import pytest

from bench.prompts import chat_prompts
from tokenmill import LLM, EngineConfig, RequestOutput, SamplingParams
from tokenmill.engine.prompts import encode_texts

GREEDY = SamplingParams(max_tokens=16, temperature=0)
SYSTEM = (
    "You are a careful assistant for a school. Answer in plain words, keep answers short, "
    "and never invent facts you are not sure about."
)
BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4  # SmolLM2 KV per 16-token block in fp32
# The variants' KV pool, room for every prompt here at once (each needs <= 7 blocks of 16
# tokens, or 14 of 8): the default on CPU is ~1 GB, whose zeroing took 0.8 s a variant.
VARIANT_KV = 128 * BLOCK_BYTES


@pytest.fixture(scope="module")
def prompts(smollm2_llm) -> list[list[int]]:
    convs = [[{"role": "system", "content": SYSTEM}, *c[-1:]] for c in chat_prompts(8, seed=3)]
    return [smollm2_llm.encode_chat(c) for c in convs]


@pytest.fixture(scope="module")
def first_pass(smollm2_llm, prompts) -> list[RequestOutput]:
    """The shared engine's (prefix caching on) first run of ``prompts``: only the system
    prompt, shared by all, can come from its cache."""
    assert smollm2_llm.engine.config.enable_prefix_caching
    outs = smollm2_llm.generate(prompts, GREEDY)
    assert all(o.ok for o in outs)
    return outs


@pytest.fixture(scope="module")
def reference(first_pass) -> list[list[int]]:
    return [o.token_ids for o in first_pass]


def _variant(**kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", VARIANT_KV)
    return LLM("smollm2-135m-instruct", device="cpu", dtype="float32", **kwargs)


def test_prefix_caching_on_and_off_give_identical_outputs(
    smollm2_llm, prompts, first_pass, reference
) -> None:
    outs_again = smollm2_llm.generate(prompts, GREEDY)  # the whole prompts are cached now
    off = _variant(enable_prefix_caching=False)
    outs_off = off.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs_again] == reference
    assert [o.token_ids for o in outs_off] == reference
    assert sum(o.num_cached_tokens for o in first_pass) > 0  # the shared system prompt
    assert all(o.num_cached_tokens >= len(p) - 16 for o, p in zip(outs_again, prompts, strict=True))
    assert all(o.num_cached_tokens == 0 for o in outs_off)


def test_tiny_kv_pool_preempts_and_gives_identical_outputs(prompts, reference) -> None:
    """Four prompts (7, 5, 7 and 5 blocks with their outputs) in a pool of 10 blocks: three
    preemptions, where the 8 prompts in 12 blocks this once ran took one, in twice the time
    (the small pool runs them about two at a time)."""
    tiny = _variant(kv_cache_memory=10 * BLOCK_BYTES, enable_prefix_caching=False)
    outs = tiny.generate(prompts[:4], GREEDY)
    assert tiny.engine.scheduler.stats.num_preemptions > 0
    assert [o.token_ids for o in outs] == reference[:4]
    tiny.engine.scheduler.kv.check_integrity()
    assert tiny.engine.scheduler.kv.num_free_blocks == 10


def test_chunked_prefill_gives_identical_outputs(prompts, reference) -> None:
    chunked = _variant(max_num_batched_tokens=16, block_size=8)
    outs = chunked.generate(prompts[:4], GREEDY)  # ~280 prompt tokens in 16-token chunks
    assert [o.token_ids for o in outs] == reference[:4]


def test_too_long_prompt_is_a_per_request_error(smollm2_llm, prompts, reference) -> None:
    too_long = [1] * (smollm2_llm.engine.max_model_len + 5)
    outs = smollm2_llm.generate([prompts[0], too_long, prompts[1], []], GREEDY)
    assert outs[0].token_ids == reference[0] and outs[2].token_ids == reference[1]
    assert outs[1].finish_reason == "error" and "max_model_len" in outs[1].error
    assert outs[3].finish_reason == "error" and "empty" in outs[3].error


def test_seeded_sampling_is_batch_invariant(smollm2_llm, prompts) -> None:
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
    alone = smollm2_llm.generate([prompts[2]], seeded)[0]
    others = SamplingParams(max_tokens=24, temperature=0.8)
    mixed = smollm2_llm.generate([prompts[0], prompts[2], prompts[5]], [others, seeded, others])
    assert mixed[1].token_ids == alone.token_ids
    other_seed = smollm2_llm.generate(
        [prompts[2]], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=99)
    )[0]
    assert other_seed.token_ids != alone.token_ids


def test_stop_string_truncates_text(smollm2_llm, prompts, reference) -> None:
    full = smollm2_llm.generate([prompts[0]], GREEDY)[0]
    words = full.text.split()
    stop = words[len(words) // 2]
    out = smollm2_llm.generate(
        [prompts[0]], SamplingParams(max_tokens=32, temperature=0, stop=[stop])
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    assert out.token_ids == reference[0][: len(out.token_ids)]


def test_logprobs_and_finish_reasons(smollm2_llm, prompts) -> None:
    out = smollm2_llm.generate(
        [prompts[1]], SamplingParams(max_tokens=5, temperature=0, logprobs=3)
    )[0]
    assert out.finish_reason == "length" and len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == tok and lp.rank == 1 and lp.logprob <= 0
        assert len(lp.top) == 3 and max(lp.top, key=lp.top.get) == tok


def test_chat_and_text_prompts(smollm2_llm) -> None:
    one = smollm2_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=16, temperature=0),
    )
    assert len(one) == 1 and "Paris" in one[0].text and one[0].finish_reason == "stop"
    text = smollm2_llm.generate(
        "The capital of France is", SamplingParams(max_tokens=4, temperature=0)
    )
    assert text[0].ok and text[0].num_completion_tokens == 4 and text[0].num_prompt_tokens > 3


def test_text_decoded_at_finish_matches_the_tokenizer_and_stop_strings(
    smollm2_llm, prompts
) -> None:
    """Requests without stop strings get their text decoded once, at the end (batched); with
    stop strings, incrementally. Either way the text is what the tokenizer decodes."""
    tok = smollm2_llm.tokenizer
    plain = [
        SamplingParams(max_tokens=24, temperature=0, skip_special_tokens=skip)
        for skip in (True, False)
    ]
    outs = smollm2_llm.generate(prompts[:4], [plain[i % 2] for i in range(4)])
    for i, o in enumerate(outs):
        assert o.text == tok.decode(o.token_ids, skip_special_tokens=i % 2 == 0)
        assert o.text
    # A stop string cut from one of them, beside plain requests in the same batch.
    cut = outs[0].text.split()[2]
    mixed = [SamplingParams(max_tokens=24, temperature=0, stop=[cut]), plain[0], plain[0]]
    stopped, *rest = smollm2_llm.generate([prompts[0], prompts[1], prompts[2]], mixed)
    assert stopped.finish_reason == "stop" and stopped.stop_reason == cut
    assert outs[0].text.startswith(stopped.text) and cut not in stopped.text
    assert [o.text for o in rest] == [tok.decode(o.token_ids) for o in rest]


def test_unknown_engine_setting_is_named_with_the_valid_ones() -> None:
    with pytest.raises(TypeError) as info:  # before any model is loaded
        LLM("smollm2-135m-instruct", max_num_seq=4)
    message = str(info.value)
    assert "unknown engine setting(s) max_num_seq (did you mean max_num_seqs?)" in message
    assert ", ".join(EngineConfig.setting_names()) in message
    with pytest.raises(TypeError, match="prefix_caching"):  # the job.yaml alias is job.yaml's
        LLM("smollm2-135m-instruct", prefix_caching=False)


def test_out_of_range_engine_setting_is_named() -> None:
    with pytest.raises(ValueError, match=r"^block_size: expected a power of two .*got 24$"):
        LLM("smollm2-135m-instruct", block_size=24)


def test_prompts_are_encoded_in_one_batch_as_one_by_one(smollm2_llm) -> None:
    """chat and generate encode their texts in one tokenizer call: the ids of encoding each
    text alone (with BOS rules for plain prompts, none for rendered chat); token-id prompts
    pass through in their places."""
    tok = smollm2_llm.tokenizer
    texts = ["", " ", "héllo wörld 🚀", "a\n\nb\tc", "  leading", "<|im_start|>user\nhi<|im_end|>"]
    for special in (True, False):
        assert encode_texts(tok, texts, special) == [
            list(tok.encode(t, add_special_tokens=special)) for t in texts
        ]
    convs = [c[-1:] for c in chat_prompts(6, seed=5)]
    outs = smollm2_llm.chat(convs, SamplingParams(max_tokens=1, temperature=0))
    assert [list(o.prompt_token_ids) for o in outs] == [smollm2_llm.encode_chat(c) for c in convs]
    mixed = ["The capital of France is", [1, 2, 3], "Two plus two"]
    outs = smollm2_llm.generate(mixed, SamplingParams(max_tokens=1, temperature=0))
    assert [list(o.prompt_token_ids) for o in outs] == [
        list(tok.encode(mixed[0])),
        [1, 2, 3],
        list(tok.encode(mixed[2])),
    ]
