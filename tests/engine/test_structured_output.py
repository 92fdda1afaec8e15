"""Structured output (JSON schema through llguidance): every constrained completion parses and
validates; unconstrained rows in the same batch are untouched; async scheduling, preemption,
speculative decoding and n > 1 keep it correct; without llguidance only such requests fail."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.tiny_models import EOS_ID, save_tiny_model, save_tiny_tokenizer
from tokenmill import LLM, SamplingParams
from tokenmill.engine.core.request import Request
from tokenmill.engine.engine_config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.sampler import Sampler, apply_token_bitmask
from tokenmill.engine.sampling_metadata import SamplingMetadata
from tokenmill.engine.structured_output import StructuredOutputs, check_structured_output

ROOT = Path(__file__).resolve().parents[2]

REVIEW_SCHEMA = {
    "type": "object",
    "properties": {
        "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
        "stars": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["sentiment", "stars"],
    "additionalProperties": False,
}
TINY_SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "enum": ["cat", "dog", "bird"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["label", "count"],
    "additionalProperties": False,
}
REVIEWS = [
    "The food was great and the staff friendly.",
    "Terrible service, the soup was cold.",
    "It was fine, nothing special.",
]


def validate(text: str, schema: dict[str, Any]) -> dict[str, Any]:
    """Parse ``text`` and check it against ``schema`` (jsonschema when installed)."""
    value = json.loads(text)
    try:
        import jsonschema
    except ImportError:  # by hand, for the schemas of these tests
        assert isinstance(value, dict) and set(value) == set(schema["required"])
        for key, prop in schema["properties"].items():
            if "enum" in prop:
                assert value[key] in prop["enum"]
            if prop["type"] == "integer":
                assert isinstance(value[key], int)
                assert prop.get("minimum", value[key]) <= value[key] <= prop.get("maximum", 1e18)
        return value
    jsonschema.validate(value, schema)
    return value


# ---- the parameter ------------------------------------------------------------------------


def test_structured_output_is_validated_and_kept_as_compact_json() -> None:
    text = check_structured_output(REVIEW_SCHEMA)
    assert text == json.dumps(REVIEW_SCHEMA, separators=(",", ":"))
    assert check_structured_output(json.dumps(REVIEW_SCHEMA, indent=2)) == text  # a JSON string
    assert list(json.loads(text)["properties"]) == ["sentiment", "stars"]  # order kept
    params = SamplingParams(structured_output=REVIEW_SCHEMA)
    assert params.structured_output == text
    assert SamplingParams(structured_output="json_object").structured_output == "json_object"
    assert SamplingParams().structured_output is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "JSON schema object"),
        (7, "a JSON schema (a dict or a JSON string)"),
        ({"type": "object", "properties": {"a": {"type": "strng"}}}, "cannot compile this"),
        ({"type": "string", "format": "no-such-format"}, "cannot compile this JSON schema"),
        ({"type": "object", "default": {1, 2}}, "not JSON-serializable"),
    ],
)
def test_a_bad_schema_is_a_value_error_naming_the_parameter(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match="SamplingParams.structured_output") as info:
        SamplingParams(structured_output=value)
    assert message in str(info.value)


def test_the_engine_imports_and_runs_without_llguidance() -> None:
    probe = """
import builtins
real = builtins.__import__
def guarded(name, *args, **kwargs):
    if name.split(".")[0] == "llguidance":
        raise ImportError("not installed: " + name)
    return real(name, *args, **kwargs)
builtins.__import__ = guarded
import tokenmill.engine.llm_engine
from tokenmill import SamplingParams
SamplingParams(max_tokens=4, temperature=0)
try:
    SamplingParams(structured_output={"type": "object"})
except ImportError as exc:
    print("refused:", exc)
"""
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused:" in out.stdout and "pip install llguidance" in out.stdout


# ---- the per-request grammars, without a model ------------------------------------------------


@pytest.fixture(scope="module")
def grammars(tmp_path_factory) -> StructuredOutputs:
    tokenizer = save_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    return StructuredOutputs(tokenizer, vocab_size=288, eos_token_ids=[EOS_ID])


def _request(rid: str, schema: Any = TINY_SCHEMA) -> Request:
    return Request(rid, [5, 6, 7], SamplingParams(structured_output=schema), (EOS_ID,))


def _allowed(mask_row: np.ndarray) -> set[int]:
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def test_grammar_follows_the_output_and_never_feeds_a_token_twice(grammars) -> None:
    req, plain = _request("a"), Request("p", [5, 6], SamplingParams(), (EOS_ID,))
    grammars.add(req)
    tokenizer = grammars.backend._tokenizer
    text = '{"label":"dog","count":3}'
    tokens = tokenizer.encode(text, add_special_tokens=False)
    for i, token in enumerate(tokens):
        assert token in _allowed(grammars.bitmask([req])[0])
        grammars.feed([plain, req], [7, token])  # a plain row beside it is skipped
        assert grammars.take_ended() == ([] if i < len(tokens) - 1 else ["a"])
        # A step's tokens fed a second time: no mask asked for this one.
        with pytest.raises(RuntimeError, match="no grammar mask asked for"):
            grammars.feed([req], [token])
    assert _allowed(grammars.bitmask([req])[0]) == {EOS_ID}  # complete: only EOS may follow
    grammars.drop(["a"])
    assert len(grammars) == 0


def test_a_rejected_token_ends_the_request_and_a_stale_grammar_is_refused(grammars, caplog):
    req = _request("b", "json_object")
    grammars.add(req)
    grammars.bitmask([req])
    with pytest.raises(RuntimeError, match="behind its output"):
        grammars.bitmask([req])  # the last mask's token has not been fed
    grammars.feed([req], [grammars.backend._tokenizer.convert_tokens_to_ids("x")])  # not "{"
    assert grammars.take_ended() == ["b"]
    assert "rejected a sampled token" in caplog.text
    grammars.drop(["b"])


def test_a_dropped_requests_row_is_not_fed_to_a_new_grammar_under_its_id(grammars) -> None:
    """A finished or aborted request's last row is fed after its id was given to a new
    request: the token is the old request's, not the new grammar's; and an id that has a
    grammar cannot get a second one."""
    old, new = _request("c"), _request("c")
    grammars.add(old)
    first = grammars.bitmask([old]).copy()
    brace = int(np.flatnonzero(np.unpackbits(first[0].view(np.uint8), bitorder="little"))[0])
    grammars.drop(["c"])
    grammars.add(new)
    with pytest.raises(ValueError, match="already has a grammar"):
        grammars.add(_request("c"))
    grammars.feed([old], [brace])  # skipped: ``old`` has no grammar now
    with pytest.raises(RuntimeError, match="has no grammar"):
        grammars.bitmask([old])
    assert np.array_equal(grammars.bitmask([new]), first)
    grammars.drop(["c"])
    assert len(grammars) == 0


# ---- the sampler's mask -------------------------------------------------------------------


def _bitmask(allowed: list[set[int]], vocab_size: int) -> np.ndarray:
    bits = np.zeros((len(allowed), 32 * -(-vocab_size // 32)), dtype=np.uint8)
    for i, tokens in enumerate(allowed):
        bits[i, sorted(tokens)] = 1
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)  # [G, W]


def test_apply_token_bitmask_masks_exactly_the_forbidden_tokens() -> None:
    vocab, gen = 70, torch.Generator().manual_seed(0)  # 70: the last word is partly used
    logits = torch.randn(4, vocab, generator=gen)
    allowed = [{0, 31, 32, 69}, {5}]
    rows = torch.tensor([3, 1])
    out = apply_token_bitmask(logits, rows, torch.from_numpy(_bitmask(allowed, vocab)))
    want = logits.clone()
    for row, tokens in zip(rows.tolist(), allowed, strict=True):
        forbidden = [t for t in range(vocab) if t not in tokens]
        want[row, forbidden] = float("-inf")
    assert torch.equal(out, want)
    assert not torch.equal(out, logits)  # a copy: the input is not mutated


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_draws_only_allowed_tokens_in_constrained_rows(temperature: float) -> None:
    vocab, rows = 100, 6
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1))
    constrained = SamplingParams(temperature=temperature, seed=3, structured_output="json_object")
    plain = SamplingParams(temperature=temperature, seed=3)
    params = [constrained if i % 2 else plain for i in range(rows)]
    allowed = {1: {7, 8}, 3: {99}, 5: {0, 50, 64}}
    asked: list[list[int]] = []

    def token_bitmask(which: np.ndarray) -> np.ndarray:
        asked.append(which.tolist())
        return _bitmask([allowed[i] for i in which.tolist()], vocab)

    def build(params, token_bitmask=None) -> SamplingMetadata:
        return SamplingMetadata.build(
            params, [[1]] * rows, [[]] * rows, vocab, torch.device("cpu"),
            token_bitmask=token_bitmask,
        )  # fmt: skip

    got = Sampler()(logits, build(params, token_bitmask)).sampled_token_ids.tolist()
    assert asked == [[1, 3, 5]]
    for i, tokens in allowed.items():
        assert got[i] in tokens
    free = Sampler()(logits, build([plain] * rows)).sampled_token_ids.tolist()
    assert got[::2] == free[::2]  # seeded rows: their draw depends on nothing else
    given = logits.clone()
    mutated = Sampler()(given, build(params, token_bitmask), mutable=True)
    assert mutated.sampled_token_ids.tolist() == got
    assert torch.isinf(given[1]).sum() == vocab - 2  # masked where they were: no copy made
    with pytest.raises(ValueError, match="no token_bitmask"):
        build(params)


def test_greedy_constrained_rows_are_masked_in_the_logits_own_dtype() -> None:
    """bf16 logits the sampler may change: greedy rows are masked in place, in bf16, and take
    the argmax a float32 copy would give (the conversion is exact); with logits it may not
    change, a copy is masked and the caller's stay as they were."""
    vocab, rows = 100, 4
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(2))
    logits = logits.to(torch.bfloat16)
    greedy = SamplingParams(temperature=0, structured_output="json_object")
    params = [greedy, SamplingParams(temperature=0), greedy, greedy]
    allowed = {0: {3, 97}, 2: {50}, 3: set(range(0, vocab, 2))}

    def build() -> SamplingMetadata:
        return SamplingMetadata.build(
            params, [[1]] * rows, [[]] * rows, vocab, torch.device("cpu"),
            token_bitmask=lambda which: _bitmask([allowed[i] for i in which.tolist()], vocab),
        )  # fmt: skip

    want = logits.float()
    for i, tokens in allowed.items():
        want[i, [t for t in range(vocab) if t not in tokens]] = float("-inf")
    kept = logits.clone()
    assert Sampler()(kept, build()).sampled_token_ids.tolist() == want.argmax(-1).tolist()
    assert torch.equal(kept, logits)
    given = logits.clone()
    got = Sampler()(given, build(), mutable=True).sampled_token_ids
    assert got.tolist() == want.argmax(-1).tolist()
    assert given.dtype == torch.bfloat16 and torch.isinf(given[2]).sum() == vocab - 1


def test_logits_the_mask_kernel_does_not_take_are_masked_in_a_copy() -> None:
    """float64 logits (no mask kernel takes them): the greedy constrained rows are masked
    in a float32 copy even when the sampler may change the logits; the caller's stay."""
    vocab = 70
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(4)).double()
    params = [SamplingParams(temperature=0, structured_output="json_object")] * 2
    meta = SamplingMetadata.build(
        params, [[1]] * 2, [[]] * 2, vocab, torch.device("cpu"),
        token_bitmask=lambda which: _bitmask([{5}, {69}], vocab),
    )  # fmt: skip
    given = logits.clone()
    assert Sampler()(given, meta, mutable=True).sampled_token_ids.tolist() == [5, 69]
    assert torch.equal(given, logits)


# ---- the real model -------------------------------------------------------------------------


def _conversations() -> list[list[dict[str, str]]]:
    ask = "Classify this review as JSON with its sentiment and stars (1-5): "
    return [[{"role": "user", "content": ask + review}] for review in REVIEWS]


def test_smollm2_outputs_validate_and_plain_rows_beside_them_are_untouched(smollm2_llm) -> None:
    """One batch: each review constrained greedily and seeded at temperature 1, one
    "json_object" row, and two plain rows that must give what they give on their own."""
    convs = _conversations()
    greedy = SamplingParams(max_tokens=32, temperature=0, structured_output=REVIEW_SCHEMA)
    seeded = SamplingParams(
        max_tokens=32, temperature=1.0, seed=11, structured_output=REVIEW_SCHEMA
    )
    anything = SamplingParams(max_tokens=16, temperature=0, structured_output="json_object")
    plain = [
        SamplingParams(max_tokens=12, temperature=0),
        SamplingParams(max_tokens=12, temperature=0.8, seed=5),
    ]
    alone = smollm2_llm.chat(convs[:2], plain)
    outs = smollm2_llm.chat(
        [*convs, *convs, convs[0], *convs[:2]], [greedy] * 3 + [seeded] * 3 + [anything, *plain]
    )
    for out in outs[:6]:
        assert out.finish_reason == "stop", out.text
        validate(out.text, REVIEW_SCHEMA)
    assert outs[6].text.startswith("{")
    if outs[6].finish_reason == "stop":
        assert isinstance(json.loads(outs[6].text), dict)
    assert [o.token_ids for o in outs[7:]] == [o.token_ids for o in alone]
    assert len(smollm2_llm.engine._grammars) == 0  # every grammar dropped at its finish


# ---- the engine's other features, on a tiny random model ------------------------------------

BLOCK = 4


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("structured") / "m")


def _tiny_prompts(n: int) -> list[list[int]]:
    return [[(31 * i + 11 * t) % 250 + 5 for t in range(6 + i % 9)] for i in range(n)]


def _tiny_params(n: int) -> list[SamplingParams]:
    """Every third row plain; the rest constrained, greedy and seeded alternately."""
    return [
        SamplingParams(
            max_tokens=40,
            temperature=0 if i % 2 else 1.0,
            seed=i,
            structured_output=None if i % 3 == 0 else TINY_SCHEMA,
        )
        for i in range(n)
    ]


def _summary(outs: list[RequestOutput]) -> list[tuple]:
    return [(o.token_ids, o.finish_reason) for o in outs]


def _tiny(path: Path, **kwargs: Any) -> LLM:
    settings = dict(device="cpu", dtype="float32", block_size=BLOCK, kv_cache_memory=1 << 24)
    return LLM(str(path), **{**settings, **kwargs})


@pytest.fixture(scope="module")
def tiny_reference(tiny_path) -> list[RequestOutput]:
    """The synchronous run, without KV pressure: every constrained row completes its JSON."""
    params = _tiny_params(8)
    outs = _tiny(tiny_path, async_scheduling=False).generate(_tiny_prompts(8), params)
    for out, p in zip(outs, params, strict=True):
        if p.structured_output is not None:
            assert out.finish_reason == "stop"
            validate(out.text, TINY_SCHEMA)
    return outs


# 10 KV blocks of 4 tokens for 8 requests: preemption by recompute, again and again.
@pytest.mark.parametrize(
    ("async_scheduling", "kv_cache_memory"),
    [(True, 1 << 24), (False, 20480), (True, 20480)],
    ids=["async", "sync-preempting", "async-preempting"],
)
def test_async_scheduling_and_preemption_keep_grammars_in_step(
    tiny_path, tiny_reference, async_scheduling: bool, kv_cache_memory: int
) -> None:
    params = _tiny_params(8)
    llm = _tiny(tiny_path, async_scheduling=async_scheduling, kv_cache_memory=kv_cache_memory)
    got = llm.generate(_tiny_prompts(8), params)
    if kv_cache_memory < 1 << 24:  # the context shrinks to 40 tokens: compare the JSON rows
        assert llm.engine.scheduler.stats.num_preemptions > 0
        rows = [i for i, p in enumerate(params) if p.structured_output is not None]
    else:  # unconstrained rows keep the async overlap between constrained phases
        rows = list(range(len(params)))
    assert [_summary(got)[i] for i in rows] == [_summary(tiny_reference)[i] for i in rows]
    assert len(llm.engine._grammars) == 0 and not llm.engine.has_unfinished()


class _RecordingProposer:
    """Proposes wrong drafts for every row it is asked about, and remembers who asked."""

    max_drafts = 2

    def __init__(self) -> None:
        self.asked: set[str] = set()

    def propose(self, slots, rows: np.ndarray) -> np.ndarray:
        self.asked.update(r.request_id for r in slots.requests[rows])
        return np.full((len(rows), self.max_drafts), 7, dtype=np.int64)


def test_constrained_rows_take_drafts_and_keep_their_outputs(tiny_path) -> None:
    """Wrong drafts on every row, constrained ones included (their masks walk them:
    grammar_drafts.py): the outputs are the undrafted ones."""
    prompts, params = _tiny_prompts(6), _tiny_params(6)

    def run(proposer) -> dict[str, RequestOutput]:
        config = EngineConfig(
            model=str(tiny_path),
            device="cpu",
            dtype="float32",
            block_size=BLOCK,
            kv_cache_memory=1 << 24,
        )
        engine = LLMEngine(config, proposer)
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"r{i}", prompt, p)
        done: dict[str, RequestOutput] = {}
        while engine.has_unfinished():
            done.update((o.request_id, o) for o in engine.step())
        return done

    want = run(None)
    proposer = _RecordingProposer()
    got = run(proposer)
    assert {r: _summary([o]) for r, o in got.items()} == {r: _summary([o]) for r, o in want.items()}
    constrained = {f"r{i}" for i, p in enumerate(params) if p.structured_output is not None}
    assert constrained and constrained <= proposer.asked


def test_n_completions_each_follow_the_schema_and_aborts_drop_grammars(tiny_path) -> None:
    llm = _tiny(tiny_path)
    params = SamplingParams(
        n=3, max_tokens=40, temperature=1.0, seed=2, structured_output=TINY_SCHEMA
    )
    out = llm.generate(_tiny_prompts(1), params)[0]
    assert len(out.outputs) == 3
    for completion in out.outputs:
        assert completion.finish_reason == "stop"
        validate(completion.text, TINY_SCHEMA)
    engine = llm.engine
    engine.add_request("a", _tiny_prompts(1)[0], SamplingParams(structured_output=TINY_SCHEMA))
    assert len(engine._grammars) == 1
    engine.abort_requests(["a"])
    assert len(engine._grammars) == 0 and not engine.has_unfinished()


def test_llguidance_gets_one_eos_as_an_int_and_several_as_a_list_or_the_first(caplog) -> None:
    """Older llguidance releases (1.6.1) take one EOS id only, as an int: a single id goes
    as one, several as a list, and where the list is refused the first id, with a warning."""
    from tokenmill.engine.grammar_llguidance import LlguidanceGrammars

    calls: list[Any] = []

    def takes_an_int(tokenizer: Any, n_vocab: int, eos_token: Any) -> str:
        calls.append(eos_token)
        if not isinstance(eos_token, int):
            raise TypeError("argument 'eos_token': 'list' object cannot be interpreted")
        return f"tokenizer eos {eos_token}"

    assert LlguidanceGrammars(None, 64, [7])._with_eos(takes_an_int) == "tokenizer eos 7"
    assert calls == [7]
    with caplog.at_level("WARNING"):
        several = LlguidanceGrammars(None, 64, [7, 9])._with_eos(takes_an_int)
    assert several == "tokenizer eos 7" and calls[1:] == [[7, 9], 7]
    assert "takes one EOS id" in caplog.text
    assert LlguidanceGrammars(None, 64, [7, 9])._with_eos(
        lambda t, n_vocab, eos_token: eos_token
    ) == [7, 9]
