"""The vLLM-shaped API: ``outputs[i]``, ``n``, ``best_of``, chat-template overrides, on the
real SmolLM2 model (CPU, fp32). Generations are a few tokens long to keep the suite quick."""

from __future__ import annotations

import dataclasses

import pytest

from tokenmill import SamplingParams
from tokenmill.engine.outputs import CompletionOutput, Logprob, RequestOutput, TokenLogprob
from tokenmill.engine.sample_groups import SampleGroup, sample_seed

SYSTEM = (
    "You are a careful assistant for a school. Answer in plain words, keep answers short, "
    "and never invent facts you are not sure about."
)
CONV = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a river."}]
SEEDED = dict(max_tokens=8, temperature=1.0, seed=7)


@pytest.fixture(scope="module")
def prompt(smollm2_llm) -> list[int]:
    return smollm2_llm.encode_chat(CONV)


# ---- result shape -----------------------------------------------------------------------
def test_flat_fields_are_the_first_completion(smollm2_llm) -> None:
    greedy = SamplingParams(max_tokens=6, temperature=0)
    plain, with_lp = smollm2_llm.generate(
        ["The capital of France is", "The capital of France is"],
        [greedy, dataclasses.replace(greedy, logprobs=2)],
    )
    for o in (plain, with_lp):
        assert o.finished and o.ok and o.prompt == "The capital of France is"
        assert len(o.outputs) == 1
        c = o.outputs[0]
        assert c.index == 0 and c.finished()
        assert (c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) == (
            o.text,
            o.token_ids,
            o.finish_reason,
            o.stop_reason,
            o.logprobs,
        )
        assert o.num_completion_tokens == len(c.token_ids) and o.prompt_logprobs is None
    assert plain.outputs[0].text == with_lp.outputs[0].text
    assert plain.outputs[0].cumulative_logprob is None and plain.logprobs is None
    lps = with_lp.outputs[0].logprobs
    assert lps is not None and len(lps) == len(with_lp.token_ids)
    assert with_lp.outputs[0].cumulative_logprob == pytest.approx(sum(lp.logprob for lp in lps))
    assert plain.request_id != with_lp.request_id
    token_prompt = smollm2_llm.generate([plain.prompt_token_ids], greedy)[0]
    assert token_prompt.prompt is None and token_prompt.token_ids == plain.token_ids


def test_request_output_keeps_flat_and_nested_in_step() -> None:
    lps = [TokenLogprob(5, -0.5, 1), TokenLogprob(6, -1.5, 2)]
    flat = RequestOutput("r", [1, 2], "ab", [5, 6], "length", logprobs=lps, num_cached_tokens=3)
    assert flat.outputs == [CompletionOutput(0, "ab", [5, 6], -2.0, lps, "length")]
    assert flat.num_cached_tokens == 3 and flat.prompt is None
    second = CompletionOutput(1, "c", [7], None, None, "stop", 2)
    both = RequestOutput.from_completions("r", [1, 2], [flat.outputs[0], second], prompt="x")
    assert (both.text, both.token_ids, both.logprobs) == ("ab", [5, 6], lps)
    with pytest.raises(ValueError, match="outputs\\[0\\]"):
        RequestOutput("r", [1], "other", [5, 6], "length", outputs=list(both.outputs))
    with pytest.raises(ValueError, match="indexes"):
        RequestOutput.from_completions("r", [1], [second])


def test_the_attributes_vllm_code_reads_are_there() -> None:
    """vLLM's RequestOutput and CompletionOutput attributes the engine has nothing for read
    as vLLM's do without them (they raised AttributeError in migrated code)."""
    out = RequestOutput("r", [1, 2], "ab", [5, 6], "length", num_cached_tokens=2)
    assert (out.metrics, out.lora_request, out.encoder_prompt) == (None, None, None)
    assert (out.encoder_prompt_token_ids, out.kv_transfer_params) == (None, None)
    assert out.multi_modal_placeholders == {} and out.num_cached_tokens == 2
    assert out.outputs[0].lora_request is None


# ---- n ----------------------------------------------------------------------------------
def test_a_positions_mapping_gives_the_chosen_token_first() -> None:
    """vLLM's order: the chosen token, then the alternatives by rank (a chosen token of rank
    15 came last, so ``next(iter(lp.values()))`` read the most likely one's logprob)."""
    lp = TokenLogprob(2807, -3.0, 15, {253: -0.1, 9: -0.9})
    assert list(lp) == [2807, 253, 9]
    assert next(iter(lp.values())) == Logprob(-3.0, 15)
    assert [(v.logprob, v.rank) for v in lp.values()] == [(-3.0, 15), (-0.1, 1), (-0.9, 2)]
    among = TokenLogprob(9, -0.9, 2, {253: -0.1, 9: -0.9})  # chosen and among the top: once
    assert list(among.items()) == [(9, Logprob(-0.9, 2)), (253, Logprob(-0.1, 1))]


def test_n_samples_are_distinct_reproducible_and_share_the_prompt(smollm2_llm, prompt) -> None:
    kv = smollm2_llm.engine.scheduler.kv
    hits_before = kv.prefix_cache_stats.hit_tokens
    seeded, unseeded = smollm2_llm.generate(
        [prompt, prompt],
        [SamplingParams(n=3, **SEEDED), SamplingParams(n=3, max_tokens=8, temperature=1.0)],
    )
    # The prompt's full blocks are computed once and reused by the other five samples.
    full_blocks = len(prompt) // smollm2_llm.config.block_size * smollm2_llm.config.block_size
    assert kv.prefix_cache_stats.hit_tokens - hits_before >= 5 * full_blocks
    for o in (seeded, unseeded):
        assert [c.index for c in o.outputs] == [0, 1, 2]
        assert len({tuple(c.token_ids) for c in o.outputs}) == 3
        assert o.text == o.outputs[0].text and o.token_ids == o.outputs[0].token_ids
    again = smollm2_llm.generate([prompt], SamplingParams(n=3, **SEEDED))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in seeded.outputs]
    assert [c.text for c in again.outputs] == [c.text for c in seeded.outputs]
    single = smollm2_llm.generate([prompt], SamplingParams(**SEEDED))[0]
    assert single.token_ids == seeded.outputs[0].token_ids  # n=1 samples as before


def test_greedy_n_gives_identical_completions(smollm2_llm, prompt) -> None:
    greedy = SamplingParams(max_tokens=6, temperature=0)
    two, one = smollm2_llm.generate([prompt, prompt], [dataclasses.replace(greedy, n=2), greedy])
    assert len(two.outputs) == 2
    assert two.outputs[0].token_ids == two.outputs[1].token_ids == one.token_ids
    assert two.outputs[0].text == two.outputs[1].text == one.text


def test_a_prompt_that_cannot_run_is_one_error_whatever_n(smollm2_llm, prompt) -> None:
    bad, good = smollm2_llm.generate([[], prompt], SamplingParams(n=2, max_tokens=2))
    assert bad.error is not None and "empty" in bad.error and bad.finish_reason == "error"
    assert [c.finish_reason for c in bad.outputs] == ["error"]
    assert good.ok and len(good.outputs) == 2


def test_sample_seeds() -> None:
    assert sample_seed(7, 0) == 7 and sample_seed(-3, 0) == -3
    seeds = [sample_seed(7, i) for i in range(1, 50)]
    assert len(set(seeds)) == 49 and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [sample_seed(7, i) for i in range(1, 50)]
    assert sample_seed(8, 1) != sample_seed(7, 1)


def _sample(rid: str, logprob: float, error: str | None = None) -> RequestOutput:
    return RequestOutput(rid, [1, 2], "x", [3], "error" if error else "stop", error=error,
                         outputs=[CompletionOutput(0, "x", [3], logprob, None,
                                                   "error" if error else "stop")])  # fmt: skip


def test_a_failed_completion_fails_its_prompt_and_ranks_last() -> None:
    """A completion whose grammar rejected a token (finish "error") is never passed off as
    a result: the prompt's output names it in ``error``; best_of ranks failed samples last,
    so the n returned are the ones that did not fail, when there are n."""
    group = SampleGroup.of("p", SamplingParams(n=2))
    ids = [rid for rid, _ in group.requests()]
    out = group.gather({ids[0]: _sample(ids[0], -1.0), ids[1]: _sample(ids[1], -2.0, "bad")})
    assert out.error == "completion 1: bad" and not out.ok
    assert [c.finish_reason for c in out.outputs] == ["stop", "error"]
    ranked = SampleGroup.of("q", SamplingParams(n=2, best_of=3, logprobs=0))
    ids = [rid for rid, _ in ranked.requests()]
    samples = {ids[0]: _sample(ids[0], -5.0), ids[1]: _sample(ids[1], -0.1, "bad"),
               ids[2]: _sample(ids[2], -3.0)}  # fmt: skip
    best = ranked.gather(samples)
    assert best.error is None and [c.cumulative_logprob for c in best.outputs] == [-3.0, -5.0]
    samples[ids[0]] = _sample(ids[0], -5.0, "worse")
    assert ranked.gather(samples).error == "completion 1: bad"  # of the two failed, the likelier


# ---- best_of ----------------------------------------------------------------------------
def test_best_of_returns_the_n_highest_cumulative_logprobs(smollm2_llm, prompt) -> None:
    best, best_lp, every = smollm2_llm.generate(
        [prompt] * 3,
        [
            SamplingParams(n=2, best_of=4, **SEEDED),
            SamplingParams(n=2, best_of=4, logprobs=1, **SEEDED),
            SamplingParams(n=4, logprobs=0, **SEEDED),  # the same four samples, all returned
        ],
    )
    candidates = sorted(
        every.outputs, key=lambda c: c.cumulative_logprob, reverse=True
    )  # distinct samples: no ties to order
    assert len({c.cumulative_logprob for c in candidates}) == 4
    for o in (best, best_lp):
        assert [c.index for c in o.outputs] == [0, 1]
        assert [c.token_ids for c in o.outputs] == [c.token_ids for c in candidates[:2]]
        scores = [c.cumulative_logprob for c in o.outputs]
        assert scores == pytest.approx([c.cumulative_logprob for c in candidates[:2]])
        assert scores[0] >= scores[1]
        assert o.text == o.outputs[0].text
    # Logprobs were computed to rank, but only the request that asked for them sees them.
    assert all(c.logprobs is None for c in best.outputs) and best.logprobs is None
    for c in best_lp.outputs:
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        assert all(len(lp.top) == 1 for lp in c.logprobs)


# ---- chat templates ---------------------------------------------------------------------
PLAIN_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
VARIABLE_TEMPLATE = (
    "{{ greeting }}|{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"
)


def test_chat_template_override_changes_the_prompt(smollm2_llm) -> None:
    conv = CONV[1:]
    tok = smollm2_llm.tokenizer
    expected = "[user] Name a river.\n[assistant]"
    o = smollm2_llm.chat(conv, SamplingParams(max_tokens=1), chat_template=PLAIN_TEMPLATE)[0]
    assert o.prompt == expected
    assert o.prompt_token_ids == tok.encode(expected, add_special_tokens=False)
    assert o.prompt_token_ids != smollm2_llm.encode_chat(conv)
    assert smollm2_llm.encode_chat(conv, chat_template=PLAIN_TEMPLATE) == o.prompt_token_ids
    no_prompt = smollm2_llm.encode_chat(conv, False, chat_template=PLAIN_TEMPLATE)
    assert no_prompt == tok.encode("[user] Name a river.\n", add_special_tokens=False)


def test_chat_template_kwargs_reach_the_template(smollm2_llm) -> None:
    conv = CONV[1:]
    tok = smollm2_llm.tokenizer
    o = smollm2_llm.chat(
        conv,
        SamplingParams(max_tokens=1),
        chat_template=VARIABLE_TEMPLATE,
        chat_template_kwargs={"greeting": "hello there", "enable_thinking": False},
    )[0]
    assert o.prompt == "hello there|Name a river./no_think"
    assert o.prompt_token_ids == tok.encode(o.prompt, add_special_tokens=False)
    thinking = smollm2_llm.encode_chat(
        conv, chat_template=VARIABLE_TEMPLATE, chat_template_kwargs={"enable_thinking": True}
    )
    assert thinking == tok.encode("|Name a river.", add_special_tokens=False)
    # The model's own template ignores variables it does not read.
    default = smollm2_llm.encode_chat(conv, chat_template_kwargs={"enable_thinking": False})
    assert default == smollm2_llm.encode_chat(conv)


def test_continue_final_message_leaves_the_assistant_answer_open(smollm2_llm) -> None:
    """vLLM's LLM.chat option: the model goes on writing an answer begun for it (the
    template's end of turn is not written after it), as transformers renders it."""
    conv = [*CONV[1:], {"role": "assistant", "content": "The longest river is"}]
    tok = smollm2_llm.tokenizer
    want = tok.apply_chat_template(conv, tokenize=False, continue_final_message=True)
    assert want.endswith("The longest river is")
    o = smollm2_llm.chat(
        conv, SamplingParams(max_tokens=2), add_generation_prompt=False, continue_final_message=True
    )[0]
    assert o.prompt == want
    assert o.prompt_token_ids == tok.encode(want, add_special_tokens=False)
    closed = smollm2_llm.encode_chat(conv, add_generation_prompt=False)
    assert len(closed) > len(o.prompt_token_ids)  # the end of turn
    with pytest.raises(ValueError, match="cannot both be true"):
        smollm2_llm.chat(conv, SamplingParams(max_tokens=1), continue_final_message=True)


def test_openai_spellings_render_as_every_entry_point_renders_them(smollm2_llm) -> None:
    """Text parts, the developer role and a tool-calling turn, as OpenAI clients send them:
    LLM.chat renders them as a job's reader does (it wrote the parts' repr and dropped the
    developer message), and a tool call's JSON arguments reach the template as a mapping."""
    plain = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "Summarize:\nThe cat sat."}]  # fmt: skip
    spelled = [{"role": "developer", "content": "Be brief."},
               {"role": "user", "content": [{"type": "text", "text": "Summarize:"},
                                            {"type": "text", "text": "The cat sat."}]}]  # fmt: skip
    assert smollm2_llm.encode_chat(spelled) == smollm2_llm.encode_chat(plain)
    out = smollm2_llm.chat(spelled, SamplingParams(max_tokens=1))[0]
    assert out.prompt_token_ids == smollm2_llm.encode_chat(plain)
    calls = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
              "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "18C"}]  # fmt: skip
    template = (
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[{{ c.function.name }}({{ c.function.arguments.city }})]"
        "{% endfor %}|{% endfor %}"
    )
    text = smollm2_llm.chat(calls, SamplingParams(max_tokens=1), chat_template=template)[0].prompt
    assert text == "user:Weather in Paris?|assistant:[weather(Paris)]|tool:18C|"
    # SmolLM2's template never reads tool_calls: the call was dropped from the prompt unsaid
    with pytest.raises(ValueError, match=r"messages\[1\] calls tools .* does not render"):
        smollm2_llm.encode_chat(calls)
    bad = [calls[0], {**calls[1], "tool_calls": ["x"]}]
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\] must be a tool call"):
        smollm2_llm.encode_chat(bad, chat_template=template)
    with pytest.raises(ValueError, match=r"messages\[0\]\.role is \['user'\]; expected"):
        smollm2_llm.encode_chat([{"role": ["user"], "content": "hi"}])
    with pytest.raises(ValueError, match=r"messages\[1\]\.content\[0\] is not a text part"):
        smollm2_llm.encode_chat([plain[0], {"role": "user", "content": [{"type": "image_url"}]}])


# ---- refusals ---------------------------------------------------------------------------
def test_a_prompt_that_is_not_unicode_is_named(smollm2_llm) -> None:
    """A lone surrogate made the tokenizer raise a TypeError naming neither prompt nor cause."""
    params = SamplingParams(max_tokens=1)
    with pytest.raises(ValueError, match=r"prompt 1 is not valid Unicode .* at character 4"):
        smollm2_llm.generate(["fine", "bad \ud800 one"], params)
    with pytest.raises(ValueError, match="prompt 1 is not valid Unicode"):
        smollm2_llm.chat([[{"role": "user", "content": "ok"}],
                          [{"role": "user", "content": "x\udc00"}]], params)  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"n": 0}, "SamplingParams.n must be an integer >= 1"),
        ({"n": 2.0}, "SamplingParams.n "),
        ({"n": True}, "SamplingParams.n "),
        ({"n": 2, "best_of": 1}, "SamplingParams.best_of must be None or an integer >= n"),
        ({"best_of": "3"}, "SamplingParams.best_of "),
        ({"best_of": 0}, "SamplingParams.best_of "),
        ({"prompt_logprobs": 21}, r"SamplingParams.prompt_logprobs must be None or an integer"),
        # past float32's range: the sampler's columns would hold inf (and inf / inf = nan)
        ({"temperature": 1e39}, r"SamplingParams.temperature must be a number >= 0 \(at most"),
        ({"repetition_penalty": 1e300}, r"SamplingParams.repetition_penalty must be a number"),
        # ints too large for a float: an OverflowError before
        ({"temperature": 10**400}, r"SamplingParams.temperature must be a number"),
        ({"top_p": 10**400}, r"SamplingParams.top_p must be in"),
        ({"logit_bias": {5: 10**400}}, r"logit_bias: the bias of token 5 must be a number"),
        # a huge id failed the whole generate() call in the scheduler; others became EOS (2.7)
        ({"stop_token_ids": [2**63]}, r"SamplingParams.stop_token_ids must be a list of token"),
        ({"stop_token_ids": [2.7]}, r"SamplingParams.stop_token_ids "),
        ({"stop_token_ids": [True]}, r"SamplingParams.stop_token_ids "),
        ({"stop_token_ids": [-1]}, r"SamplingParams.stop_token_ids "),
        ({"stop_token_ids": "12"}, r"SamplingParams.stop_token_ids "),
        # flags were taken as truthy, counts took True as 1
        ({"ignore_eos": "no"}, r"SamplingParams.ignore_eos must be True or False"),
        ({"skip_special_tokens": "x"}, r"SamplingParams.skip_special_tokens must be True or"),
        ({"include_stop_str_in_output": 1}, r"SamplingParams.include_stop_str_in_output "),
        ({"max_tokens": True}, r"SamplingParams.max_tokens "),
        ({"top_k": True}, r"SamplingParams.top_k "),
        ({"logprobs": True}, r"SamplingParams.logprobs "),
        ({"seed": True}, r"SamplingParams.seed "),
    ],
)
def test_invalid_sampling_params_are_refused(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_a_temperature_below_1e_5_samples_greedily() -> None:
    """1e-40 passed and overflowed the logits to inf: every row sampled token 0."""
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=1e-5).temperature
    assert SamplingParams(stop_token_ids=[3, 7]).stop_token_ids == (3, 7)


def test_explicit_defaults_are_accepted() -> None:
    p = SamplingParams(n=1, best_of=1, prompt_logprobs=None)
    assert p.num_samples == 1 and SamplingParams(n=2, best_of=5).num_samples == 5


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"chat_template": ""}, "chat_template must be a non-empty Jinja template"),
        ({"chat_template": 3}, "chat_template must be"),
        ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs must be a dict"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs may not set tokenize"),
        ({"chat_template_kwargs": {1: True}}, "chat_template_kwargs keys must be identifiers"),
    ],
)
def test_invalid_chat_arguments_are_refused(smollm2_llm, kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        smollm2_llm.chat(CONV, SamplingParams(max_tokens=1), **kwargs)


def test_a_bad_conversation_of_several_is_named_by_its_index(smollm2_llm) -> None:
    """'messages[0].content must be a string' named no conversation of the call's many."""
    bad = [{"role": "user", "content": None}]
    with pytest.raises(ValueError, match=r"^conversation 2: messages\[0\]\.content must be"):
        smollm2_llm.chat([CONV, CONV, bad], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content must be"):  # one: no index
        smollm2_llm.chat(bad, SamplingParams(max_tokens=1))


def test_tools_a_template_never_reads_are_refused(smollm2_llm) -> None:
    """SmolLM2's template reads no ``tools``: they were dropped, the model never told of
    them; a template that reads them takes them."""
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    with pytest.raises(ValueError, match="tools are given, but the model's chat template"):
        smollm2_llm.chat(CONV, SamplingParams(max_tokens=1), tools=tools)
    with pytest.raises(ValueError, match="does not render them"):
        smollm2_llm.encode_chat(CONV, chat_template_kwargs={"tools": tools})
    reads = "{% for t in tools %}{{ t.function.name }}:{% endfor %}{{ messages[-1].content }}"
    out = smollm2_llm.chat(CONV, SamplingParams(max_tokens=1), chat_template=reads, tools=tools)
    assert out[0].prompt == "weather:Name a river."


def test_the_engine_refuses_several_completions_per_request(smollm2_llm, prompt) -> None:
    with pytest.raises(ValueError, match="n=2, best_of=None must be 1"):
        smollm2_llm.engine.add_request("direct", prompt, SamplingParams(n=2))
    assert not smollm2_llm.engine.has_unfinished()


# ---- stop tokens' text ---------------------------------------------------------------------
@pytest.mark.parametrize("watched", [False, True], ids=["decoded-at-finish", "incremental"])
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_tokens_text_is_output_only_when_asked_for(
    smollm2_llm, prompt, watched: bool, include: bool
) -> None:
    """As vLLM's: the text of the stop token (``stop_token_ids``) or EOS that ended a
    request is left out unless ``include_stop_str_in_output``; the token stays in
    ``token_ids``. The same whether the text is decoded at the end or as the request runs
    (a stop string to watch)."""
    tokenizer = smollm2_llm.engine.tokenizer
    ref = smollm2_llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0]
    stop_id = ref.token_ids[3]
    cut = ref.token_ids.index(stop_id) + 1
    extra = dict(stop=["never in this text"]) if watched else {}
    by_token = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_id],
                              include_stop_str_in_output=include, **extra)  # fmt: skip
    eos = smollm2_llm.engine.model_config.eos_token_ids[0]
    by_eos = SamplingParams(max_tokens=8, temperature=0, min_tokens=3, logit_bias={eos: 100},
                            skip_special_tokens=False, include_stop_str_in_output=include,
                            **extra)  # fmt: skip
    token_out, eos_out = smollm2_llm.generate([prompt, prompt], [by_token, by_eos])
    assert token_out.token_ids == ref.token_ids[:cut]
    assert (token_out.finish_reason, token_out.stop_reason) == ("stop", stop_id)
    assert token_out.text == tokenizer.decode(ref.token_ids[: cut if include else cut - 1])
    assert eos_out.token_ids[-1] == eos and len(eos_out.token_ids) == 4
    assert (eos_out.finish_reason, eos_out.stop_reason) == ("stop", None)
    shown = eos_out.token_ids if include else eos_out.token_ids[:-1]
    assert eos_out.text == tokenizer.decode(shown, skip_special_tokens=False)
    assert eos_out.text.endswith(tokenizer.decode([eos])) is include


@pytest.mark.parametrize("settings", [{"max_tokens": 2**63}, {"top_k": 2**40}])
def test_counts_past_the_engine_columns_are_refused_up_front(settings: dict) -> None:
    """They overflowed the engine's int64 columns when the request was added (OverflowError
    out of the step, the engine left half-updated)."""
    with pytest.raises(ValueError, match=r"must be .*2\*\*31 - 1"):
        SamplingParams(**settings)
