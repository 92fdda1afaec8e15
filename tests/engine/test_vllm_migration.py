"""A vLLM offline-inference script runs against tokenmill with only its import changed.

The script below is written the way vLLM's own examples read (LLM(model=...),
SamplingParams with n / temperature / top_p / logprobs, llm.generate over text prompts,
llm.chat over a conversation, results read through ``outputs[i]`` and the per-position
logprob mappings). Only ``from vllm import`` becomes ``from tokenmill import``.
"""

from __future__ import annotations

import json
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


# The spellings vLLM's own examples use beyond the script above, as an audit of 21 such
# scripts found them failing with TypeError or AttributeError (or, for decoded_token,
# silently None).
VLLM_SPELLINGS = """
from vllm import LLM, SamplingParams, GuidedDecodingParams, StructuredOutputsParams

llm = LLM(model=MODEL, dtype="float", gpu_memory_utilization=0.5, enforce_eager=True,
          tensor_parallel_size=1, trust_remote_code=False, seed=None, disable_log_stats=True)
tokenizer = llm.get_tokenizer()
params = SamplingParams(temperature=0, max_tokens=4, stop=None, stop_token_ids=None,
                        logprobs=1)
outputs = llm.generate(["Hello, my name is"], params, use_tqdm=False, lora_request=None)
decoded = [[(lp.decoded_token, tokenizer.decode([t])) for t, lp in position.items()]
           for position in outputs[0].outputs[0].logprobs]
choice = SamplingParams(max_tokens=8, temperature=0,
                        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
old_choice = SamplingParams(max_tokens=8, temperature=0,
                            guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2),
                use_tqdm=False, tools=tools, chat_template=TOOLS_TEMPLATE)
"""
TOOLS_TEMPLATE = (
    "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
    "{% for m in messages %}{{ m.content }}{% endfor %}"
)


def test_vllm_spellings_run_as_written(model: Path) -> None:
    from tokenmill import SamplingParams

    pytest.importorskip("llguidance")
    script = VLLM_SPELLINGS.replace("from vllm import", "from tokenmill import")
    scope = {"MODEL": str(model), "TOOLS_TEMPLATE": TOOLS_TEMPLATE}
    exec(compile(script, "vllm_spellings.py", "exec"), scope)  # noqa: S102
    llm = scope["llm"]
    assert llm.config.cuda_graphs is False and llm.config.seed == 0
    assert scope["tokenizer"] is llm.tokenizer
    pairs = [pair for position in scope["decoded"] for pair in position]
    assert pairs and all(ours == theirs for ours, theirs in pairs)  # decoded_token filled
    # special tokens spelled out, as vLLM's decoded_token, whatever skip_special_tokens says
    eos = llm.tokenizer.eos_token_id
    forced = llm.generate("a", SamplingParams(max_tokens=1, logprobs=0, logit_bias={eos: 100},
                                              ignore_eos=True))[0]  # fmt: skip
    assert forced.outputs[0].logprobs[0][eos].decoded_token == llm.tokenizer.eos_token
    assert scope["choice"].structured_output == scope["old_choice"].structured_output
    assert scope["choice"].structured_output == 'choice:["yes","no"]'
    assert scope["chat"][0].prompt == "[weather]hi"


def test_vllms_no_op_sampling_arguments_are_taken_and_others_named() -> None:
    """vLLM scripts spell out ``detokenize=True``, ``bad_words=None``...: a TypeError
    ("unexpected keyword argument") stopped them; a value that would change the output is
    refused, naming the argument and what to use instead."""
    from tokenmill import SamplingParams

    params = SamplingParams(
        max_tokens=3, detokenize=True, spaces_between_special_tokens=True,
        allowed_token_ids=None, bad_words=[], logits_processors=None, extra_args=None,
    )  # fmt: skip
    assert params == SamplingParams(max_tokens=3) and params.detokenize is True
    refused = {
        "detokenize": (False, "always decodes"),
        "allowed_token_ids": ([5, 6], "logit_bias"),
        "bad_words": (["no"], "logit_bias"),
        "spaces_between_special_tokens": (1, "tokenizer's decode"),
    }
    for name, (value, hint) in refused.items():
        with pytest.raises(ValueError, match=f"SamplingParams.{name}=.*is not supported.*{hint}"):
            SamplingParams(**{name: value})


def test_output_kinds_that_change_nothing_offline_are_taken_and_delta_named() -> None:
    """vLLM's ``output_kind`` was a TypeError. Offline calls return final outputs only, as
    CUMULATIVE (vLLM's default) and FINAL_ONLY do; DELTA would be silently ignored."""
    from tokenmill import RequestOutputKind, SamplingParams

    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY, 2):
        assert SamplingParams(max_tokens=3, output_kind=kind) == SamplingParams(max_tokens=3)
    with pytest.raises(ValueError, match=r"output_kind=RequestOutputKind.DELTA is not supported"):
        SamplingParams(output_kind=RequestOutputKind.DELTA)
    with pytest.raises(ValueError, match=r"output_kind must be .*got 'final_only'"):
        SamplingParams(output_kind="final_only")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tensor_parallel_size": 2}, "tensor_parallel_size must be 1"),
        ({"trust_remote_code": True}, "never a checkpoint's own code"),
        ({"tokenizer": "/some/other/tokenizer"}, "the engine uses the model's own tokenizer"),
        ({"enable_chunked_prefill": False}, "enable_chunked_prefill=False is not supported"),
        # an audit: 0 passed the `is False` check and True the `in (1, None)` one
        ({"enable_chunked_prefill": 0}, "enable_chunked_prefill=0 is not supported"),
        ({"tensor_parallel_size": True}, "tensor_parallel_size must be 1.*got True"),
        ({"pipeline_parallel_size": 1.0}, "pipeline_parallel_size must be 1.*got 1.0"),
        ({"gpu_memory_utilization": 0.5, "kv_cache_memory": 0.4, "device": "cuda"}, "keep one"),
        ({"gpu_memory_utilization": 1.5, "device": "cuda"}, "must be in \\(0, 1\\]"),
    ],
)
def test_vllm_settings_tokenmill_cannot_honour_are_refused(settings, message) -> None:
    from tokenmill.engine.vllm_settings import engine_settings

    with pytest.raises(ValueError, match=message):
        engine_settings("m", settings)


def test_gpu_memory_utilization_is_the_kv_cache_share_on_a_gpu_only() -> None:
    from tokenmill.engine.vllm_settings import engine_settings

    assert engine_settings("m", {"gpu_memory_utilization": 0.8, "device": "cuda"}) == {
        "device": "cuda",
        "kv_cache_memory": 0.8,
    }
    assert engine_settings("m", {"gpu_memory_utilization": 0.8, "device": "cpu"}) == {
        "device": "cpu"
    }
    # vLLM's int 1 is the whole device; kv_cache_memory's int 1 would be one byte
    whole = engine_settings("m", {"gpu_memory_utilization": 1, "device": "cuda"})
    assert whole["kv_cache_memory"] == 1.0 and isinstance(whole["kv_cache_memory"], float)
    # vLLM's defaults, and the model's own path spelled another way
    assert engine_settings("m", {"enable_chunked_prefill": None}) == {}


@pytest.mark.parametrize(
    "name", ["quantization", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching",
             "block_size"],
)  # fmt: skip
def test_vllms_none_defaults_are_the_engines_defaults(name: str) -> None:
    """vLLM's ``LLM(quantization=None)`` and its EngineArgs' ``None`` (``max_num_seqs``,
    ``max_num_batched_tokens``, ``enable_prefix_caching``, ``block_size``) mean the engine's
    default; scripts pass them through from argparse. They were refused as bad values
    ("quantization: expected one of none, fp8, int4, int8, got None")."""
    from tokenmill import EngineConfig
    from tokenmill.engine.vllm_settings import engine_settings

    settings = engine_settings("m", {name: None, "max_model_len": None})
    assert settings == {"max_model_len": None}  # (EngineConfig's own None, kept)
    default = EngineConfig.from_settings("m")
    assert getattr(EngineConfig.from_settings("m", **settings), name) == getattr(default, name)


def test_the_model_folder_as_its_own_tokenizer_is_taken_however_spelled(model: Path) -> None:
    from tokenmill.engine.vllm_settings import engine_settings

    assert engine_settings(str(model), {"tokenizer": f"{model}/"}) == {}


def test_llm_engine_is_the_engine_under_vllms_name(model: Path) -> None:
    """vLLM scripts read ``llm.llm_engine.get_tokenizer()`` and
    ``llm.llm_engine.model_config.max_model_len``: an AttributeError on ``llm_engine``
    stopped them. The engine's model_config is the model's config.json: vLLM's engine
    settings read from it say where they are."""
    from tokenmill import LLM

    llm = LLM(model=str(model), dtype="float32", max_model_len=128)
    assert llm.llm_engine is llm.engine
    assert llm.llm_engine.get_tokenizer() is llm.get_tokenizer() is llm.tokenizer
    assert llm.llm_engine.max_model_len == 128
    with pytest.raises(AttributeError, match=r"no 'max_model_len'.*llm.llm_engine.max_model_len"):
        llm.llm_engine.model_config.max_model_len  # noqa: B018
    with pytest.raises(AttributeError, match=r"has no attribute 'no_such_name'$"):
        llm.llm_engine.model_config.no_such_name  # noqa: B018


def test_sampling_params_fields_may_be_set_after_it_is_made(model: Path) -> None:
    """vLLM's example: params = llm.get_default_sampling_params(); params.max_tokens = n.
    A bad value is refused and leaves the params as they were."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(model), device="cpu", kv_cache_memory=16 << 20)
    params = llm.get_default_sampling_params()
    params.max_tokens = 3
    params.temperature = 0
    out = llm.generate("a b", params)[0]
    assert len(out.token_ids) == 3
    assert (
        out.token_ids
        == llm.generate("a b", SamplingParams(max_tokens=3, temperature=0))[0].token_ids
    )
    with pytest.raises(ValueError, match="top_p must be in"):
        params.top_p = 2
    assert params.top_p == 1.0 and params.max_tokens == 3
    params.stop = ["x"]
    assert params.stop == ("x",)  # normalized as in the constructor
    with pytest.raises(AttributeError, match="no field 'max_token'"):
        params.max_token = 4


def test_chat_template_kwargs_tools_win_over_the_tools_argument(model: Path) -> None:
    from tokenmill import LLM

    llm = LLM(str(model), device="cpu", kv_cache_memory=16 << 20)
    template = "TOOLS={{ tools | length }}{% for m in messages %}{{ m.content }}{% endfor %}"
    one, two = [{"name": "a"}], [{"name": "a"}, {"name": "b"}]
    out = llm.chat([{"role": "user", "content": "hi"}], chat_template=template, tools=one,
                   chat_template_kwargs={"tools": two})  # fmt: skip
    assert out[0].prompt == "TOOLS=2hi"  # as vLLM merges them


def test_chat_takes_vllms_argument_names_and_order(model: Path) -> None:
    """``chat(messages=...)`` and vLLM's positional order (use_tqdm third, the template
    fifth) raised TypeError; content formats other than a string are refused by name."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(model), device="cpu", kv_cache_memory=16 << 20)
    template = "{% for m in messages %}<{{ m.content }}>{% endfor %}"
    hi = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    greedy = SamplingParams(max_tokens=2, temperature=0)
    named = llm.chat(messages=hi, sampling_params=greedy, use_tqdm=False,
                     chat_template=template, chat_template_content_format="string")  # fmt: skip
    placed = llm.chat(hi, greedy, False, None, template, "auto", True, False, None, None)
    assert named[0].prompt == placed[0].prompt == "<hi>"
    assert named[0].token_ids == placed[0].token_ids
    with pytest.raises(ValueError, match="chat_template_content_format 'openai' is not"):
        llm.chat(hi, greedy, chat_template=template, chat_template_content_format="openai")


def test_max_tokens_none_runs_to_the_end_of_the_context(model: Path) -> None:
    """vLLM's ``max_tokens=None``: no limit but the context (refused before)."""
    from tokenmill import LLM, SamplingParams

    params = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    assert params.max_tokens == 2**31 - 1
    llm = LLM(str(model), device="cpu", max_model_len=32, kv_cache_memory=16 << 20)
    out = llm.generate([list(range(5, 15))], params)[0]
    assert (len(out.token_ids), out.finish_reason, out.error) == (22, "length", None)
    params.max_tokens = 8
    params.max_tokens = None  # set afterwards too
    assert params.max_tokens == 2**31 - 1


def test_sampling_params_clone_and_vllm_prompt_dicts(model: Path) -> None:
    """``params.clone()`` raised AttributeError; a dict prompt with vLLM's empty multimodal
    keys, or ids with their text beside them, was refused."""
    from tokenmill import LLM, SamplingParams

    params = SamplingParams(max_tokens=3, temperature=0, logit_bias={5: 1.0})
    copy = params.clone()
    copy.max_tokens, copy.logit_bias[5] = 4, 2.0
    assert (params.max_tokens, params.logit_bias) == (3, {5: 1.0}) and copy.max_tokens == 4
    llm = LLM(str(model), device="cpu", kv_cache_memory=16 << 20)
    ids = list(range(5, 12))
    plain = llm.generate([ids], params)[0]
    outs = llm.generate(
        [{"prompt_token_ids": ids, "prompt": "its text"},
         {"prompt_token_ids": ids, "multi_modal_data": None, "mm_processor_kwargs": None}],
        params,
    )  # fmt: skip
    assert [o.token_ids for o in outs] == [plain.token_ids] * 2
    assert [o.prompt for o in outs] == ["its text", None]
    with pytest.raises(ValueError, match="prompt 0: 'multi_modal_data' .* text-only models"):
        llm.generate({"prompt": "a", "multi_modal_data": {"image": 1}}, params)
    with pytest.raises(ValueError, match="prompt 0: 'prompt_token_ids' holds a list"):
        llm.generate({"prompt_token_ids": "abc"}, params)


def test_vllms_prompt_typeddicts_import_and_run(model: Path) -> None:
    """``from vllm.inputs import TokensPrompt, TextPrompt`` had nothing to become: importing
    them from tokenmill was an ImportError, though the dicts they build ran. Their keys for
    other kinds of models are refused by name when they hold something."""
    from tokenmill import LLM, SamplingParams, TextPrompt, TokensPrompt

    params = SamplingParams(max_tokens=3, temperature=0)
    llm = LLM(str(model), device="cpu", kv_cache_memory=16 << 20)
    ids = list(range(5, 12))
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=ids), TextPrompt(prompt="a b"),
         TokensPrompt(prompt_token_ids=ids, prompt="its text", multi_modal_data=None)],
        params,
    )  # fmt: skip
    assert outs[0].token_ids == llm.generate([ids], params)[0].token_ids == outs[2].token_ids
    assert outs[1].token_ids == llm.generate("a b", params)[0].token_ids
    assert [o.prompt for o in outs] == [None, "a b", "its text"]
    refused = {
        "multi_modal_data": {"image": object()},
        "mm_processor_kwargs": {"size": 1},
        "cache_salt": "x",
        "token_type_ids": [0] * len(ids),
    }
    for key, value in refused.items():
        with pytest.raises(ValueError, match=f"prompt 1: '{key}' is not supported"):
            llm.generate([ids, TokensPrompt(prompt_token_ids=ids, **{key: value})], params)


def test_seeds_the_engine_cannot_tell_apart_are_refused(model: Path) -> None:
    """The engine keeps a seed's 64 bits: seed 2**64 sampled as seed 0, 2**64 - 1 as -1.
    Seeds are now signed 64-bit integers (vLLM's server's range), each sampling its own."""
    from tokenmill import LLM, SamplingParams

    for seed in (2**64, 2**63, -(2**63) - 1, 10**40):
        with pytest.raises(ValueError) as info:
            SamplingParams(seed=seed)
        assert str(info.value) == (
            "SamplingParams.seed must be None or an integer in [-2**63, 2**63 - 1] (the engine "
            f"keeps a seed's 64 bits: one outside would sample as one inside), got {seed}"
        )
    params = SamplingParams(seed=5)
    with pytest.raises(ValueError, match="SamplingParams.seed must be"):
        params.seed = 2**64
    assert params.seed == 5
    llm = LLM(str(model), device="cpu", kv_cache_memory=16 << 20)
    seeds = (0, 1, -2, 2**63 - 1, -(2**63))  # (-1 is vLLM's "no seed": the test below)
    sampled = llm.generate([[5, 6, 7]] * len(seeds), [SamplingParams(max_tokens=6, seed=s)
                                                      for s in seeds])  # fmt: skip
    assert len({tuple(o.token_ids) for o in sampled}) == len(seeds)


def test_seed_minus_one_is_no_seed_as_in_vllm(model: Path) -> None:
    """vLLM's SamplingParams reads seed=-1 as None, and scripts pass it for "random"; it was
    a fixed seed here, so every run of such a script drew the same completions."""
    from tokenmill import LLM, SamplingParams

    assert SamplingParams(seed=-1).seed is None
    params = SamplingParams(seed=5)
    params.seed = -1
    assert params.seed is None
    llm = LLM(str(model), device="cpu", kv_cache_memory=16 << 20)
    random = SamplingParams(max_tokens=8, temperature=1.0, seed=-1)
    runs = {tuple(llm.generate([[5, 6, 7]], random)[0].token_ids) for _ in range(4)}
    assert len(runs) > 1  # unseeded: each call draws anew


def test_lora_and_grammars_are_refused_by_name(model: Path) -> None:
    from tokenmill import LLM, StructuredOutputsParams

    with pytest.raises(ValueError, match="StructuredOutputsParams\\(grammar=...\\) is not"):
        StructuredOutputsParams(grammar='root ::= "a"')
    llm = LLM(str(model), device="cpu", kv_cache_memory=16 << 20)
    with pytest.raises(ValueError, match="LoRA adapters are not supported"):
        llm.generate("a", lora_request=object())


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(model: Path) -> None:
    """vLLM's left truncation: k keeps the last k prompt tokens; -1 what the context leaves
    room for (a prompt too long for it then runs instead of failing)."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(model), device="cpu", max_model_len=32, kv_cache_memory=16 << 20)
    ids = list(range(5, 45))  # 40 tokens: more than the context holds
    greedy = {"max_tokens": 2, "temperature": 0}
    cut = llm.generate([ids], SamplingParams(truncate_prompt_tokens=6, **greedy))[0]
    assert cut.prompt_token_ids == ids[-6:] and cut.error is None
    assert cut.token_ids == llm.generate([ids[-6:]], SamplingParams(**greedy))[0].token_ids
    room = llm.generate([ids], SamplingParams(truncate_prompt_tokens=-1, **greedy))[0]
    assert room.prompt_token_ids == ids[-31:] and room.error is None
    assert llm.generate([ids], SamplingParams(**greedy))[0].finish_reason == "error"
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_a_call_runs_with_the_params_as_they_were_when_it_started(model: Path) -> None:
    """Params set from another thread mid-call changed requests already queued (lengths
    60, 2, 2) or failed the whole call (an n the gathering no longer matched)."""
    import threading

    from tokenmill import LLM, SamplingParams

    llm = LLM(str(model), device="cpu", max_num_seqs=1, kv_cache_memory=16 << 20)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, n=2)
    started = threading.Event()
    original_step = llm.engine.step

    def step_then_meddle():  # the first step runs, then the caller's params change
        out = original_step()
        if not started.is_set():
            started.set()
            params.max_tokens = 2
            params.n = 1
        return out

    llm.engine.step = step_then_meddle
    outs = llm.generate(["a b", "c d", "e f"], params)
    assert started.is_set() and params.max_tokens == 2
    assert [[len(c.token_ids) for c in o.outputs] for o in outs] == [[12, 12]] * 3


def test_stop_lists_read_back_as_tuples_as_readme_says() -> None:
    """vLLM's ``params.stop`` is a list; tokenmill's is a tuple, kept so that a field changes
    only through the checked assignment (a call's shallow copy of its params holds, and an
    empty stop string or a negative stop id cannot slip in). README's vLLM list said nothing
    of it, so ``params.stop.append`` failed unexplained."""
    from tokenmill import SamplingParams

    params = SamplingParams(stop=["a"], stop_token_ids=[3])
    assert (params.stop, params.stop_token_ids) == (("a",), (3,))
    with pytest.raises(AttributeError):
        params.stop.append("b")  # type: ignore[attr-defined]
    params.stop = [*params.stop, "b"]  # what README says to write instead
    params.stop_token_ids = [*params.stop_token_ids, 4]
    assert (params.stop, params.stop_token_ids) == (("a", "b"), (3, 4))
    with pytest.raises(ValueError, match="stop_token_ids"):
        params.stop_token_ids = [*params.stop_token_ids, -1]
    assert params.stop_token_ids == (3, 4)
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    differs = readme.split("Not there: LoRA", 1)[1].split("\n- ", 1)[0]
    assert "`params.stop.append(" in differs and "`params.stop = [*params.stop, " in differs


def test_fields_cannot_be_deleted_and_subclasses_keep_their_own() -> None:
    import dataclasses

    from tokenmill import SamplingParams

    params = SamplingParams(max_tokens=4)
    with pytest.raises(AttributeError, match="cannot be deleted"):
        del params.truncate_prompt_tokens
    with pytest.raises(ValueError, match="temperature"):
        params.temperature = -3  # still checked

    @dataclasses.dataclass
    class Tagged(SamplingParams):
        tag: str = "x"

    tagged = Tagged(max_tokens=3, tag="y")
    tagged.tag = "z"
    tagged.max_tokens = 5
    assert (tagged.tag, tagged.max_tokens) == ("z", 5)
    params.structured_outputs = {"type": "object"}  # vLLM's name, set as an attribute too
    assert params.structured_output == '{"type":"object"}'


def test_calls_without_sampling_params_take_the_models_generation_config(
    tmp_path: Path,
) -> None:
    """vLLM's generation_config="auto": generation_config.json's sampling values are the
    defaults of get_default_sampling_params() and of a call given no SamplingParams (they
    were SamplingParams(): Qwen3's temperature 0.6 / top_k 20 sampled at 1.0 with no top-k).
    transformers' own defaults (top_k 50) are left out, as vLLM's to_diff_dict leaves them."""
    from tokenmill import LLM, SamplingParams

    path = save_tiny_model("llama", tmp_path / "m")
    generation = json.loads((path / "generation_config.json").read_text())
    generation.update(temperature=0.0, top_p=0.9, min_p=0.05, max_new_tokens=7)
    (path / "generation_config.json").write_text(json.dumps({**generation, "top_k": 50}))
    llm = LLM(str(path), device="cpu", kv_cache_memory=16 << 20)
    defaults = llm.get_default_sampling_params()
    expected = SamplingParams(temperature=0.0, top_p=0.9, min_p=0.05, max_tokens=7)
    assert defaults == expected and defaults is not llm.get_default_sampling_params()
    assert llm.generate("Hello")[0].token_ids == llm.generate("Hello", expected)[0].token_ids
    chat = [{"role": "user", "content": "hi"}]
    assert llm.chat(chat)[0].token_ids == llm.chat(chat, expected)[0].token_ids
    plain = LLM(str(path), device="cpu", kv_cache_memory=16 << 20, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match="generation_config must be 'auto'"):
        LLM(str(path), device="cpu", generation_config="model")
    (path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="generation_config.json: SamplingParams.temperature"):
        LLM(str(path), device="cpu", kv_cache_memory=16 << 20)
